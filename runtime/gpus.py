"""The GPUs a stage holds on its node while it runs, so two stages never take the same ones.

A stage takes `stage_gpus` GPUs: its ranks on this node (`launch.nproc_per_node`), and for an
RL-side stage the replicas of the server pools it starts (rl.placement.local_gpus, through its
StageSpec). `claim_gpus` takes that many of the node's GPUs, one lock file each (`flock`, so a
holder killed with -9 frees its GPUs at once), waits while others hold them, and runs the stage
with CUDA_VISIBLE_DEVICES set to what it got: ranks and servers then number their devices from
0 inside the claim. A machine without GPUs claims nothing.

This is the node's half. Across a cluster, Kubernetes places pods by their `nvidia.com/gpu`
requests, and the Prefect layer (tasks.stage_task) holds as many slots of the global concurrency
limit `glmforge-gpus` while the stage runs, which `glmforge serve` sizes to the machine.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runtime.stage import resolve

log = logging.getLogger("glmforge")

LOCK_DIR_ENV = "GLMFORGE_GPU_LOCKS"
CONCURRENCY_LIMIT = "glmforge-gpus"  # the Prefect global concurrency limit (tasks.stage_task, serve)


class GpuShortage(RuntimeError):
    """A stage needs more GPUs than this machine shows it."""


def visible_gpus(env: dict[str, str] | None = None, dev: Path = Path("/dev")) -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES when set (as CUDA reads it, up to the
    first invalid entry), else the NVIDIA device files /dev/nvidia0, 1, ..."""
    env = os.environ if env is None else env
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        out = []
        for d in (s.strip() for s in given.split(",")):
            if not d or d.startswith("-"):
                break
            out.append(d)
        return out
    found = [int(m.group(1)) for p in dev.glob("nvidia*") if (m := re.fullmatch(r"nvidia(\d+)", p.name))]
    return [str(i) for i in sorted(found)]


def ranks_on_node(section: Any) -> int:
    """The ranks a stage starts on its node: `launch.nproc_per_node` of the section, or of its
    `parallel` part (the RL stages); 0 for a stage without ranks."""
    for owner in (section, getattr(section, "parallel", None)):
        launch = getattr(owner, "launch", None)
        if launch is not None and hasattr(launch, "nproc_per_node"):
            return int(launch.nproc_per_node)
    return 0


def stage_gpus(spec: Any, section: Any) -> int:
    """GPUs the stage `spec` takes on its node with this config section (StageSpec.gpus)."""
    return int((resolve(spec.gpus) if spec.gpus else ranks_on_node)(section))


def default_lock_dir() -> Path:
    return Path(os.environ.get(LOCK_DIR_ENV) or f"/tmp/glmforge-gpu-locks-{os.getuid()}")


def _holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return "?"
    return f"{h.get('stage', '?')} (pid {h.get('pid', '?')} on {h.get('host', '?')})"


@contextlib.contextmanager
def claim_gpus(stage: str, count: int, devices: list[str] | None = None, lock_dir: Path | None = None,
               poll_s: float = 5.0, wait_s: float = float("inf")) -> Iterator[list[str]]:
    """Hold `count` of `devices` (visible_gpus()) for the `with` block, with CUDA_VISIBLE_DEVICES
    set to them; yields the ones held ([] and nothing set when count is 0 or there are no GPUs).
    Waits, logging who holds them, while fewer are free; TimeoutError after wait_s."""
    devices = visible_gpus() if devices is None else devices
    if count <= 0 or not devices:
        yield []
        return
    if count > len(devices):
        raise GpuShortage(f"{stage} needs {count} GPUs; this machine shows {len(devices)} "
                          f"(CUDA_VISIBLE_DEVICES or /dev/nvidia*): {','.join(devices)}")
    lock_dir = lock_dir or default_lock_dir()
    lock_dir.mkdir(parents=True, exist_ok=True)
    held: list[tuple[str, int]] = []
    start, warned = time.monotonic(), False
    try:
        while True:
            for d in devices:
                if len(held) == count:
                    break
                fd = os.open(lock_dir / f"gpu-{d}.lock", os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                held.append((d, fd))
            if len(held) == count:
                break
            for _, fd in held:          # all or nothing: two waiting stages never hold halves
                os.close(fd)
            held = []
            if time.monotonic() - start > wait_s:
                raise TimeoutError(f"{stage}: {count} GPUs not free within {wait_s:.0f} s")
            if not warned:
                busy = sorted({_holder(lock_dir / f"gpu-{d}.lock") for d in devices})
                log.info("%s: waiting for %d of %d GPUs; held by %s", stage, count, len(devices), ", ".join(busy))
                warned = True
            time.sleep(poll_s)
        note = json.dumps({"stage": stage, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
        for _, fd in held:
            os.ftruncate(fd, 0)
            os.pwrite(fd, note.encode(), 0)
        ids = [d for d, _ in held]
        before = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        log.info("%s: holds GPUs %s", stage, ",".join(ids))
        try:
            yield ids
        finally:
            if before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before
    finally:
        for _, fd in held:
            os.close(fd)            # closing the descriptor drops its flock
