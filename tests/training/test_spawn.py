"""training.spawn, the one-node launcher, on stand-in ranks (no torch): torchrun's variables, the
first failure named and the other ranks stopped, stop signals passed on once, no rank outliving it.
The real ranks run under it in test_train, test_expert_parallel, test_rl_on_ranks and the flows."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import pytest

from runtime.shutdown import EXIT_PREEMPTED
from training.launch import REPO, _failure

# A stand-in rank: writes its environment, then does what BEHAVIOUR says for its RANK.
RANK = """
import json, os, signal, sys, time
out = sys.argv[1]
rank = os.environ["RANK"]
what = json.loads(sys.argv[2])[rank]
def on_term(signum, frame):
    with open(f"{out}/term{rank}", "a") as f:
        f.write("x")
    if what != "ignore":
        sys.exit(%d)
if what != "bare":   # bare: dies of SIGTERM, as a rank does before it sets its handler
    signal.signal(signal.SIGTERM, on_term)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
json.dump({"pid": os.getpid(), **{k: os.environ.get(k) for k in keys}}, open(f"{out}/env{rank}.json", "w"))  # after the handler
print(f"rank {rank} up", flush=True)
if what.startswith("exit"):
    # fail once every rank is up (has its handler): the test is of the launcher, not of start-up
    world = int(os.environ["WORLD_SIZE"])
    for _ in range(200):
        if all(os.path.exists(f"{out}/env{r}.json") for r in range(world)):
            break
        time.sleep(0.05)
    print(f"rank {rank} fails", flush=True)
    sys.exit(int(what[4:]))
if what in ("wait", "ignore", "bare"):
    for _ in range(600):
        time.sleep(0.1)
""" % EXIT_PREEMPTED


def spawn(tmp_path: Path, behaviour: dict[str, str], kill_after: int = 30, nproc: int = 2) -> subprocess.Popen:
    (tmp_path / "standin_rank.py").write_text(RANK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    env.pop("OMP_NUM_THREADS", None)
    code = (f"import sys, training.spawn as s; s.KILL_AFTER_S = {kill_after}; "
            "sys.exit(s.main(sys.argv[1:]))")
    return subprocess.Popen([sys.executable, "-c", code, f"--nproc_per_node={nproc}", "--master_port=29999",
                             "-m", "standin_rank", str(tmp_path), json.dumps(behaviour)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for(path: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_ranks_get_torchruns_variables_and_success_is_0(tmp_path):
    proc = spawn(tmp_path, {"0": "done", "1": "done", "2": "done"}, nproc=3)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs] == \
        [(str(r), str(r), "3", "3") for r in range(3)]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["OMP_NUM_THREADS"]) for e in envs} == {("127.0.0.1", "29999", "1")}
    assert "Root Cause" not in out


def test_a_failed_rank_stops_the_others_and_is_named(tmp_path):
    started = time.monotonic()
    proc = spawn(tmp_path, {"0": "wait", "1": "exit3"})
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and time.monotonic() - started < 20        # rank 0 did not wait out its 60 s
    assert (tmp_path / "term0").read_text() == "x"                        # stopped with one SIGTERM
    msg = _failure(proc.returncode, deque(out.splitlines()))
    assert msg.startswith("training failed: rank 1 failed (exit code 3)"), msg
    assert "rank 1 fails" in msg and "Root Cause" not in msg              # the ranks' lines, not the summary


def test_a_rank_that_ignores_sigterm_is_killed_and_the_cause_is_still_the_first(tmp_path):
    proc = spawn(tmp_path, {"0": "ignore", "1": "exit2"}, kill_after=1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "rank 1 failed (exit code 2)" in _failure(proc.returncode, deque(out.splitlines()))


@pytest.mark.parametrize("rank1", ["wait", "bare"])
def test_a_stop_reaches_every_rank_once_and_ends_preempted(tmp_path, rank1):
    """bare: the stop reaches rank 1 before it has set its handler (still importing, as at
    start-up) and kills it; it wrote nothing, so the stage was stopped, not failed."""
    proc = spawn(tmp_path, {"0": "wait", "1": rank1})
    for r in (0, 1):
        wait_for(tmp_path / f"env{r}.json")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_PREEMPTED, out
    terms = [tmp_path / f"term{r}" for r in (0, 1)]
    assert [t.read_text() if t.exists() else None for t in terms] == ["x", "x" if rank1 == "wait" else None]
    assert "Root Cause" not in out


def test_no_rank_outlives_a_killed_spawner(tmp_path):
    proc = spawn(tmp_path, {"0": "wait", "1": "wait"})
    for r in (0, 1):
        wait_for(tmp_path / f"env{r}.json")
    proc.kill()
    proc.communicate(timeout=30)
    for r in (0, 1):                              # each rank got SIGTERM (its parent-death signal)
        wait_for(tmp_path / f"term{r}")


def test_a_rank_killed_by_sigterm_without_a_stop_is_a_failure(tmp_path):
    """A rank killed by SIGTERM when the launcher had no stop (a signal from elsewhere) failed."""
    proc = spawn(tmp_path, {"0": "wait", "1": "bare"})
    for r in (0, 1):
        wait_for(tmp_path / f"env{r}.json")
    os.kill(json.loads((tmp_path / "env1.json").read_text())["pid"], signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, out
    assert "rank 1 failed (killed by signal 15)" in _failure(proc.returncode, deque(out.splitlines()))
