"""Per-stage deployments (prefect.yaml's glmforge-stage/stage-*) run by a process worker on a
local Prefect server, against a store a pipeline run already filled: a stage with parents
resumes into its run as cached, a training stage with a changed config trains and publishes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.flows.conftest import FAST

REPO = Path(__file__).resolve().parents[2]
GLMFORGE = [sys.executable, "-m", "glmforge.cli"]
PREFECT = str(Path(sys.executable).parent / "prefect")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _status(home: Path, *args: str) -> dict:
    out = subprocess.run([*GLMFORGE, "status", "--json", *args], env={**os.environ, "GLMFORGE_HOME": str(home)},
                         cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _stage(status: dict, name: str) -> dict:
    return next(s for s in status["stages"] if s["name"] == name)


def test_stage_deployments_with_parents_run_on_a_process_worker(tiny_run, tmp_path):
    from glmforge.serve import LocalPrefect
    from tests.conftest import free_port

    local = LocalPrefect(port=free_port(), home=tmp_path / "prefect-home", log_dir=tmp_path)
    local.env["GLMFORGE_HOME"] = str(tiny_run.home)
    local.env["PREFECT_WORKER_QUERY_SECONDS"] = "2"
    store = str(tiny_run.home / "store")

    def deployment_run(name: str, params: dict) -> str:
        run = subprocess.run([PREFECT, "deployment", "run", f"glmforge-stage/{name}", "--params", json.dumps(params),
                              "--watch", "--watch-timeout", "900"],
                             env=local.env, cwd=REPO, capture_output=True, text=True, timeout=1000)
        assert run.returncode == 0 and "Completed" in run.stdout, \
            run.stdout[-2000:] + run.stderr[-2000:] + (tmp_path / "worker.log").read_text()[-4000:]
        return run.stdout

    with local:
        # dedup-exact (parents ingest -> quality) resumed into the pipeline's own run: cached
        deployment_run("stage-dedup-exact", {"run_id": tiny_run.run_id, "store": store})
        shown = _stage(_status(tiny_run.home, "--run", tiny_run.run_id), "dedup-exact")
        assert shown["state"] == "cached" and shown["key"] == tiny_run.keys["dedup-exact"]

        # pretrain with fewer steps: a new key, its parents (pack, tokenize) reused, trained now
        deployment_run("stage-pretrain", {"preset": "tiny", "overrides": [*FAST, "pretrain.max_steps=2"],
                                          "store": store})
    latest = _status(tiny_run.home)
    assert [s["name"] for s in latest["stages"]] == ["pretrain"] and latest["run"]["state"] == "completed"
    shown = _stage(latest, "pretrain")
    assert shown["state"] == "done" and shown["key"] != tiny_run.keys["pretrain"]
    assert shown["metrics"]["steps"] == 2 and shown["metrics"]["resumed_from_step"] == 0
    assert shown["artifact"].endswith(f"artifacts/pretrain/{shown['key']}")
