"""runtime.shutdown and its users: SIGTERM handled like Ctrl-C, child process groups stopped
with a SIGKILL fallback, the preemption guard (flag, second signal, grace period), run records
that always end completed/failed/interrupted and never show a dead run as running, and SIGTERM
to the real commands (run, curate; serve in tests/flows/conftest.py) leaving no process behind."""
from __future__ import annotations

import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runtime import shutdown
from glmforge.config import load_config
from glmforge.pipeline import STAGES, get_stage
from runtime.runner import Heartbeat, Runner, RunRecord, execute
from runtime.store import open_store
from tests._processes import alive as _alive

REPO = Path(__file__).resolve().parents[2]
GLMFORGE = str(Path(sys.executable).parent / "glmforge")


def _py(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def _wait_line(proc: subprocess.Popen, text: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"no {text!r} in {''.join(seen)[-2000:]!r}")


# ---------------------------------------------------------------- signals in a command process
def test_sigterm_raises_keyboard_interrupt_and_deferred_waits_for_a_safe_point():
    proc = _py("""
        import time
        from runtime import shutdown
        shutdown.install()
        try:
            with shutdown.deferred() as stop_requested:
                print("ready", flush=True)
                while not stop_requested():      # the first SIGTERM only sets the flag
                    time.sleep(0.01)
                print("safe point", flush=True)
                time.sleep(30)                   # the second one raises here
        except KeyboardInterrupt as e:
            print("interrupted:", e, flush=True)
            raise SystemExit(shutdown.exit_code())
    """)
    _wait_line(proc, "ready")
    proc.send_signal(signal.SIGTERM)
    _wait_line(proc, "safe point")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=20)[0]
    assert "interrupted: stopped by SIGTERM" in out and proc.returncode == 143


# ---------------------------------------------------------------- the preemption guard (training ranks)
GUARD = """
    import os, sys, time
    from runtime import shutdown
    guard = shutdown.PreemptionGuard({grace}).install()
    r, w = os.pipe()
    print("ready", flush=True)
    for step in range(1, 10_000):
        if {block}:
            os.read(r, 1)              # a collective that never returns: blocked in C
        time.sleep(0.01)
        if guard.requested():
            print("checkpoint at step", step, flush=True)
            sys.exit(shutdown.EXIT_PREEMPTED)
"""


def test_guard_lets_the_step_finish_and_exits_75():
    proc = _py(GUARD.format(grace=30, block=False))
    _wait_line(proc, "ready")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=20)[0]
    assert "checkpoint at step" in out and proc.returncode == shutdown.EXIT_PREEMPTED


def test_guard_second_signal_exits_at_once_even_when_blocked_in_c():
    proc = _py(GUARD.format(grace=60, block=True))
    _wait_line(proc, "ready")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert proc.poll() is None                       # the first one waits for the step
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=10)
    assert proc.returncode == 143 and time.monotonic() - t0 < 5   # 128 + the first signal


def test_guard_grace_period_running_out_exits_at_once():
    proc = _py(GUARD.format(grace=0.5, block=True))
    _wait_line(proc, "ready")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=20)[0]
    assert proc.returncode == 143 and "checkpoint" not in out
    assert 0.4 < time.monotonic() - t0 < 10


# ---------------------------------------------------------------- process groups
def test_stop_process_group_kills_a_stubborn_leader_and_its_grandchildren():
    # a leader that ignores SIGTERM, with a child that outlives it
    proc = _py("""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        print("child", child.pid, flush=True)
        time.sleep(600)
    """, start_new_session=True)
    child = int(_wait_line(proc, "child").split()[-1])
    t0 = time.monotonic()
    shutdown.stop_process_group(proc, (signal.SIGTERM,), timeout=1.0)
    assert time.monotonic() - t0 < 10
    time.sleep(0.2)
    assert not _alive(proc.pid) and not _alive(child)


def test_stop_process_group_cleans_up_members_left_by_an_exited_leader():
    proc = _py("""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        print("child", child.pid, flush=True)
    """, start_new_session=True)
    child = int(_wait_line(proc, "child").split()[-1])
    proc.wait(timeout=20)
    assert _alive(child)
    shutdown.stop_process_group(proc, timeout=0.5)
    time.sleep(0.2)
    assert not _alive(child)


