"""A local Prefect server, a process work pool, the deployments of prefect.yaml and a worker.

Used by `glmforge serve` and by the deployment test. Everything runs through the `prefect`
command of this environment, so this module does not import Prefect itself.

The server's database: SQLite at $PREFECT_HOME/prefect.db by default, held with the same lock a
run's ephemeral server takes (claim_prefect_database), so no second server opens that file; or
a PostgreSQL URL (`postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DB`), which a team running
several pipelines and workers needs (SQLite serialises writers: "database is locked"). The URL
is checked before anything starts, reaches only the server's process (never the worker or the
flow runs) and is shown with its password masked.

`serve_forever` keeps the server and the worker up: one that exits is started again (a worker
killed with its machine's flow run, a server that crashed), and everything stops only on Ctrl-C
or SIGTERM.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from runtime.gpus import CONCURRENCY_LIMIT, visible_gpus
from runtime.tracking import masked

REPO_ROOT = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).parent / "prefect")
# reruns a flow run that a preemption ended (see the file)
AUTOMATIONS = REPO_ROOT / "deployments" / "automations.yaml"


DATABASE_SETTINGS = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")
DATABASE_ENV = "GLMFORGE_PREFECT_DATABASE"   # `glmforge serve --database`'s variable
DATABASE_SCHEMES = ("postgresql+asyncpg", "sqlite+aiosqlite")
RESTARTS = 5            # restarts of one process within RESTART_WINDOW_S before serve gives up
RESTART_WINDOW_S = 600.0


def claim_prefect_database(home: Path):
    """The SQLite database for this process's Prefect server, and the open lock file that keeps
    it this process's alone: $PREFECT_HOME/prefect.db when no other glmforge process on this
    machine holds it, else prefect-run{N}.db of the first free slot N. Two servers on one SQLite
    file crash on its migrations and locks ("database is locked"). The flock ends with the
    process, however it ends, so a slot is reused by the next one."""
    import fcntl
    import itertools

    home.mkdir(parents=True, exist_ok=True)
    for slot in itertools.count():
        lock = open(home / f".glmforge-db-{slot}.lock", "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return home / ("prefect.db" if slot == 0 else f"prefect-run{slot}.db"), lock


def check_database(url: str, timeout: float = 5.0) -> None:
    """ValueError, one line naming the (masked) URL, unless the Prefect server can use `url`."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in DATABASE_SCHEMES:
        raise ValueError(f"database URL {masked(url)}: scheme {scheme or '(none)'!r} is not one the Prefect server "
                         "takes: postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DATABASE or sqlite+aiosqlite:///PATH")
    if scheme == "sqlite+aiosqlite":
        folder = Path(url.split(":///", 1)[-1]).expanduser().parent
        if not folder.is_dir():
            raise ValueError(f"database URL {masked(url)}: folder {folder} does not exist")
        return
    import asyncio

    import asyncpg

    async def probe() -> None:
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1), timeout=timeout)
        await conn.close()

    try:
        asyncio.run(asyncio.wait_for(probe(), timeout + 1))
    except (OSError, asyncio.TimeoutError, asyncpg.PostgresError, ValueError) as e:
        why = str(e).replace(urlsplit(url).password or "\0", "***") or type(e).__name__
        raise ValueError(f"database URL {masked(url)}: does not answer ({why.splitlines()[0]})") from None


def pool_prefect_yaml(src: Path, pool: str, dest: Path) -> Path:
    """Write `src` (a prefect.yaml) to `dest` with every deployment on work pool `pool`."""
    import yaml

    spec = yaml.safe_load(src.read_text())
    for d in spec.get("deployments") or []:
        d["work_pool"] = {**(d.get("work_pool") or {}), "name": pool}
    dest.write_text(yaml.safe_dump(spec, sort_keys=False))
    return dest


