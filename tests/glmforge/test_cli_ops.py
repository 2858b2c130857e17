"""Operations through the CLI: missing home folders are created, and a fully cached `glmforge run`
is recorded without starting Prefect."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
GLMFORGE = [sys.executable, "-m", "glmforge.cli"]


def _config(tmp_path: Path) -> Path:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"ops doc {i}"}) + "\n" for i in range(15)))
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["ingest"] = {"shard_size": 5, "sources": [{"name": "raw", "path": str(src)}]}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(args, env, timeout=300):
    return subprocess.run([*GLMFORGE, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_missing_homes_created_then_cached_run_skips_prefect(tmp_path):
    from tests.conftest import free_port

    config = _config(tmp_path)
    home, prefect_home = tmp_path / "a" / "b" / "home", tmp_path / "p" / "q"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(GLMFORGE_HOME=str(home), PREFECT_HOME=str(prefect_home))
    # Neither folder exists: Prefect's ephemeral server needs PREFECT_HOME for its database.
    first = _run(["run", "--config", str(config), "--until", "ingest"], env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert prefect_home.is_dir() and home.is_dir()
    assert "Prefect not started" not in first.stdout

    # Everything published: the run is recorded from the store alone. An API URL nothing
    # listens on makes any use of Prefect fail.
    dead = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"}
    second = _run(["run", "--config", str(config), "--until", "ingest"], dead, timeout=120)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "Prefect not started" in second.stdout
    status = json.loads(_run(["status", "--json"], dead).stdout)
    assert status["run"]["state"] == "completed" and status["run"]["config_file"] == str(config)
    assert [(s["name"], s["state"]) for s in status["stages"]] == [("ingest", "cached")]
    assert status["stages"][0]["metrics"]["documents"] == 15
    assert len(list((home / "store" / "runs").glob("*.json"))) == 2


def test_record_if_cached_needs_every_stage(tmp_path, monkeypatch):
    from glmforge.cached_run import record_if_cached
    from glmforge.config import load_config
    from glmforge.pipeline import STAGES, stages_until
    from glmforge.runner import Runner, RunRecord, execute
    from glmforge.store import LocalStore

    monkeypatch.setenv("GLMFORGE_HOME", str(tmp_path / "home"))
    cfg = load_config(None, _config(tmp_path))
    store = LocalStore(tmp_path / "store")
    source = {"preset": None, "config_file": "x", "overrides": [], "until": "quality"}
    assert record_if_cached(cfg, store, stages_until("quality"), source) is None
    assert RunRecord.load(store) is None  # nothing recorded when a stage is left to run

    runner = Runner(cfg, store, STAGES)
    ran = execute(runner, stages_until("ingest"), RunRecord.new(cfg, source, ["ingest"]))
    assert record_if_cached(cfg, store, stages_until("quality"), source) is None  # quality not published
    rec = record_if_cached(cfg, store, stages_until("ingest"), source)
    assert rec is not None and rec.state == "completed"
    assert [(s["name"], s["state"], s["key"]) for s in rec.stages] == [("ingest", "cached", ran["ingest"].key)]
    assert RunRecord.load(store).id == rec.id
    # a different config is a different key: not cached
    other = load_config(None, _config(tmp_path), ["ingest.shard_size=7"])
    assert record_if_cached(other, store, stages_until("ingest"), source) is None

