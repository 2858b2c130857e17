"""runtime.tracking against a real MLflow server (tests/_mlflow.py): the session's tiny run is a
parent run with a child run per stage; a cached stage links the run that produced it; a tracker
that goes away mid-run costs a warning per stage, never the run; one that never answers is
refused before anything starts."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from glmforge.pipeline import STAGES
from tests.flows.conftest import FAST, tracked

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
TRAINED = ("pretrain", "sft", "rl-reasoning", "rl-agentic", "reward-model", "rl-general", "distill")


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _children(client, experiment: str, run_id: str) -> tuple[str, dict]:
    exp = client.get_experiment_by_name(experiment)
    [parent] = client.search_runs([exp.experiment_id], f"tags.`glmforge.run_id` = '{run_id}'")
    kids = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
                              max_results=200)
    return parent, {k.data.tags["glmforge.stage"]: k for k in kids}


def test_every_stage_of_the_tiny_run_is_a_child_run_with_its_config_key_and_step_metrics(tiny_run, tracking_server):
    from glmforge.report import write_report
    from runtime.runner import RunRecord
    from runtime.store import LocalStore
    from runtime.tracking import log_report

    client = _client(tracking_server.uri)
    parent, kids = _children(client, "tiny-run", tiny_run.run_id)
    assert parent.info.status == "FINISHED"
    assert set(kids) == {s.name for s in STAGES}
    for name, run in kids.items():
        assert run.info.status == "FINISHED" and run.data.tags["glmforge.state"] == "done", name
        assert run.data.params["key"] == tiny_run.keys[name]
        assert any(p.startswith("config.") for p in run.data.params), name
        assert any(m.startswith("summary/") for m in run.data.metrics), name
    # a metric name MLflow refuses ("(0,1/4]", a pass-rate bin) is logged under a name it takes
    assert "summary/domains/arithmetic/histogram/_0_1/4_" in kids["rl-prompts"].data.metrics
    # parents' keys, and the per-step records of every training and RL stage at their steps
    assert kids["pretrain"].data.params["parent.pack"] == tiny_run.keys["pack"]
    for name in TRAINED:
        run = kids[name]
        stepped = [k for k in run.data.metrics if not k.startswith("summary/")]
        assert stepped, (name, sorted(run.data.metrics))
        history = client.get_metric_history(run.info.run_id, stepped[0])
        assert history and all(isinstance(h.step, int) for h in history), name
    loss = client.get_metric_history(kids["pretrain"].info.run_id, "loss")
    assert [h.step for h in loss] == sorted(h.step for h in loss) and len(loss) >= 6
    # plots and gates as artifacts, rollout samples as a table
    listed = {a.path for a in client.list_artifacts(kids["pretrain"].info.run_id)}
    assert any(p.endswith(".png") for p in listed), listed
    samples = [a.path for a in client.list_artifacts(kids["rl-general"].info.run_id)]
    assert "samples.json" in samples, samples
    table = json.loads(open(client.download_artifacts(kids["rl-general"].info.run_id, "samples.json")).read())
    assert table["data"] and "reward" in table["columns"], table["columns"]
    # the record and its report link the parent run
    store = LocalStore(tiny_run.home / "store")
    record = RunRecord.load(store, tiny_run.run_id)
    assert record.tracking["run_id"] == parent.info.run_id and record.tracking["link"].endswith(parent.info.run_id)
    page = write_report(store, record, tiny_run.home / "reports-tracked")
    assert f'href="{record.tracking["link"]}"' in page.read_text()
    log_report(record, page)                     # what the pipeline flow does after writing it
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "report")] == [f"report/{page.name}"]


def test_a_cached_stage_links_the_run_that_produced_its_artifact(tiny_run, tracking_server):
    from glmforge.config import load_config
    from runtime.runner import Runner, RunRecord, execute
    from runtime.store import LocalStore

    cfg = load_config("tiny", None, [*FAST, *tracked(tracking_server.uri, "tiny-run")])
    specs = [s for s in STAGES if s.name in ("ingest", "quality")]
    runner = Runner(cfg, LocalStore(tiny_run.home / "store"), specs, home=tiny_run.home)
    record = RunRecord.new(cfg, {"preset": "tiny"}, [s.name for s in specs])
    results = execute(runner, specs, record)
    assert {r.state for r in results.values()} == {"cached"}
    client = _client(tracking_server.uri)
    _, first = _children(client, "tiny-run", tiny_run.run_id)
    _, again = _children(client, "tiny-run", record.id)
    for name in ("ingest", "quality"):
        tags = again[name].data.tags
        assert tags["glmforge.state"] == "cached"
        assert tags["glmforge.produced_by"] == first[name].info.run_id
        assert not again[name].data.metrics and not again[name].data.params       # a link, not a copy


def test_a_tracker_that_stops_mid_run_costs_a_warning_per_stage_not_the_run(tmp_path, caplog):
    """The MLflow server killed after the first stage: the run completes, each later stage says
    once that it was not logged."""
    from glmforge.config import load_config
    from runtime.runner import Runner, RunRecord, execute
    from runtime.store import LocalStore
    from tests._mlflow import mlflow_server

    specs = [s for s in STAGES if s.name in ("ingest", "quality", "dedup-exact")]
    with mlflow_server(tmp_path / "mlflow") as server:
        cfg = load_config("tiny", None, [*FAST[:1], *tracked(server.uri, "dies")])
        runner = Runner(cfg, LocalStore(tmp_path / "store"), specs, home=tmp_path)
        record = RunRecord.new(cfg, {"preset": "tiny"}, [s.name for s in specs])

        def run_one(spec, parents):
            result = runner.run_stage(spec, parents)
            if spec.name == "ingest":
                server.stop()                   # before execute logs the stage
            return result

        with caplog.at_level(logging.WARNING, logger="glmforge"):
            results = execute(runner, specs, record, run_one=run_one)
    assert [r.state for r in results.values()] == ["done"] * 3 and record.state == "completed"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "tracking:" in r.getMessage()]
    stages = [w.split()[1] for w in warned if "the pipeline goes on" in w]
    assert stages[:3] == ["ingest", "quality", "dedup-exact"], warned
    assert len([w for w in warned if w.split()[1] in ("ingest", "quality", "dedup-exact")]) == 3, warned


def test_an_unreachable_tracking_uri_is_refused_in_one_line_before_anything_starts(tmp_path):
    env = {**os.environ, "GLMFORGE_HOME": str(tmp_path / "home"), "PREFECT_HOME": str(tmp_path / "prefect")}
    out = subprocess.run([sys.executable, "-m", "glmforge.cli", "run", "--preset", "tiny", "--set",
                          "tracking.backend=mlflow", "--set", "tracking.uri=http://user:s3cret@127.0.0.1:9"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [x for x in (out.stdout + out.stderr).splitlines() if x.strip()]
    assert len(lines) == 1 and "tracking.uri http://user:***@127.0.0.1:9 does not answer" in lines[0], lines
    assert "s3cret" not in out.stdout + out.stderr
    assert not (tmp_path / "home").exists()
