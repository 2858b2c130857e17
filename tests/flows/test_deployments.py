"""Per-stage deployments (prefect.yaml's glmforge-stage/stage-*) run by the process worker of the
session's `glmforge serve` (tests/flows/conftest.served), against a store a pipeline run already
filled (a copy of the session's tiny run): a stage with parents
resumes into its run as cached, a training stage with a changed config trains and publishes,
and a training stage preempted by SIGTERM is rerun by the automation of
deployments/automations.yaml and continues from its checkpoint."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.flows.conftest import FAST, SETTLE_S, ZOMBIE_S

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


def test_stage_deployments_with_parents_run_on_a_process_worker(served, tiny_run):
    store = str(served.home / "store")

    def deployment_run(name: str, params: dict) -> str:
        run = subprocess.run([PREFECT, "deployment", "run", f"glmforge-stage/{name}", "--params", json.dumps(params),
                              "--watch", "--watch-timeout", "900"],
                             env=served.env, cwd=REPO, capture_output=True, text=True, timeout=1000)
        assert run.returncode == 0 and "Completed" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:] + served.logs()
        return run.stdout

    # dedup-exact (parents ingest -> quality) resumed into the pipeline's own run: cached
    deployment_run("stage-dedup-exact", {"run_id": tiny_run.run_id, "store": store})
    shown = _stage(_status(served.home, "--run", tiny_run.run_id), "dedup-exact")
    assert shown["state"] == "cached" and shown["key"] == tiny_run.keys["dedup-exact"]

    # pretrain with more steps (a new key, its parents reused), preempted, rerun by the automation
    _preempted_run_is_rerun_by_the_automation(served, store, tiny_run.keys["pretrain"])


def _flow_runs(served, deployment: str) -> list[dict]:
    from tasks.schedules import call

    return call(served.api, "POST", "/flow_runs/filter",
                {"deployments": {"name": {"any_": [deployment]}}, "sort": "EXPECTED_START_TIME_ASC"})


def _flow_run_process(serve_pid: int, flow_run_id: str):
    """The process the worker started for `flow_run_id` (its children carry the same id)."""
    import psutil

    for p in psutil.Process(serve_pid).children(recursive=True):
        try:
            if p.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id and \
                    p.parent().environ().get("PREFECT__FLOW_RUN_ID") != flow_run_id:
                return p
        except psutil.Error:
            continue
    return None


def _preempted_run_is_rerun_by_the_automation(served, store: str, published_key: str) -> None:
    steps = 16
    params = {"preset": "tiny", "overrides": [*FAST, f"pretrain.max_steps={steps}", "pretrain.checkpoint_every=2"],
              "store": store}
    t0 = time.time()
    subprocess.run([PREFECT, "deployment", "run", "glmforge-stage/stage-pretrain", "--params", json.dumps(params)],
                   env=served.env, cwd=REPO, capture_output=True, check=True, timeout=120)
    [first] = [r for r in _flow_runs(served, "stage-pretrain") if r["parameters"].get("overrides") == params["overrides"]]

    home, logs = served.home, lambda: served.logs(6000)
    # SIGTERM the flow-run process (a pod eviction) once the stage has trained a few steps
    deadline, sent = time.monotonic() + 600, False
    while time.monotonic() < deadline and not sent:
        logged = [m for m in home.glob("work/pretrain/*/checkpoint/metrics.jsonl") if m.stat().st_mtime > t0]
        if logged and len(logged[0].read_text().splitlines()) >= 3:
            proc = _flow_run_process(served.pid, first["id"])
            assert proc is not None, logs()
            proc.send_signal(signal.SIGTERM)
            sent = True
        time.sleep(0.2)
    assert sent, "the preempted run never trained 3 steps\n" + logs()

    # the automation reruns the deployment with preemptions=1; the rerun resumes and completes
    deadline, runs = time.monotonic() + 600, []
    while time.monotonic() < deadline:
        runs = [r for r in _flow_runs(served, "stage-pretrain") if r["parameters"].get("overrides") == params["overrides"]]
        if any(r["state_type"] in ("COMPLETED", "FAILED", "CRASHED") and r["parameters"].get("preemptions") == 1
               for r in runs):
            break
        time.sleep(2)
    states = [(r["state_type"], r["state"]["message"], r["parameters"].get("preemptions")) for r in runs]
    assert len(runs) == 2, (states, logs())
    assert runs[0]["state_type"] == "FAILED" and "Preempted: " in runs[0]["state"]["message"], states
    assert runs[1]["state_type"] == "COMPLETED" and runs[1]["parameters"]["preemptions"] == 1, (states, logs())
    assert {k: runs[1]["parameters"][k] for k in params} == params and runs[1]["parameters"]["stage"] == "pretrain"

    latest = _status(home)
    assert [s["name"] for s in latest["stages"]] == ["pretrain"] and latest["run"]["state"] == "completed"
    shown = _stage(latest, "pretrain")
    assert shown["state"] == "done" and shown["key"] != published_key
    assert shown["artifact"].endswith(f"artifacts/pretrain/{shown['key']}")
    assert shown["metrics"]["steps"] == steps
    assert 2 <= shown["metrics"]["resumed_from_step"] < steps, shown["metrics"]


def _stage_run(served, params: dict, steps_first: int = 3, deployment: str = "stage-pretrain",
                  stage: str = "pretrain"):
    """Start a stage deployment run with `params` and wait until it has trained `steps_first`
    steps; a function listing the runs with these parameters (oldest first)."""
    t0 = time.time()
    subprocess.run([PREFECT, "deployment", "run", f"glmforge-stage/{deployment}", "--params", json.dumps(params)],
                   env=served.env, cwd=REPO, capture_output=True, check=True, timeout=120)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        logged = [m for m in served.home.glob(f"work/{stage}/*/checkpoint/metrics.jsonl") if m.stat().st_mtime > t0]
        if logged and len(logged[0].read_text().splitlines()) >= steps_first:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the run never trained {steps_first} steps\n" + served.logs())
    return lambda: [r for r in _flow_runs(served, deployment)
                    if r["parameters"].get("overrides") == params["overrides"]]


def _worker(served):
    import psutil

    for p in psutil.Process(served.pid).children(recursive=True):
        try:
            if "worker" in p.cmdline() and served.pool in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                return p
        except psutil.Error:
            continue
    return None


def _node_dies(served, flow_run_id: str):
    """kill -9 of the worker and of the flow run's process and its children, as when their machine
    dies: nothing of them reports anything (the worker frozen first, so that it cannot see its
    child go; a flow-run process left alive finds its output pipe broken and fails itself).
    Returns the dead worker's pid."""
    old, flow_run = _worker(served), _flow_run_process(served.pid, flow_run_id)
    assert old is not None and flow_run is not None
    os.kill(old.pid, signal.SIGSTOP)
    os.killpg(os.getpgid(flow_run.pid), signal.SIGKILL)
    os.kill(flow_run.pid, signal.SIGKILL)
    os.killpg(old.pid, signal.SIGKILL)
    return old.pid


