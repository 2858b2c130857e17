"""The real Prefect flows: caching across runs, SIGKILL + resume, status (deployments run by a
worker: test_deployments.py, test_schedule.py, test_browser_ui.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
GLMFORGE = [sys.executable, "-m", "glmforge.cli"]


def _write_config(tmp_path: Path, source: Path, shard_size: int = 10) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["ingest"] = {"shard_size": shard_size, "sources": [{"name": "raw", "path": str(source)}]}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env(prefect_server: str, home: Path) -> dict[str, str]:
    return {**os.environ, "PREFECT_API_URL": prefect_server, "GLMFORGE_HOME": str(home)}


def _task_states(flow_run_id) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def fetch():
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            return {r.name.rsplit("-", 1)[0]: r.state.name for r in runs}

    import asyncio

    return asyncio.run(fetch())


def test_ingest_twice_second_is_cached(prefect_server, tmp_path, monkeypatch):
    from flows.end_to_end import pipeline

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(30)) + "{oops\n")
    config = _write_config(tmp_path, src)
    monkeypatch.setenv("GLMFORGE_HOME", str(tmp_path / "home"))

    first = pipeline(preset=None, config_file=str(config), until="ingest", return_state=True)
    second = pipeline(preset=None, config_file=str(config), until="ingest", return_state=True)
    r1, r2 = first.result(), second.result()
    assert [s["state"] for s in r1["stages"]] == ["done"]
    assert [s["state"] for s in r2["stages"]] == ["cached"]
    assert r1["stages"][0]["key"] == r2["stages"][0]["key"]
    assert r2["stages"][0]["metrics"]["quarantined"] == 1
    assert _task_states(first.state_details.flow_run_id) == {"ingest": "Completed"}
    assert _task_states(second.state_details.flow_run_id) == {"ingest": "Cached"}


def test_sigkill_mid_stage_then_resume_matches_uninterrupted(prefect_server, tmp_path):
    src = tmp_path / "big.jsonl"
    with open(src, "w") as f:
        for i in range(60_000):
            f.write(json.dumps({"text": f"document {i} " + "lorem ipsum dolor " * 5}) + "\n")
            if i % 10_000 == 5:
                f.write("{broken json\n")
    config = _write_config(tmp_path, src, shard_size=2_000)
    killed_home, clean_home = tmp_path / "killed", tmp_path / "clean"

    proc = subprocess.Popen([*GLMFORGE, "run", "--config", str(config), "--until", "ingest"],
                            env=_env(prefect_server, killed_home), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    cursor = None
    while time.monotonic() < deadline and proc.poll() is None:
        cursors = list((killed_home / "work" / "ingest").glob("*/checkpoint/cursor.json"))
        if cursors and json.loads(cursors[0].read_text())["shard"] >= 3:
            cursor = cursors[0]
            break
        time.sleep(0.05)
    assert cursor is not None, "the stage finished or never checkpointed before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not list((killed_home / "store" / "artifacts").glob("ingest/*/MANIFEST.json"))

    env = _env(prefect_server, killed_home)
    status = json.loads(subprocess.run([*GLMFORGE, "status", "--json"], env=env, cwd=REPO,
                                       capture_output=True, text=True, check=True).stdout)
    # the killed process is gone: status says so (a dead pid on this host, or a stale heartbeat),
    # and the stage it was running says how to continue it
    assert status["stages"][0]["state"] == "interrupted" and status["run"]["state"] == "interrupted"
    assert status["stages"][0]["resume"] == f"glmforge resume ingest --run {status['run']['id']}"

    resumed = subprocess.run([*GLMFORGE, "resume", "ingest"], env=env, cwd=REPO, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    subprocess.run([*GLMFORGE, "run", "--config", str(config), "--until", "ingest"],
                   env=_env(prefect_server, clean_home), cwd=REPO, check=True, capture_output=True)

    def manifest(home):
        status = json.loads(subprocess.run([*GLMFORGE, "status", "--json"], env=_env(prefect_server, home),
                                           cwd=REPO, capture_output=True, text=True, check=True).stdout)
        st = status["stages"][0]
        assert st["state"] == "done"
        shown = subprocess.run([*GLMFORGE, "artifacts", "show", f"ingest/{st['key']}"],
                               env=_env(prefect_server, home), cwd=REPO, capture_output=True, text=True, check=True)
        return json.loads(shown.stdout), st

    (m_killed, st_killed), (m_clean, st_clean) = manifest(killed_home), manifest(clean_home)
    assert m_killed["digest"] == m_clean["digest"]
    assert st_killed["metrics"]["documents"] == 60_000 and st_killed["metrics"]["quarantined"] == 6
    assert st_clean["metrics"]["documents"] == 60_000 and st_clean["metrics"]["quarantined"] == 6


def test_status_json_reports_quarantine_counts(prefect_server, tmp_path):
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(b'{"text": "good one"}\n{"text": 1}\nnot json\n{"text": "good two"}\n{"title": "x"}\n')
    config = _write_config(tmp_path, src)
    env = _env(prefect_server, tmp_path / "home")
    subprocess.run([*GLMFORGE, "run", "--config", str(config), "--until", "ingest"], env=env, cwd=REPO,
                   check=True, capture_output=True)
    out = subprocess.run([*GLMFORGE, "status", "--json"], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    stage = json.loads(out.stdout)["stages"][0]
    assert stage["metrics"]["documents"] == 2
    assert stage["metrics"]["quarantine_reasons"] == {"invalid_json": 1, "missing_text": 1, "non_string_text": 1}
    assert stage["artifact"].endswith(f"artifacts/ingest/{stage['key']}")


def test_invalid_config_fails_before_any_work(tmp_path):
    env = {**os.environ, "GLMFORGE_HOME": str(tmp_path / "home")}
    out = subprocess.run([*GLMFORGE, "run", "--set", "ingest.shard_size=-1"], env=env, cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "ingest.shard_size" in out.stderr and "greater than 0" in out.stderr
    assert not (tmp_path / "home").exists()
