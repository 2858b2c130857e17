"""A throwaway PostgreSQL server from Debian's package (initdb and pg_ctl in a temporary folder),
for the tests and bench/prefect_db_load.py: started, used, stopped and removed."""
from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator


def postgres_bin() -> Path | None:
    """The folder of initdb / pg_ctl: on PATH, or Debian's /usr/lib/postgresql/<version>/bin."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return versions[-1].parent if versions else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def throwaway_postgres(max_connections: int = 200) -> Iterator[str]:
    """postgresql+asyncpg://glmforge:PASSWORD@127.0.0.1:PORT/prefect of a server that lives for
    the block (run as the `postgres` user, or `nobody`, when this runs as root: PostgreSQL
    refuses root). RuntimeError when PostgreSQL is not installed."""
    bindir = postgres_bin()
    if bindir is None:
        raise RuntimeError("PostgreSQL is not installed (Debian's postgresql package; .ci/run installs it)")
    root = Path(tempfile.mkdtemp(prefix="glmforge-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        user = "postgres"
        try:
            pwd.getpwnam(user)
        except KeyError:
            user = "nobody"
        shutil.chown(root, user)
        as_user = ["runuser", "-u", user, "--"]
    password = secrets.token_hex(12)
    (root / "pw").write_text(password)
    if as_user:
        shutil.chown(root / "pw", as_user[2])
    port = free_port()
    env = {**os.environ, "PGPASSWORD": password}

    def pg(*args: str) -> None:
        r = subprocess.run([*as_user, *args], capture_output=True, text=True, env=env, cwd=root)
        if r.returncode:
            raise RuntimeError(f"{Path(args[0]).name} failed: {(r.stdout + r.stderr)[-2000:]}")

    try:
        pg(str(bindir / "initdb"), "-D", str(root / "data"), "-U", "glmforge", "--pwfile", str(root / "pw"),
           "--auth=scram-sha-256", "-E", "UTF8")
        pg(str(bindir / "pg_ctl"), "-D", str(root / "data"), "-l", str(root / "server.log"), "-w", "-o",
           f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections={max_connections}", "start")
        try:
            pg(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "glmforge", "prefect")
            yield f"postgresql+asyncpg://glmforge:{password}@127.0.0.1:{port}/prefect"
        finally:
            pg(str(bindir / "pg_ctl"), "-D", str(root / "data"), "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)
