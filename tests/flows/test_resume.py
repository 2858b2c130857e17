"""Resuming stages as a user does: `glmforge resume STAGE` / the glmforge-stage flow for every
registered stage, a SIGKILLed `glmforge run` resumed bit-exactly (local store and S3), parents
missing, and Prefect retrying a stage that failed once."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glmforge.pipeline import STAGES, STAGE_NAMES, upstream
from tests.flows.conftest import FAST

REPO = Path(__file__).resolve().parents[2]
GLMFORGE = [sys.executable, "-m", "glmforge.cli"]
SET = [a for o in FAST for a in ("--set", o)]
# per-step values a resumed run must reproduce exactly (timings are not among them)
EXACT = ("step", "tokens", "loss", "lm", "mtp", "balance", "lr", "grad_norm", "expert_load_max_mean")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]   # the session's tiny run takes minutes


def _env(prefect_server: str, home: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PREFECT_API_URL": prefect_server, "GLMFORGE_HOME": str(home), **extra}


def _status(env: dict[str, str], *args: str) -> dict:
    out = subprocess.run([*GLMFORGE, "status", "--json", *args], env=env, cwd=REPO, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


# ---------------------------------------------------------------- every stage: resume is cached
@pytest.mark.parametrize("name", STAGE_NAMES)
def test_resume_of_a_published_stage_is_cached(name, tiny_run, prefect_server, monkeypatch):
    from flows.end_to_end import stage

    monkeypatch.setenv("GLMFORGE_HOME", str(tiny_run.home))
    state = stage(stage=name, preset="tiny", store=str(tiny_run.home / "store"), run_id=tiny_run.run_id,
                  return_state=True)
    record = state.result()
    shown = next(s for s in record["stages"] if s["name"] == name)
    assert shown["state"] == "cached", shown
    assert shown["key"] == tiny_run.keys[name]
    assert record["run"]["id"] == tiny_run.run_id and record["run"]["state"] == "completed"
    from tests.flows.test_flows import _task_states

    assert _task_states(state.state_details.flow_run_id) == {name: "Cached"}


# ---------------------------------------------------------------- parents not published
def test_resume_with_nothing_recorded_says_what_to_run(tmp_path):
    env = {**os.environ, "GLMFORGE_HOME": str(tmp_path / "home")}
    out = subprocess.run([*GLMFORGE, "resume", "pretrain"], env=env, cwd=REPO, capture_output=True, text=True)
    assert out.returncode != 0
    assert "no run recorded" in out.stderr and "glmforge run" in out.stderr


def test_resume_with_unpublished_parent_names_it_and_its_command(prefect_server, tmp_path):
    env = _env(prefect_server, tmp_path / "home")
    subprocess.run([*GLMFORGE, "run", "--until", "ingest", *SET], env=env, cwd=REPO, check=True,
                   capture_output=True)
    start = time.monotonic()
    out = subprocess.run([*GLMFORGE, "resume", "dedup-exact"], env=env, cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 1, out.stdout + out.stderr
    # dedup-exact's parent is quality: named, with the command that publishes it
    assert "needs 'quality'" in out.stderr and "glmforge run --until quality" in out.stderr, out.stderr[-2000:]
    assert time.monotonic() - start < 120
    assert not (tmp_path / "home" / "work" / "dedup-exact").exists()   # nothing ran
    assert next(s for s in _status(env)["stages"] if s["name"] == "dedup-exact")["state"] == "failed"


def test_stage_flow_on_an_empty_store_names_the_first_missing_stage(prefect_server, tmp_path, monkeypatch):
    from flows.end_to_end import stage

    monkeypatch.setenv("GLMFORGE_HOME", str(tmp_path / "home"))
    with pytest.raises(ValueError) as e:
        stage(stage="pretrain", preset="tiny", overrides=FAST)
    assert "needs 'ingest'" in str(e.value) and "glmforge run --until ingest" in str(e.value)


# ---------------------------------------------------------------- SIGKILL `glmforge run`, resume
def _seed_upstream(tiny_run, store_uri: str, stage: str = "pretrain") -> None:
    """Publish the tiny run's artifacts of every stage `stage` needs into another store, so
    the killed run starts it at once (same config: the same keys are cached)."""
    from runtime.store import open_store

    dst = open_store(store_uri)
    src = tiny_run.home / "store"
    for spec in upstream(stage)[:-1]:
        base = src / "artifacts" / spec.name / tiny_run.keys[spec.name]
        files = sorted(p for p in base.rglob("*") if p.is_file())
        for p in sorted(files, key=lambda p: p.name == "MANIFEST.json"):   # manifest last, as publish does
            dst.put_file(p.relative_to(src).as_posix(), p)


def _orphans(home: Path) -> list[int]:
    """Processes still running a training rank of this home (their command names its launch.json)."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and str(home).encode() in (p / "cmdline").read_bytes():
                found.append(int(p.name))
        except OSError:
            pass
    return found


def _artifact(store_uri: str, key: str) -> tuple[dict, bytes, list[dict]]:
    from runtime.store import artifact_prefix, open_store

    st = open_store(store_uri)
    m = st.manifest("pretrain", key)
    assert m is not None, f"pretrain/{key} not published in {store_uri}"
    base = f"{artifact_prefix('pretrain', key)}/{m.data_prefix}"
    steps = [json.loads(line) for line in st.get_bytes(f"{base}/metrics.jsonl").decode().splitlines()]
    return m.metrics, st.get_bytes(f"{base}/consolidated.safetensors"), steps


