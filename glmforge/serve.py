"""A local Prefect server, a process work pool, the deployments of prefect.yaml and a worker.

Used by `glmforge serve` and by the deployment test. Everything runs through the `prefect`
command of this environment, so this module does not import Prefect itself."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).parent / "prefect")
# reruns a flow run that a preemption ended (see the file)
AUTOMATIONS = REPO_ROOT / "deployments" / "automations.yaml"


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

    def __init__(self, port: int = 4200, pool: str = "glmforge", home: Path | None = None, log_dir: Path | None = None):
        self.port, self.pool = port, pool
        self.url = f"http://127.0.0.1:{port}/api"
        self.env = {
            **os.environ,
            "PREFECT_API_URL": self.url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_API_URL": self.url,
        }
        if home is not None:
            Path(home).mkdir(parents=True, exist_ok=True)
            self.env["PREFECT_HOME"] = str(home)
        self.log_dir = Path(log_dir) if log_dir else None
        self.server: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None

    def _popen(self, args: list[str], name: str) -> subprocess.Popen:
        out = open(self.log_dir / f"{name}.log", "wb") if self.log_dir else None
        return subprocess.Popen(
            [PREFECT, *args], env=self.env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )

    def _prefect(self, *args: str) -> None:
        subprocess.run([PREFECT, *args], env=self.env, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)

    def start_server(self, timeout: float = 180) -> None:
        self.server = self._popen(["server", "start", "--host", "127.0.0.1", "--port", str(self.port)], "server")
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
        self.install_automations()

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
        from glmforge.shutdown import descendants, process_ids, reap_orphans, shielded, stop_process_group

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


def serve_forever(port: int = 4200, pool: str = "glmforge") -> None:
    from glmforge.shutdown import install

    install()  # SIGTERM (docker stop, systemd) stops everything as Ctrl-C does
    local = LocalPrefect(port=port, pool=pool)
    print(f"starting Prefect server on 127.0.0.1:{port} ...", flush=True)
    try:
        local.start()
        print(f"Prefect UI: http://127.0.0.1:{port}  (work pool {pool!r}; Ctrl-C or SIGTERM stops everything)", flush=True)
        while all(p is not None and p.poll() is None for p in (local.server, local.worker)):
            time.sleep(1)
        print("a Prefect process exited; stopping", file=sys.stderr)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through shutdown.install
        print("\nstopping ...", flush=True)
    finally:
        local.stop()