class LocalPrefect:
    """Start with `start()`, stop with `stop()` (or use as a context manager)."""

    def __init__(self, port: int = 4200, pool: str = "glmforge", home: Path | None = None, log_dir: Path | None = None,
                 database: str | None = None, automations: Path = AUTOMATIONS):
        self.port, self.pool, self.automations = port, pool, Path(automations)
        self.url = f"http://127.0.0.1:{port}/api"
        # the worker and the flow runs never see the database (its password)
        self.env = {k: v for k, v in os.environ.items() if k not in (*DATABASE_SETTINGS, DATABASE_ENV)}
        self.env.update({
            "PREFECT_API_URL": self.url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_API_URL": self.url,
            # flow runs send heartbeats: the zombie automation marks one whose heartbeats stop Crashed
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "30"),
        })
        if home is not None:
            Path(home).mkdir(parents=True, exist_ok=True)
            self.env["PREFECT_HOME"] = str(home)
        self.database = database
        self.log_dir = Path(log_dir) if log_dir else None
        self.server: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None

    def _popen(self, args: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        out = open(self.log_dir / f"{name}.log", "ab") if self.log_dir else None
        return subprocess.Popen(
            [PREFECT, *args], env=env or self.env, cwd=REPO_ROOT, stdout=out,
            stderr=subprocess.STDOUT if out else None, start_new_session=True,
        )

    def _prefect(self, *args: str) -> None:
        subprocess.run([PREFECT, *args], env=self.env, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)

    def start_server(self, timeout: float = 180) -> None:
        env = {**self.env, DATABASE_SETTINGS[0]: self.database} if self.database else None
        self.server = self._popen(["server", "start", "--host", "127.0.0.1", "--port", str(self.port)], "server", env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise RuntimeError(f"Prefect server exited with code {self.server.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"Prefect server not healthy at {self.url} after {timeout:.0f} s")

    def deploy(self) -> None:
        self._prefect("work-pool", "create", self.pool, "--type", "process", "--overwrite")
        # `prefect deploy --all` ignores --pool, so the deployments go through a copy of
        # prefect.yaml naming this pool. $PWD: the pull step's working directory is the repo.
        with tempfile.TemporaryDirectory(prefix="glmforge-deploy-") as tmp:
            spec = pool_prefect_yaml(REPO_ROOT / "prefect.yaml", self.pool, Path(tmp) / "prefect.yaml")
            subprocess.run([PREFECT, "--no-prompt", "deploy", "--all", "--prefect-file", str(spec)],
                           env={**self.env, "PWD": str(REPO_ROOT)}, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)
        self.install_automations(self.automations)
        self.limit_gpus(len(visible_gpus(self.env)))

    def limit_gpus(self, gpus: int) -> None:
        """The global concurrency limit `glmforge-gpus` at this machine's GPU count: a stage holds
        a slot per GPU while it runs (tasks.stage_task.gpu_slots). None on a machine without."""
        if gpus == 0:
            return
        created = subprocess.run([PREFECT, "global-concurrency-limit", "create", CONCURRENCY_LIMIT, "--limit",
                                  str(gpus)], env=self.env, cwd=REPO_ROOT, capture_output=True)
        if created.returncode != 0:     # kept by a server that outlived an earlier `serve`
            self._prefect("global-concurrency-limit", "update", CONCURRENCY_LIMIT, "--limit", str(gpus))

    def install_automations(self, path: Path = AUTOMATIONS) -> None:
        """Create the automations of `path`, replacing any of the same name (a server that
        outlives `glmforge serve` keeps them, and a second create would double every rerun)."""
        import yaml

        for a in yaml.safe_load(path.read_text())["automations"]:
            subprocess.run([PREFECT, "--no-prompt", "automation", "delete", a["name"]], env=self.env, cwd=REPO_ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # absent the first time
        self._prefect("automation", "create", "--from-file", str(path))

    def start_worker(self) -> None:
        self.worker = self._popen(["worker", "start", "--pool", self.pool, "--limit", "1"], "worker")

    def start(self) -> "LocalPrefect":
        self.start_server()
        self.deploy()
        self.start_worker()
        return self

    def stop(self) -> None:
        """Worker first, then server; each process group is waited for and SIGKILLed after
        20 s, also when its leader exited but left children (uvicorn, a flow run)."""
        from runtime.shutdown import descendants, process_ids, reap_orphans, shielded, stop_process_group

        with shielded():  # a second Ctrl-C / SIGTERM must not leave the server running
            # a flow run's own children (rank launchers, sandboxes) live in sessions of their own:
            # out of reach of the groups' signals, so seen now and waited for after
            seen = process_ids(descendants(os.getpid()))
            # A worker needs SIGTERM then SIGINT to stop promptly.
            for proc, sigs in ((self.worker, (signal.SIGTERM, signal.SIGINT)), (self.server, (signal.SIGTERM,))):
                if proc is not None:
                    stop_process_group(proc, sigs, timeout=20)
            reap_orphans(seen, timeout=20)

    def __enter__(self) -> "LocalPrefect":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(port: int = 4200, pool: str = "glmforge", database: str | None = None,
                  automations: Path = AUTOMATIONS) -> None:
    """`glmforge serve`: `database` a URL (checked first), else $PREFECT_HOME/prefect.db held
    with the runs' lock (or the next free slot's file)."""
    from runtime.shutdown import install

    install()  # SIGTERM (docker stop, systemd) stops everything as Ctrl-C does
    import socket

    with socket.socket() as probe:       # another server there would answer our health checks
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise ValueError(f"port {port} on 127.0.0.1 is in use (another Prefect server?); choose another "
                             "with --port")
    lock = None
    if database:
        check_database(database)
    else:
        path, lock = claim_prefect_database(Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser())
        database = f"sqlite+aiosqlite:///{path}"
    local = LocalPrefect(port=port, pool=pool, database=database, automations=automations)
    print(f"starting Prefect server on 127.0.0.1:{port} (database {masked(database)}) ...", flush=True)
    try:
        local.start()
        print(f"Prefect UI: http://127.0.0.1:{port}  (work pool {pool!r}; Ctrl-C or SIGTERM stops everything)", flush=True)
        keep_up(local)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through shutdown.install
        print("\nstopping ...", flush=True)
    finally:
        local.stop()
        if lock is not None:
            lock.close()


def keep_up(local: LocalPrefect, poll_s: float = 1.0) -> None:
    """Start the server or the worker again whenever it exits, until Ctrl-C / SIGTERM; give up
    (RuntimeError) on a process that exits RESTARTS times within RESTART_WINDOW_S."""
    exits: dict[str, list[float]] = {"server": [], "worker": []}
    while True:
        time.sleep(poll_s)
        for name in ("server", "worker"):
            proc = getattr(local, name)
            if proc is None or proc.poll() is None:
                continue
            now = time.monotonic()
            exits[name] = [t for t in exits[name] if now - t < RESTART_WINDOW_S] + [now]
            if len(exits[name]) > RESTARTS:
                raise RuntimeError(f"the Prefect {name} exited {len(exits[name])} times in "
                                   f"{RESTART_WINDOW_S / 60:.0f} minutes (last status {proc.returncode}); stopping")
            print(f"the Prefect {name} exited (status {proc.returncode}); starting it again", file=sys.stderr,
                  flush=True)
            if name == "server":
                local.start_server()
            else:
                local.start_worker()