def test_a_run_whose_worker_and_process_die_is_crashed_then_rerun_from_its_checkpoint(served):
    """kill -9 of the worker and its flow-run process (a node that dies) while pretraining:
    serve starts a new worker and its server (the UI) never goes away; the run's heartbeats stop
    and the zombie automation marks it Crashed within its bound (ZOMBIE_S without a heartbeat
    here, 90 s as shipped); the rerun automation runs it again on the new worker and it completes
    from its checkpoint. And serve's SQLite database is locked as a run's is (a run without
    PREFECT_API_URL takes the next file)."""
    import fcntl

    from tasks.schedules import call

    lock = open(Path(served.env["PREFECT_HOME"]) / ".glmforge-db-0.lock", "a")
    with pytest.raises(BlockingIOError):
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.close()

    steps, store, logs = 14, str(served.home / "store"), lambda: served.logs(6000)
    params = {"preset": "tiny", "overrides": [*FAST, f"pretrain.max_steps={steps}", "pretrain.checkpoint_every=2"],
              "store": store}
    runs = _stage_run(served, params)
    old = _node_dies(served, runs()[0]["id"])
    killed = time.monotonic()

    # a new worker; the server up throughout; the dead run Crashed within the bound
    deadline, new, first = time.monotonic() + 300, None, None
    while time.monotonic() < deadline:
        assert call(served.api, "GET", "/health") is True
        new = new or (w if (w := _worker(served)) is not None and w.pid != old else None)
        first = runs()[0]
        if new is not None and first["state_type"] != "RUNNING":
            break
        time.sleep(1)
    crashed_after = time.monotonic() - killed
    assert new is not None and "the Prefect worker exited" in served.logs(), logs()
    assert first["state_type"] == "CRASHED" and first["state"]["message"].startswith("No heartbeat: "), \
        (first["state_type"], first["state"]["message"], logs())
    assert crashed_after < ZOMBIE_S + 60, crashed_after     # ZOMBIE_S without a heartbeat, checked every few seconds

    # rerun by the automation on the new worker: completes from the checkpoint
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        done = [r for r in runs() if r["parameters"].get("preemptions") == 1 and
                r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")]
        if done:
            break
        time.sleep(2)
    states = [(r["state_type"], r["state"]["message"], r["parameters"].get("preemptions")) for r in runs()]
    assert len(states) == 2 and states[1][0] == "COMPLETED", (states, logs())
    shown = _stage(_status(served.home), "pretrain")
    assert shown["state"] == "done" and shown["metrics"]["steps"] == steps
    assert 2 <= shown["metrics"]["resumed_from_step"] < steps, shown["metrics"]
    print(f"\nkilled worker and flow run: Crashed after {crashed_after:.0f} s, rerun completed")


def test_a_cancel_after_the_node_died_ends_cancelled_and_is_never_rerun(served):
    """The node dies, then the user cancels: nothing is left to confirm the cancel, so the run
    would stay Cancelling; the settle automation ends it Cancelled within its bound, and the
    zombie automation (its heartbeats stopped too) does not mark it Crashed, so it is not rerun.
    `glmforge status` shows the stage interrupted at its checkpoint with the resume command."""
    params = {"preset": "tiny", "store": str(served.home / "store"),
              "overrides": [*FAST, "pretrain.max_steps=40", "pretrain.checkpoint_every=2"]}
    runs = _stage_run(served, params)
    _node_dies(served, runs()[0]["id"])
    subprocess.run([PREFECT, "flow-run", "cancel", runs()[0]["id"]], env=served.env, cwd=REPO, capture_output=True,
                   check=True, timeout=60)
    cancelled = time.monotonic()
    while time.monotonic() < cancelled + SETTLE_S + 90 and runs()[0]["state_type"] == "CANCELLING":
        time.sleep(1)
    first = runs()[0]
    assert first["state_type"] == "CANCELLED", (first["state_type"], first["state"]["message"], served.logs())
    settled_after = time.monotonic() - cancelled
    time.sleep(max(0.0, cancelled + ZOMBIE_S + 5 - time.monotonic()))   # past the zombie window: no Crashed, no rerun
    assert [r["state_type"] for r in runs()] == ["CANCELLED"], [(r["state_type"], r["state"]["message"]) for r in runs()]
    shown = _stage(_status(served.home), "pretrain")
    assert shown["state"] == "interrupted" and shown["checkpoint_step"] >= 2, shown
    assert shown["resume"].startswith("glmforge resume pretrain --run ")
    print(f"\ncancelled after the node died: {first['state']['message']!r} after {settled_after:.0f} s")


CANCELLED_STAGES = {
    # training ranks: 2 of them under the launcher
    "pretrain": ["pretrain.max_steps=64", "pretrain.checkpoint_every=4", "pretrain.launch.nproc_per_node=2"],
    # RL: rollout worker processes, and the rollouts served by a native server process
    "rl-agentic": ["rl_agentic.steps=400", "rl_agentic.checkpoint_every=1", "rl_agentic.rollout.backend=served",
                   "rl_agentic.rollout.servers={replicas: 1}"],
}


@pytest.mark.parametrize("stage", list(CANCELLED_STAGES))
def test_a_users_cancel_reads_as_a_cancel_and_leaves_nothing_running(served, stage):
    """Prefect's Cancel of a deployment run (pretraining on 2 ranks; rl-agentic with its rollout
    workers on a served rollout pool): the run ends Cancelled with a one-line reason, no ERROR
    line or traceback in its log and no task Failed on the way, no process of it left after 30 s,
    no rerun; `glmforge status` shows it interrupted at its checkpoint with the resume command,
    and (pretraining) the same deployment run again continues from that checkpoint."""
    import psutil

    from tasks.schedules import call

    params = {"preset": "tiny", "store": str(served.home / "store"), "overrides": [*FAST, *CANCELLED_STAGES[stage]]}
    runs = _stage_run(served, params, deployment=f"stage-{stage}", stage=stage, steps_first=2)
    first = runs()[0]
    subprocess.run([PREFECT, "flow-run", "cancel", first["id"]], env=served.env, cwd=REPO, capture_output=True,
                   check=True, timeout=60)
    cancelled = time.monotonic()
    while time.monotonic() < cancelled + 120 and runs()[0]["state_type"] != "CANCELLED":
        time.sleep(1)
    first = runs()[0]
    assert first["state_type"] == "CANCELLED", (first["state_type"], first["state"]["message"], served.logs())

    def of_the_run() -> list[str]:
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("PREFECT__FLOW_RUN_ID") == first["id"] and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(" ".join(p.cmdline())[:120])
            except psutil.Error:
                continue
        return found

    time.sleep(max(0.0, cancelled + 30 - time.monotonic()))
    assert of_the_run() == []                                 # ranks, launcher, workers, servers: all gone
    # the run's log (sent in batches: read once the 30 s are over)
    logs = call(served.api, "POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [first["id"]]}}, "limit": 200})
    bad = [x["message"] for x in logs if x["level"] >= 40 or "Traceback" in x["message"]]
    assert logs and not bad, "\n----\n".join(bad)
    said = [x["message"] for x in logs if x["message"].startswith(f"Cancelled by the user: {stage} stopped")]
    assert len(said) == 1 and f"glmforge resume {stage}" in said[0], "\n".join(
        f"{x['level']} {x['message'][:300]}" for x in logs)
    tasks = call(served.api, "POST", "/task_runs/filter", {"flow_runs": {"id": {"any_": [first["id"]]}}})
    assert [t["state_type"] for t in tasks] == ["CANCELLED"], [(t["name"], t["state_type"]) for t in tasks]
    assert len(runs()) == 1                                   # never rerun
    shown = _stage(_status(served.home), stage)               # what the record says: how to go on
    assert shown["state"] == "interrupted" and shown["checkpoint_step"] >= 1, shown
    assert shown["resume"].startswith(f"glmforge resume {stage} --run ")
    if stage != "pretrain":
        return                                                # RL resumes are tested in tests/posttrain
    # the same deployment run again continues from the checkpoint the cancel kept
    run = subprocess.run([PREFECT, "deployment", "run", f"glmforge-stage/stage-{stage}", "--params",
                          json.dumps(params), "--watch", "--watch-timeout", "900"],
                         env=served.env, cwd=REPO, capture_output=True, text=True, timeout=1000)
    assert run.returncode == 0 and "Completed" in run.stdout, run.stdout[-2000:] + served.logs()
    shown = _stage(_status(served.home), stage)
    assert shown["state"] == "done" and 2 <= shown["metrics"]["resumed_from_step"] < shown["metrics"]["steps"], shown
