"""`glmforge serve` on PostgreSQL: a throwaway server from Debian's package (initdb and pg_ctl in a
temporary folder, started and stopped here, as the S3 tests start SeaweedFS), a pipeline run
against it, the worker killed and started again, and the database URL, password included,
checked before anything starts and never shown."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._postgres import postgres_bin, throwaway_postgres
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
GLMFORGE = [sys.executable, "-m", "glmforge.cli"]


@pytest.fixture(scope="module")
def postgres():
    """A throwaway PostgreSQL server's URL for this module (tests/_postgres.py)."""
    if postgres_bin() is None:
        pytest.skip("PostgreSQL is not installed (Debian's postgresql package; .ci/run installs it)")
    with throwaway_postgres() as url:
        yield url


def _serve_fails(url: str, tmp_path: Path) -> subprocess.CompletedProcess:
    port = free_port()
    r = subprocess.run([*GLMFORGE, "serve", "--port", str(port)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "GLMFORGE_PREFECT_DATABASE": url, "PREFECT_HOME": str(tmp_path / "ph")})
    import socket

    with socket.socket() as s:                       # nothing was started
        assert s.connect_ex(("127.0.0.1", port)) != 0
    return r


def test_a_database_url_is_checked_before_anything_starts(tmp_path):
    closed = free_port()
    r = _serve_fails(f"postgresql+asyncpg://glmforge:s3cret-pw@127.0.0.1:{closed}/prefect", tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "does not answer" in lines[0], r.stderr
    assert f"postgresql+asyncpg://glmforge:***@127.0.0.1:{closed}/prefect" in lines[0]
    assert "s3cret-pw" not in r.stdout + r.stderr
    r = _serve_fails("mysql://glmforge:s3cret-pw@db/prefect", tmp_path)
    assert r.returncode == 2 and "scheme 'mysql' is not one the Prefect server takes" in r.stderr
    assert "s3cret-pw" not in r.stdout + r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_serve_refuses_a_port_another_server_holds(tmp_path):
    """Another server on the port would answer serve's health checks in place of its own."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run([*GLMFORGE, "serve", "--port", str(port)], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PREFECT_HOME": str(tmp_path / "ph")})
    assert r.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in r.stderr, r.stderr


async def _flow_run_states(url: str) -> list[tuple[str, str]]:
    import asyncpg

    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        rows = await conn.fetch("SELECT name, state_type FROM flow_run")
    finally:
        await conn.close()
    return [(r["name"], str(r["state_type"])) for r in rows]


@pytest.mark.slow
def test_serve_on_postgres_runs_the_pipeline_and_outlives_its_worker(postgres, tmp_path):
    """serve on the Postgres URL (given in the environment): a `glmforge run` reports to it and
    its flow run is in Postgres, Completed; the worker killed with -9 is started again while the
    server stays up; the password is in no output and not in the worker's environment; SIGTERM
    stops it all."""
    import psutil

    from tasks.schedules import call

    password = postgres.split(":")[2].split("@")[0]
    port, pool = free_port(), "pg-pool"
    env = {**os.environ, "GLMFORGE_PREFECT_DATABASE": postgres, "PREFECT_HOME": str(tmp_path / "prefect-home"),
           "GLMFORGE_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([*GLMFORGE, "serve", "--port", str(port), "--pool", pool], env=env, cwd=REPO,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 300
        while "Prefect UI:" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        assert "database postgresql+asyncpg://glmforge:***@" in log.read_text()
        run = subprocess.run([*GLMFORGE, "run", "--until", "issue-pr"], env={**env, "PREFECT_API_URL": api}, cwd=REPO,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert ("COMPLETED" in {s.split(".")[-1] for _, s in asyncio.run(_flow_run_states(postgres))})

        def worker() -> psutil.Process | None:
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if "worker" in p.cmdline() and pool in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                        return p
                except psutil.Error:          # gone, or a zombie not yet reaped by serve
                    continue
            return None

        old = worker()
        assert old is not None and password not in "\0".join(f"{k}={v}" for k, v in old.environ().items())
        os.killpg(old.pid, signal.SIGKILL)
        deadline, new = time.monotonic() + 60, None
        while time.monotonic() < deadline and (new is None or new.pid == old.pid):
            assert call(api, "GET", "/health") is True
            time.sleep(0.5)
            new = worker()
        assert new is not None and new.pid != old.pid, log.read_text()[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=90)
    shown = log.read_text(errors="replace")
    assert rc == 0 and "the Prefect worker exited" in shown and password not in shown + run.stdout + run.stderr
