"""Run a check function in a fresh Python process with the Triton interpreter switched on.

TRITON_INTERPRET must be set before `triton.jit` decorates the kernels, i.e. before kernels/ is
first imported; other test modules may already have imported it in this process, so each Triton
check runs in a subprocess of its own. The interpreter executes kernels on CPU tensors.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, function: str, timeout: float = 120) -> None:
    """Import `module` and call `function()` under TRITON_INTERPRET=1; fail with its stderr."""
    pytest.importorskip("triton")
    # one thread: the interpreter runs tiny numpy ops, where a thread pool only adds waiting
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    code = f"from {module} import {function}; {function}()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{module}.{function} failed under the interpreter:\n{proc.stderr}"


def require_interpreter() -> None:
    """Guard for check functions: they must not run compiled (no GPU here)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through run_interpreted()"
