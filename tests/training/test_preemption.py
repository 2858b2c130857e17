"""Preemption of a 2-rank training stage: SIGTERM to the stage's process at a random step ->
the ranks finish that step, write a checkpoint and exit -> the stage raises Preempted -> a
rerun resumes and ends with weights bit-identical to an uninterrupted run. No process of the
interrupted run is left behind."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime import shutdown
from runtime.stage import Workdir
from tests.training.conftest import MODEL_OVERRIDES
from training import checkpoint, metrics
from training.config import PretrainConfig
from training.drivers import run_pretrain

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY = 30, 10
CONFIG = dict(model_overrides=MODEL_OVERRIDES, micro_batch_size=4, max_steps=STEPS, checkpoint_every=EVERY,
              keep_last=2, lr=0.02, warmup_steps=2, eval_sequences=16, launch={"nproc_per_node": 2},
              preempt_grace_s=60.0)

# The stage in its own process, as `glmforge run` runs it: shutdown.install() turns SIGTERM
# into the stop path; Preempted ends the process with EXIT_PREEMPTED.
STAGE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from runtime import shutdown
    from runtime.stage import Workdir
    from training.config import PretrainConfig
    from training.drivers import run_pretrain
    shutdown.install()
    cfg, packed, root = json.loads(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3])
    try:
        run_pretrain(PretrainConfig(**cfg), {k: Path(v) for k, v in packed.items()}, Workdir.at(root, seed=7))
    except shutdown.Preempted as e:
        print("PREEMPTED", e, flush=True)
        sys.exit(shutdown.EXIT_PREEMPTED)
""")


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if text.encode() in (p / "cmdline").read_bytes():
                    found.append(int(p.name))
            except OSError:
                continue
    return found


def test_sigterm_at_a_random_step_then_resume_equals_an_uninterrupted_run(packed, tmp_path):
    ref = Workdir.at(tmp_path / "reference", seed=7)
    run_pretrain(PretrainConfig(**CONFIG), packed, ref)

    at = random.Random().randint(2, STEPS - 8)
    root = tmp_path / "preempted"
    wd = Workdir.at(root, seed=7)
    proc = subprocess.Popen([sys.executable, "-c", STAGE, json.dumps(CONFIG),
                             json.dumps({k: str(v) for k, v in packed.items()}), str(root)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = wd.checkpoint / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= at:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.005)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == shutdown.EXIT_PREEMPTED, f"SIGTERM at step {at}:\n{out[-3000:]}"
    assert "PREEMPTED training stopped by SIGTERM: checkpoint at step" in out

    stopped = len(metrics.read(log))
    assert at <= stopped < STEPS, (at, stopped)
    tag, meta = checkpoint.select_resume(wd.checkpoint)           # the preemption checkpoint
    assert tag == checkpoint.tag_for(stopped) and meta["step"] == stopped
    assert f"checkpoint at step {stopped} of {STEPS}" in out
    assert not (wd.out / "consolidated.safetensors").exists()     # nothing published
    assert _processes_mentioning(str(wd.checkpoint / "launch.json")) == []  # no rank, no torchrun

    result = run_pretrain(PretrainConfig(**CONFIG), packed, Workdir.at(root, seed=7))   # the rerun
    assert result["resumed_from_step"] == stopped
    assert [r["step"] for r in metrics.read(log)] == list(range(1, STEPS + 1))
    got, want = load_file(wd.out / "consolidated.safetensors"), load_file(ref.out / "consolidated.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert metrics.read(log) == [{**r, "tokens_per_s": g["tokens_per_s"]}
                                 for r, g in zip(metrics.read(ref.checkpoint / "metrics.jsonl"), metrics.read(log))]


def test_config_refuses_a_non_positive_grace_period():
    with pytest.raises(ValueError, match="preempt_grace_s"):
        PretrainConfig(**{**CONFIG, "preempt_grace_s": 0})
