"""SIGTERM during the rl-reasoning stage: the step in flight ends, a checkpoint is written,
Preempted is raised; the rerun resumes to exactly the uninterrupted result."""
from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from glmforge import shutdown
from glmforge.stage import Workdir
from posttrain.rl_reasoning import run_rl_reasoning
from tests.posttrain.test_rl_reasoning import _cfg, inputs  # noqa: F401 (fixture)
from training import checkpoint


def test_sigterm_checkpoints_the_current_step_and_resume_is_exact(inputs, tmp_path):  # noqa: F811
    cfg = _cfg(steps=4, checkpoint_every=10)          # no regular checkpoint before the end
    run_rl_reasoning(cfg, inputs, Workdir.at(tmp_path / "clean", seed=3))

    def sigterm_in_step_2(done, total, desc):
        if done == 2:                                 # step 2's progress report: its checkpoint is next
            os.kill(os.getpid(), signal.SIGTERM)

    shutdown.reset()
    try:
        with pytest.raises(shutdown.Preempted, match="checkpoint at step 2 of 4"):
            run_rl_reasoning(cfg, inputs, Workdir.at(tmp_path / "stopped", seed=3, progress=sigterm_in_step_2))
    finally:
        shutdown.reset()
    ckpt = tmp_path / "stopped" / "checkpoint" / "ckpt"
    assert checkpoint.select_resume(ckpt)[1]["step"] == 2
    run_rl_reasoning(cfg, inputs, Workdir.at(tmp_path / "stopped", seed=3))
    a = load_file(tmp_path / "clean" / "out" / "consolidated.safetensors")
    b = load_file(tmp_path / "stopped" / "out" / "consolidated.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