def test_reap_orphans_waits_for_the_finishing_kills_the_stubborn_and_spares_a_reused_pid():
    """A grandchild in a session of its own outlives its stopped parent (glmforge serve's flow
    runs' rank launchers): one finishing by itself is waited for, one ignoring SIGTERM is
    SIGKILLed after the timeout; a live process whose start time is not the one seen is left."""
    finishing = _py("import time; time.sleep(1.0)", start_new_session=True)
    stubborn = _py("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
                   "time.sleep(600)", start_new_session=True)
    _wait_line(stubborn, "up")
    other = _py("import time; time.sleep(600)", start_new_session=True)
    seen = shutdown.process_ids([finishing.pid, stubborn.pid])
    t0 = time.monotonic()
    shutdown.reap_orphans([*seen, (other.pid, "not-its-start-time")], timeout=3.0)
    waited = time.monotonic() - t0
    assert finishing.wait(timeout=5) == 0 and stubborn.wait(timeout=5) == -signal.SIGKILL
    assert 2.5 < waited < 10                      # the stubborn one had its whole timeout
    assert other.poll() is None
    other.kill()
    other.wait()


def test_pod_grace_period_follows_the_config():
    cfg = load_config("tiny", None, ["pretrain.preempt_grace_s=100"])
    assert shutdown.pod_grace_seconds(cfg) == 100 + shutdown.KILL_MARGIN_S + shutdown.TEARDOWN_S
    template = json.loads((REPO / "deployments/k8s/base-job-template.json").read_text())
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == "{{ termination_grace_period_seconds }}"
    assert template["variables"]["properties"]["termination_grace_period_seconds"]["type"] == "integer"
    out = subprocess.run([sys.executable, "-m", "glmforge.cli", "grace-period", "--preset", "tiny",
                          "--set", "pretrain.preempt_grace_s=100"], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == str(shutdown.pod_grace_seconds(cfg))


# ---------------------------------------------------------------- run records
@pytest.fixture
def runner(tmp_path):
    cfg = load_config("tiny", None, None)
    return Runner(cfg, open_store(str(tmp_path / "store")), STAGES, home=tmp_path / "home")


@pytest.mark.parametrize("error, state", [(KeyboardInterrupt("stopped by SIGTERM"), "interrupted"),
                                          (shutdown.Preempted("checkpoint at step 3"), "interrupted"),
                                          (SystemExit(143), "interrupted"),
                                          (ValueError("bad shard"), "failed")])
def test_execute_ends_the_record_interrupted_or_failed(runner, error, state):
    spec = get_stage("ingest")
    record = RunRecord.new(runner.cfg, {}, [spec.name])

    def run_one(s, parents):
        raise error

    with pytest.raises(type(error)):
        execute(runner, [spec], record, run_one=run_one)
    saved = RunRecord.load(runner.store, record.id)
    assert saved.state == state and saved.finished and saved.public()["run"]["state"] == state
    assert saved.stage("ingest")["state"] == state and type(error).__name__ in saved.stage("ingest")["error"]


def test_heartbeat_is_refreshed_while_the_run_lives(runner, monkeypatch):
    record = RunRecord.new(runner.cfg, {}, ["ingest"])
    record.save(runner.store)
    with Heartbeat(record, runner.store, period=0.1):
        first = RunRecord.load(runner.store, record.id)
        time.sleep(0.5)
        later = RunRecord.load(runner.store, record.id)
    assert later.heartbeat > (first.heartbeat or "") and later.pid == os.getpid()
    assert later.public()["run"]["state"] == "running"


def test_a_running_record_whose_process_is_gone_shows_interrupted(runner):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = dt.datetime.now(dt.timezone.utc).isoformat()
    here = dict(host=socket.gethostname(), heartbeat=now, heartbeat_s=30.0)
    assert RunRecord("a", {}, {}, pid=os.getpid(), **here).shown_state() == "running"
    assert RunRecord("b", {}, {}, pid=dead.pid, **here).shown_state() == "interrupted"
    # another host: judged by the heartbeat's age alone
    old = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=100)).isoformat()
    assert RunRecord("c", {}, {}, pid=1, host="elsewhere", heartbeat=now, heartbeat_s=30.0).shown_state() == "running"
    assert RunRecord("d", {}, {}, pid=1, host="elsewhere", heartbeat=old, heartbeat_s=30.0).shown_state() == "interrupted"
    assert RunRecord("e", {}, {}, state="completed", pid=dead.pid, **here).shown_state() == "completed"


