"""`glmforge serve --pool NAME` (the session's, tests/flows/conftest.served) and `glmforge schedule`:
deployments on a work pool other than the default, a short interval schedule, and the process
worker running it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
GLMFORGE = [sys.executable, "-m", "glmforge.cli"]


def _glmforge(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([*GLMFORGE, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_interval_schedule_runs_on_a_named_pool(served, tmp_path):
    from tasks.schedules import PIPELINE_DEPLOYMENT, deployment

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"scheduled doc {i}"}) + "\n" for i in range(12)))
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["ingest"] = {"shard_size": 5, "sources": [{"name": "raw", "path": str(src)}]}
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env, ingest = served.env, "glmforge-stage/stage-ingest"

    # every deployment landed on the pool asked for, not on the one prefect.yaml names
    assert served.pool != "glmforge"
    assert deployment(served.api, ingest)["work_pool_name"] == served.pool
    assert deployment(served.api, PIPELINE_DEPLOYMENT)["work_pool_name"] == served.pool

    # the nightly cron is there and off; on/off flip it
    ls = _glmforge("schedule", "ls", env=env)
    assert ls.returncode == 0, ls.stderr
    nightly = [line for line in ls.stdout.splitlines() if line.startswith(PIPELINE_DEPLOYMENT)]
    assert len(nightly) == 1 and " off " in nightly[0] and "0 2 * * *" in nightly[0], ls.stdout
    assert " on " in _glmforge("schedule", "on", env=env).stdout
    assert " off " in _glmforge("schedule", "off", env=env).stdout
    assert not any(s["active"] for s in deployment(served.api, PIPELINE_DEPLOYMENT)["schedules"])

    added = _glmforge("schedule", "add", ingest, "--every", "5", "--param", f"config_file={config}",
                      "--param", "preset=null", env=env)
    assert added.returncode == 0, added.stdout + added.stderr
    assert "every 5 s" in added.stdout

    # the scheduler creates the runs, the worker on the pool runs the first one
    deadline, record = time.monotonic() + 240, None
    try:
        while time.monotonic() < deadline:
            status = _glmforge("status", "--json", env=env)
            if status.returncode == 0:
                record = json.loads(status.stdout)
                if record["run"].get("config_file") == str(config) and record["run"]["state"] in ("completed", "failed"):
                    break
            time.sleep(2)
    finally:
        _glmforge("schedule", "off", ingest, env=env)
        _cancel_scheduled(served.api, ingest.split("/")[1])  # the server outlives this test
    assert record is not None and record["run"]["state"] == "completed", f"{record}\n{served.logs(3000)}"
    assert record["run"]["config_file"] == str(config)
    assert record["stages"][0]["name"] == "ingest" and record["stages"][0]["metrics"]["documents"] == 12


def _cancel_scheduled(api: str, deployment: str) -> None:
    """Delete the runs the interval schedule created ahead that have not started."""
    from tasks.schedules import ScheduleError, call

    ahead = call(api, "POST", "/flow_runs/filter", {"deployments": {"name": {"any_": [deployment]}},
                                                    "flow_runs": {"state": {"type": {"any_": ["SCHEDULED", "PENDING"]}}}})
    for run in ahead:
        try:
            call(api, "DELETE", f"/flow_runs/{run['id']}")
        except ScheduleError as e:  # started and finished meanwhile
            if "HTTP 404" not in str(e):
                raise


def test_schedule_without_server_says_how_to_start_one(tmp_path):
    from tests.conftest import free_port

    env = {**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"}
    r = _glmforge("schedule", "ls", env=env)
    assert r.returncode == 2 and "glmforge serve" in r.stderr
    r = _glmforge("schedule", "add", "no-slash", "--every", "5", env=env)
    assert r.returncode == 2 and "FLOW/DEPLOYMENT" in r.stderr