@pytest.mark.parametrize("where", ["local", "s3"])
def test_sigkill_run_in_pretrain_then_cli_resume_is_bit_identical(where, tiny_run, prefect_server, tmp_path, request):
    home = tmp_path / "home"
    extra: list[str] = []
    if where == "s3":
        bucket = request.getfixturevalue("s3_env")
        uri = f"s3://{bucket}/glmforge"
        extra = ["--store", uri]
    else:
        uri = str(home / "store")
    _seed_upstream(tiny_run, uri)
    env = _env(prefect_server, home)

    proc = subprocess.Popen([*GLMFORGE, "run", "--until", "pretrain", *SET, *extra], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    from runtime.store import open_store

    # a complete checkpoint: `latest` is written last (and, on S3, mirrored last)
    latest = f"checkpoints/pretrain/{tiny_run.work_keys['pretrain']}/latest"
    deadline, seen, st = time.monotonic() + 600, None, open_store(uri)
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if where == "s3":
                seen = st.get_bytes(latest).decode()
            elif (home / "work" / "pretrain" / tiny_run.work_keys["pretrain"] / "checkpoint" / "latest").exists():
                seen = "local"
        except FileNotFoundError:
            pass
        if seen:
            break
        time.sleep(0.05)
    assert seen is not None, "pretrain finished or never checkpointed before it could be killed"
    from runtime.runner import RunRecord

    live = RunRecord.load(st).public(st)         # what `glmforge status` shows while it trains
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    running = next(s for s in live["stages"] if s["name"] == "pretrain")
    assert live["run"]["state"] == "running" and running["state"] == "running", running
    assert running["checkpoint_step"] >= 2 and running["step"] >= running["checkpoint_step"]
    for _ in range(100):                     # the ranks die with their parent (PR_SET_PDEATHSIG)
        if not _orphans(home):
            break
        time.sleep(0.1)
    assert not _orphans(home), "training ranks outlived the killed run"
    assert open_store(uri).manifest("pretrain", tiny_run.keys["pretrain"]) is None
    if where == "s3":
        shutil.rmtree(home / "work")         # another machine: the checkpoint comes back from S3
    # after the kill: interrupted, the step its checkpoint holds, and the command that continues it
    # (on S3, read from the checkpoint mirrored there: this machine no longer has the folder)
    after = _status(env, *extra)
    stopped = next(s for s in after["stages"] if s["name"] == "pretrain")
    assert after["run"]["state"] == "interrupted" and stopped["state"] == "interrupted", stopped
    assert stopped["checkpoint_step"] >= running["checkpoint_step"]
    assert stopped["resume"] == f"glmforge resume pretrain --run {after['run']['id']}"
    printed = subprocess.run([*GLMFORGE, "status", *extra], env=env, cwd=REPO, capture_output=True, text=True).stdout
    assert f"checkpoint at step {stopped['checkpoint_step']}; continue it with `glmforge resume pretrain" in printed

    resumed = subprocess.run([*GLMFORGE, "resume", "pretrain", *extra], env=env, cwd=REPO, capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    shown = next(s for s in _status(env, *extra)["stages"] if s["name"] == "pretrain")
    assert shown["state"] == "done" and shown["key"] == tiny_run.keys["pretrain"]

    got_metrics, got_weights, got_steps = _artifact(uri, tiny_run.keys["pretrain"])
    want_metrics, want_weights, want_steps = _artifact(str(tiny_run.home / "store"), tiny_run.keys["pretrain"])
    assert got_metrics["resumed_from_step"] >= 2 and want_metrics["resumed_from_step"] == 0
    assert got_weights == want_weights
    assert [{k: s[k] for k in EXACT} for s in got_steps] == [{k: s[k] for k in EXACT} for s in want_steps]
    timing = {"resumed_from_step", "tokens_per_s", "seconds", "elapsed_s", "time_s"}
    assert {k: v for k, v in got_metrics.items() if k not in timing and "per_s" not in k} == \
           {k: v for k, v in want_metrics.items() if k not in timing and "per_s" not in k}


# ---------------------------------------------------------------- Prefect retries a transient error
def test_transient_error_is_retried_by_prefect_and_succeeds(prefect_server, tmp_path):
    import asyncio

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from glmforge.config import RetryConfig, load_config
    from runtime.runner import Runner
    from runtime.stage import StageSpec
    from runtime.store import LocalStore
    from tasks.stage_task import run_in_prefect

    marker = tmp_path / "failed-once"
    calls: list[int] = []

    def flaky(cfg, inputs, workdir):
        calls.append(1)
        if not marker.exists():
            marker.touch()
            raise ConnectionError("store connection reset (transient)")
        (workdir.out / "ok.txt").write_text("ok")
        return {"attempts": len(calls)}

    spec = StageSpec("flaky", "run", type(load_config("tiny").run), flaky)
    cfg = load_config("tiny")
    runner = Runner(cfg, LocalStore(tmp_path / "store"), STAGES, home=tmp_path / "home")

    @flow
    def one_stage():
        return run_in_prefect(spec, RetryConfig(retries=1, retry_delay_seconds=0), runner, {})

    state = one_stage(return_state=True)
    result = state.result()
    assert result.state == "done" and result.manifest.metrics == {"attempts": 2} and len(calls) == 2

    async def history():
        async with get_client() as client:
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
            assert len(runs) == 1
            states = await client.read_task_run_states(runs[0].id)
            return [s.name for s in sorted(states, key=lambda s: s.timestamp)]

    names = asyncio.run(history())
    assert names[-1] == "Completed", names
    assert "AwaitingRetry" in names or "Retrying" in names, names
    assert names.index("Completed") > max(names.index(n) for n in ("AwaitingRetry", "Retrying") if n in names)
