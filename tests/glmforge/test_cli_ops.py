"""Operations through the CLI: missing home folders are created, a fully cached `glmforge run`
is recorded without starting Prefect, errors a user can act on are one line and write nothing,
and two runs on one home neither share a Prefect database nor wait silently."""
from __future__ import annotations

import json
import os
import signal
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
    from runtime.runner import Runner, RunRecord, execute
    from runtime.store import LocalStore

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



# ---------------------------------------------------------------- errors a user can act on


def _one_error_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def test_run_with_the_s3_endpoint_down_is_one_error_line_and_writes_nothing(tmp_path):
    from tests.conftest import free_port

    config = _config(tmp_path)
    home, prefect_home = tmp_path / "home", tmp_path / "prefect"
    port = free_port()  # nothing listens there
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "GLMFORGE_STORE")}
    env.update(GLMFORGE_HOME=str(home), PREFECT_HOME=str(prefect_home), GLMFORGE_S3_ENDPOINT=f"http://127.0.0.1:{port}",
               GLMFORGE_S3_MAX_ATTEMPTS="1", GLMFORGE_S3_CONNECT_TIMEOUT="1", AWS_ACCESS_KEY_ID="key",
               AWS_SECRET_ACCESS_KEY="secret", AWS_DEFAULT_REGION="us-east-1")
    r = _run(["run", "--config", str(config), "--store", "s3://bucket/prefix"], env, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    line = _one_error_line(r.stderr)
    assert line.startswith(f"error: S3 store s3://bucket/prefix (endpoint http://127.0.0.1:{port}) unreachable: get ")
    assert r.stdout == "" and not home.exists() and not prefect_home.exists()


def test_refused_configs_are_one_error_line_naming_the_culprit(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from glmforge.cli import app

    home = tmp_path / "home"
    monkeypatch.setenv("GLMFORGE_HOME", str(home))
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("run:\n  seed: 1  # café\n".encode("latin-1"))
    for args, expected in ((["--config", str(latin1)], f"error: {latin1}:2: not UTF-8 text (byte 0xe9"),
                           (["--set", "nosuch.key=1"], "error: invalid config: --set nosuch.key=1: field nosuch: ")):
        r = CliRunner().invoke(app, ["run", *args])
        assert r.exit_code == 2, r.output
        assert _one_error_line(r.stderr).startswith(expected)
    assert not home.exists()


def test_eval_of_a_missing_model_folder_is_refused_without_creating_a_store(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from glmforge.cli import app

    home = tmp_path / "home"
    monkeypatch.setenv("GLMFORGE_HOME", str(home))
    monkeypatch.delenv("GLMFORGE_STORE", raising=False)
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "a few words to score"}\n')
    missing = tmp_path / "models" / "nosuch"
    r = CliRunner().invoke(app, ["eval", "perplexity", "--model", str(missing), "--input", str(texts)])
    assert r.exit_code == 2, r.output
    assert _one_error_line(r.stderr).startswith(f"error: model folder {missing} does not exist")
    assert not home.exists() and not (tmp_path / "models").exists()


def test_concurrent_runs_get_their_own_prefect_database(tmp_path):
    from glmforge.serve import claim_prefect_database

    first, first_lock = claim_prefect_database(tmp_path)
    second, second_lock = claim_prefect_database(tmp_path)
    assert first == tmp_path / "prefect.db" and second == tmp_path / "prefect-run1.db"
    first_lock.close()  # the first run ended: the next one takes the shared database again
    third, third_lock = claim_prefect_database(tmp_path)
    assert third == first
    second_lock.close()
    third_lock.close()


def test_a_second_run_on_one_home_logs_its_wait_on_a_prefect_database_of_its_own(tmp_path):
    """The test process plays the first run: it holds the home's shared Prefect database and
    the ingest stage's lease. The second run (the CLI with its own ephemeral Prefect server)
    says that it waits, on stderr and in its flow run's log, and runs the stage once the
    lease is released."""
    import sqlite3
    import time

    from glmforge.serve import claim_prefect_database
    from glmforge.config import load_config
    from glmforge.pipeline import STAGES, get_stage
    from runtime.runner import Runner
    from runtime.store import Lease, LocalStore

    config = _config(tmp_path)
    home, prefect_home = tmp_path / "home", tmp_path / "prefect"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "GLMFORGE_STORE")}
    env.update(GLMFORGE_HOME=str(home), PREFECT_HOME=str(prefect_home), GLMFORGE_LEASE_WAIT="300")
    shared_db, first_run = claim_prefect_database(prefect_home)
    store = LocalStore(home / "store")
    key = Runner(load_config(None, config), store, STAGES, home=home).key(get_stage("ingest"), {})
    lease = Lease(store, f"ingest/{key}", ttl=60)
    lease.acquire(0)
    wait_line = f"ingest/{key}: held by pid {os.getpid()} on "
    err_path = tmp_path / "second.err"
    with open(err_path, "w") as err:
        second = subprocess.Popen([*GLMFORGE, "run", "--config", str(config), "--until", "ingest"], env=env,
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while wait_line not in err_path.read_text():
            assert second.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.5)
    except BaseException:
        os.killpg(second.pid, signal.SIGKILL)  # with its Prefect server
        second.wait()
        raise
    finally:
        lease.release()
    out = second.communicate(timeout=240)[0]
    assert second.returncode == 0, out + err_path.read_text()[-3000:]
    assert "completed" in out and "ingest" in out
    first_run.close()
    assert not shared_db.exists()
    with sqlite3.connect(prefect_home / "prefect-run1.db") as db:
        logged = [message for (message,) in db.execute("SELECT message FROM log")]
    assert any(wait_line in m for m in logged), logged
