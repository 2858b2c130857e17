"""The Prefect server's database under glmforge's own load: SQLite (the laptop default) beside
PostgreSQL (a throwaway server, tests/_postgres.py), same work, same script.

    python bench/prefect_db_load.py [--pipelines 4] [--deployment-runs 6] [--schedule-every 10]
                                    [--schedule-for 60] [--json]

Per database: `glmforge serve` (its worker) plus a second worker on the same pool; then at once:
`pipelines` runs of `glmforge run --until issue-pr` reporting to the server (each a flow run with
its tasks), `deployment-runs` runs of the stage-issue-pr deployment through the two workers, and
an interval schedule on that deployment firing every `schedule-every` seconds for the first
`schedule-for` seconds (then turned off, its runs not yet due deleted). Counted: flow runs completed, failed or crashed, and left unfinished; API errors (HTTP 5xx
and "database is locked" in every process's output); seconds until the submitted work ended.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from glmforge import schedules  # noqa: E402
from tests._postgres import free_port, throwaway_postgres  # noqa: E402

GLMFORGE = [sys.executable, "-m", "glmforge.cli"]
PREFECT = str(Path(sys.executable).parent / "prefect")
API_ERROR = re.compile(r"database is locked|HTTP (?:Error )?5\d\d|\b5\d\d (?:Internal Server Error|Service Unavailable)"
                       r"|OperationalError", re.I)


def load(database: str | None, args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="glmforge-dbload-"))
    port, pool = free_port(), "load"
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect-home"), "GLMFORGE_HOME": str(tmp / "home"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "2",
           "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2"}
    env.pop("PREFECT_API_URL", None)
    if database:
        env["GLMFORGE_PREFECT_DATABASE"] = database
    logs = tmp / "logs"
    logs.mkdir()
    serve = subprocess.Popen([*GLMFORGE, "serve", "--port", str(port), "--pool", pool], env=env, cwd=REPO,
                             stdout=open(logs / "serve.log", "wb"), stderr=subprocess.STDOUT)
    client_env = {k: v for k, v in env.items() if k != "GLMFORGE_PREFECT_DATABASE"} | {"PREFECT_API_URL": api}
    procs: list[subprocess.Popen] = []
    worker2: subprocess.Popen | None = None
    try:
        deadline = time.monotonic() + 300
        while "Prefect UI:" not in (logs / "serve.log").read_text(errors="replace"):
            if serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("glmforge serve did not start:\n" + (logs / "serve.log").read_text()[-3000:])
            time.sleep(1)
        worker2 = subprocess.Popen([PREFECT, "worker", "start", "--pool", pool, "--limit", "2"], env=client_env,
                                   cwd=REPO, stdout=open(logs / "worker2.log", "wb"), stderr=subprocess.STDOUT,
                                   start_new_session=True)
        t0 = time.monotonic()
        for i in range(args.pipelines):
            procs.append(subprocess.Popen([*GLMFORGE, "run", "--until", "issue-pr"], env=client_env, cwd=REPO,
                                          stdout=open(logs / f"run{i}.log", "wb"), stderr=subprocess.STDOUT))
        submitted = 0
        for _ in range(args.deployment_runs):
            r = subprocess.run([PREFECT, "deployment", "run", "glmforge-stage/stage-issue-pr"], env=client_env,
                               cwd=REPO, capture_output=True, text=True)
            (logs / "submit.log").open("a").write(r.stdout + r.stderr)
            submitted += r.returncode == 0
        schedules.add(api, "glmforge-stage/stage-issue-pr", every=args.schedule_every)
        for p in procs:
            p.wait(timeout=900)
        time.sleep(max(0.0, t0 + args.schedule_for - time.monotonic()))
        schedules.set_active(api, "glmforge-stage/stage-issue-pr", False)
        for r in _all_runs(api):
            if r["state_type"] == "SCHEDULED" and r.get("expected_start_time", "") > _now():
                schedules.call(api, "DELETE", f"/flow_runs/{r['id']}")     # not due yet: never started
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:   # every run that is due has ended
            runs = _all_runs(api)
            if not [r for r in runs if r["state_type"] in ("RUNNING", "PENDING", "SCHEDULED", "CANCELLING")]:
                break
            time.sleep(2)
        seconds = time.monotonic() - t0
        runs = _all_runs(api)
        started = [r for r in runs if r["state_type"] != "SCHEDULED"]
        states = {}
        for r in started:
            states[r["state_type"]] = states.get(r["state_type"], 0) + 1
    finally:
        if worker2 is not None:
            worker2.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker2.wait(timeout=30)
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=120)
        for p in procs:
            if p.poll() is None:
                p.kill()
    errors = sum(len(API_ERROR.findall(f.read_text(errors="replace"))) for f in logs.glob("*.log"))
    out = {"database": "postgresql" if database else "sqlite", "flow_runs": len(started),
           "completed": states.get("COMPLETED", 0), "failed": states.get("FAILED", 0) + states.get("CRASHED", 0),
           "unfinished": sum(v for k, v in states.items() if k not in ("COMPLETED", "FAILED", "CRASHED")),
           "pipelines_ok": sum(p.returncode == 0 for p in procs), "deployment_runs_submitted": submitted,
           "api_errors": errors, "seconds": round(seconds, 1)}
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def _all_runs(api: str) -> list[dict]:
    """Every flow run on the server (the API gives at most 200 a call)."""
    out: list[dict] = []
    while True:
        page = schedules.call(api, "POST", "/flow_runs/filter", {"limit": 200, "offset": len(out)})
        out += page
        if len(page) < 200:
            return out


def _now() -> str:
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc).isoformat()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pipelines", type=int, default=4)
    ap.add_argument("--deployment-runs", type=int, default=6)
    ap.add_argument("--schedule-every", type=float, default=10.0)
    ap.add_argument("--schedule-for", type=float, default=60.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [load(None, args)]
    with throwaway_postgres() as url:
        rows.append(load(url, args))
    if args.json:
        print(json.dumps({"rows": rows, "settings": vars(args)}))
        return
    print("database     flow runs  completed  failed  unfinished  pipelines ok  API errors  seconds")
    for r in rows:
        print(f"{r['database']:<12} {r['flow_runs']:>9}  {r['completed']:>9}  {r['failed']:>6}  {r['unfinished']:>10}  "
              f"{r['pipelines_ok']:>5}/{args.pipelines:<6}  {r['api_errors']:>10}  {r['seconds']:>7}")


if __name__ == "__main__":
    main()
