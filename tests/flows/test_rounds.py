"""The post-training loop as a user runs it: `glmforge run --until sft@2` with two iterations on a
store where round 1 is published, killed with -9 inside round 2 (self-distill@2), then
`glmforge resume self-distill@2` and the run on to sft@2; round 1 is never run again."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from glmforge.config import load_config
from posttrain.self_distill import run as self_distill
from runtime.stage import Workdir
from runtime.store import open_store
from tests.flows.conftest import FAST
from tests.flows.test_report import cells, value
from tests.flows.test_resume import GLMFORGE, REPO, _env, _seed_upstream, _status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROUND = ["self_distill.iterations=2", "self_distill.candidates=24", "self_distill.chunk=2",
         "self_distill.samples=4", "self_distill.max_new_tokens=32", "self_distill.min_examples=0"]
SET = [a for o in [*FAST, *ROUND] for a in ("--set", o)]


def test_a_round_killed_inside_resumes_inside_it_with_round_one_cached(tiny_run, prefect_server, tmp_path):
    home = tmp_path / "home"
    uri = str(home / "store")
    _seed_upstream(tiny_run, uri, "distill")                         # round 1, published
    env = _env(prefect_server, home)
    proc = subprocess.Popen([*GLMFORGE, "run", "--until", "sft@2", *SET], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline, cursor = time.monotonic() + 600, None
    while time.monotonic() < deadline and proc.poll() is None and cursor is None:
        for f in (home / "work" / "self-distill@2").glob("*/checkpoint/rows.cursor.json"):
            try:
                if json.loads(f.read_text())["chunks"] >= 1:
                    cursor = f
            except (OSError, ValueError):
                pass
        time.sleep(0.02)
    assert cursor is not None, "self-distill@2 finished or never wrote a chunk before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_at_kill = json.loads(cursor.read_text())["chunks"]
    assert 1 <= done_at_kill < 12

    after = _status(env)
    states = {s["name"]: s["state"] for s in after["stages"]}
    assert states["self-distill@2"] == "interrupted" and states.get("sft@2") != "done"
    assert {states[n] for n in ("sft", "rl-prompts", "rl-reasoning")} == {"cached"}
    stopped = next(s for s in after["stages"] if s["name"] == "self-distill@2")
    assert stopped["resume"] == f"glmforge resume self-distill@2 --run {after['run']['id']}"
    assert stopped["checkpoint_chunks"] == done_at_kill                # the chunk cursor it goes on from
    printed = subprocess.run([*GLMFORGE, "status"], env=env, cwd=REPO, capture_output=True, text=True).stdout
    assert f"checkpoint after chunk {done_at_kill}; continue it with `glmforge resume self-distill@2" in printed

    resumed = subprocess.run([*GLMFORGE, "resume", "self-distill@2"], env=env, cwd=REPO, capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    store = open_store(uri)
    record = _status(env)
    key = next(s for s in record["stages"] if s["name"] == "self-distill@2")["key"]
    published = store.manifest("self-distill@2", key)
    assert published is not None

    # what an uninterrupted stage writes, from the same round-1 model
    cfg = load_config("tiny", None, [*FAST, *ROUND])
    src = open_store(str(tiny_run.home / "store"))
    inputs = {n: src.materialize(src.manifest(n, tiny_run.keys[n]), tmp_path / "cache")
              for n in ("rl-reasoning", "tokenize")}
    clean = self_distill(cfg.self_distill, inputs, Workdir.at(tmp_path / "clean", seed=cfg.run.seed))
    assert published.metrics == json.loads(json.dumps(clean))

    # on to sft@2: round 1 and self-distill@2 cached, sft@2 trains from the same base as sft
    out = subprocess.run([*GLMFORGE, "run", "--until", "sft@2", *SET], env=env, cwd=REPO, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    final = {s["name"]: s for s in _status(env)["stages"]}
    assert final["sft@2"]["state"] == "done" and final["self-distill@2"]["state"] == "cached"
    assert final["sft"]["state"] == "cached" and final["sft@2"]["key"] != final["sft"]["key"]
    sft2 = store.manifest("sft@2", final["sft@2"]["key"])
    assert sft2.parents["self-distill@2"] == key and sft2.parents["dsa-adapt"] == tiny_run.keys["dsa-adapt"]

    # the run report's rounds table: round 2's distilled examples as the stage published them
    page = subprocess.run([*GLMFORGE, "report"], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    from pathlib import Path

    shown = cells(Path(page.stdout.strip().splitlines()[-1]).read_text())
    assert value(shown["self-distill@2.examples"]) == published.metrics["examples"]
    assert value(shown["self-distill@2.prompts"]) == 24
