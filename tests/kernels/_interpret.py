"""Run a check function in a fresh Python process with the Triton interpreter switched on.

TRITON_INTERPRET must be set before `triton.jit` decorates the kernels, i.e. before kernels/ is
first imported; other test modules may already have imported it in this process, so each Triton
check runs in a subprocess of its own. The interpreter executes kernels on CPU tensors.

GLMFORGE_TEST_DEVICE=cuda (bench/gpu_check.py sets it on a GPU machine) runs the same checks
compiled on the GPU instead: the subprocess starts without TRITON_INTERPRET and every tensor the
check creates is put on CUDA (see `on_device`). Unset or "cpu": the interpreter, as above.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEVICE_ENV = "GLMFORGE_TEST_DEVICE"


def check_device() -> str:
    """The device the Triton checks run on: "cpu" (interpreter, the default) or "cuda"."""
    device = os.environ.get(DEVICE_ENV, "cpu") or "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV} must be 'cpu' or 'cuda', got {device!r}")
    return device



def run_interpreted(module: str, function: str, timeout: float = 120) -> None:
    """Import `module` and call `function()` under TRITON_INTERPRET=1 (or compiled on CUDA when
    GLMFORGE_TEST_DEVICE=cuda); fail with its stderr."""
    pytest.importorskip("triton")
    if check_device() == "cuda":
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        # keep the caller's PYTHONPATH: on a GPU machine extra packages may be installed there
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        code = (f"from tests.kernels._interpret import on_device; from {module} import {function}; "
                f"on_device({function}, 'cuda')")
        how = "compiled on CUDA"
    else:
        # one thread: the interpreter runs tiny numpy ops, where a thread pool only adds waiting
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        code = f"from {module} import {function}; {function}()"
        how = "under the interpreter"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{module}.{function} failed {how}:\n{proc.stderr}"


def on_device(fn, device: str) -> None:
    """Call fn() with every tensor it creates without naming a device put on `device`.

    Like torch.set_default_device, except that a draw from an explicit CPU generator (the
    checks seed torch.Generator() for their inputs) is made on CPU and then moved, so the
    inputs are the very numbers the CPU run uses; set_default_device would refuse the generator.
    """
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors

    constructors = _device_constructors()

    class _OnDevice(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in constructors and kwargs.get("device") is None:
                gen = kwargs.get("generator")
                if gen is not None and gen.device.type == "cpu":
                    grad = kwargs.pop("requires_grad", False)
                    return func(*args, **kwargs).to(device).requires_grad_(grad)
                kwargs["device"] = device
            return func(*args, **kwargs)

    with _OnDevice():
        fn()


def require_interpreter() -> None:
    """Guard for check functions: they run under the interpreter, or compiled on a GPU that
    GLMFORGE_TEST_DEVICE=cuda asked for, never compiled by accident."""
    if check_device() == "cuda":
        import torch

        assert torch.cuda.is_available(), f"{DEVICE_ENV}=cuda but torch sees no CUDA device"
        return
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through run_interpreted()"
