"""A throwaway MLflow tracking server (`mlflow server` from .venv-mlflow, `make mlflow-setup`):
SQLite backend and artifacts in a temporary folder, on 127.0.0.1; stopped by the caller."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests._postgres import free_port

REPO = Path(__file__).resolve().parent.parent
MLFLOW = REPO / ".venv-mlflow" / "bin" / "mlflow"


@dataclasses.dataclass
class MLflowServer:
    uri: str                    # the tracking URI, http://127.0.0.1:PORT
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        stop(self.proc)


@contextlib.contextmanager
def mlflow_server(root: Path, timeout: float = 120) -> Iterator[MLflowServer]:
    """Yields the server once /health answers."""
    if not MLFLOW.exists():
        raise RuntimeError(f"{MLFLOW} is missing: run `make mlflow-setup` (make test does)")
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = open(root / "mlflow-server.log", "wb")
    proc = subprocess.Popen(
        [str(MLFLOW), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root,
        env={**os.environ, "MLFLOW_ENABLE_TELEMETRY": "false", "DO_NOT_TRACK": "1"})
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(uri + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server not up on {uri}:\n{(root / 'mlflow-server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield MLflowServer(uri, proc, root / "mlflow-server.log")
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen) -> None:
    """The server's whole process group (uvicorn workers included), SIGKILL after 20 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