# ---------------------------------------------------------------- the commands
# SIGTERM to `glmforge serve` (server and worker stopped, no process, session or open port left):
# checked where the suite's one serve stops, tests/flows/conftest.py's `served` fixture.


def test_sigterm_to_run_and_resume_ends_the_run_record_interrupted_and_leaves_no_child(tmp_path):
    store = tmp_path / "store"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "GLMFORGE_HOME": str(tmp_path / "home"),
           "GLMFORGE_HEARTBEAT_S": "0.5"}
    proc = subprocess.Popen([GLMFORGE, "run", "--until", "quality", "--store", str(store)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (store / "runs" / "LATEST").exists() and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    time.sleep(0.5)
    descendants = shutdown.descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, out[-3000:]
    assert "interrupted" in out
    record = RunRecord.load(open_store(str(store)))
    assert record.state == "interrupted" and record.finished
    status = subprocess.run([GLMFORGE, "status", "--json", "--store", str(store)], cwd=REPO, env=env,
                            capture_output=True, text=True)
    assert json.loads(status.stdout)["run"]["state"] == "interrupted"
    time.sleep(0.5)
    assert [pid for pid in descendants if _alive(pid)] == []

    # `glmforge resume` of the interrupted stage takes the same path
    run_file = store / "runs" / f"{record.id}.json"
    before = run_file.stat().st_mtime_ns
    proc = subprocess.Popen([GLMFORGE, "resume", "quality", "--store", str(store)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None and not (
            run_file.stat().st_mtime_ns != before and json.loads(run_file.read_text())["state"] == "running"):
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    descendants = shutdown.descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, out[-3000:]
    assert RunRecord.load(open_store(str(store))).state == "interrupted"
    time.sleep(0.5)
    assert [pid for pid in descendants if _alive(pid)] == []


def test_sigterm_to_curate_stops_its_worker_processes(tmp_path):
    docs = tmp_path / "docs.jsonl"
    with open(docs, "w") as f:
        for i in range(15000):  # curate shards by 5000: three shards for two workers
            f.write(json.dumps({"id": str(i), "text": " ".join(f"w{(i * 7 + j * 13) % 9973}" for j in range(200))}) + "\n")
    proc = subprocess.Popen([GLMFORGE, "curate", "dedup-minhash", "-i", str(docs), "-o", str(tmp_path / "out"),
                             "--set", "workers=2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 120
    workers: list[int] = []
    while time.monotonic() < deadline and proc.poll() is None and len(workers) < 2:
        workers = shutdown.descendants(proc.pid)
        time.sleep(0.05)
    assert len(workers) >= 2, proc.communicate()[0][-3000:]
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 143 and "curate dedup-minhash interrupted" in out, out[-3000:]
    assert time.monotonic() - t0 < 30
    time.sleep(0.5)
    assert [pid for pid in workers if _alive(pid)] == []


def test_a_preempted_task_ends_failed_preempted_without_an_in_process_retry(prefect_server, runner):
    import dataclasses

    from prefect import flow

    from glmforge.config import RetryConfig
    from tasks.stage_task import run_in_prefect

    calls = []

    def preempted_stage(section, inputs, workdir):
        calls.append(1)
        raise shutdown.Preempted("training stopped by SIGTERM: checkpoint at step 3 of 9 written")

    spec = dataclasses.replace(get_stage("ingest"), runner=preempted_stage)
    record = RunRecord.new(runner.cfg, {}, ["ingest"])

    @flow
    def one_stage():
        execute(runner, [spec], record, run_one=lambda s, parents: run_in_prefect(
            s, RetryConfig(retries=2, retry_delay_seconds=0), runner, parents))

    state = one_stage(return_state=True)
    assert state.is_failed() and "Preempted" in state.message
    # the message the rerun automations (deployments/automations.yaml) match on
    import fnmatch

    import yaml

    from glmforge.serve import AUTOMATIONS
    for a in yaml.safe_load(AUTOMATIONS.read_text())["automations"]:
        if a["name"].startswith("glmforge-rerun-preempted-"):
            assert fnmatch.fnmatchcase(state.message, a["trigger"]["match"]["prefect.state-message"]), a["name"]
    assert calls == [1]                                   # retries=2, yet not retried in this process
    assert RunRecord.load(runner.store, record.id).state == "interrupted"
