"""SIGTERM during an RL-side stage (rl-reasoning, rl-agentic, the reward model; rl.trainer's one
loop): the step in flight ends, a checkpoint is written, Preempted is raised; the rerun resumes to
exactly the uninterrupted result."""
from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from runtime import shutdown
from runtime.stage import Workdir
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


def _preempt_at(step: int):
    def progress(done, total, desc):
        if done == step:                              # this step's progress report: its checkpoint is next
            os.kill(os.getpid(), signal.SIGTERM)
    return progress


def _stopped_then_resumed(run, cfg, stage_inputs, tmp_path, seed: int, stop_at: int, total: int, weights: str):
    """Run clean; run again with SIGTERM in step stop_at (Preempted, checkpoint at that step);
    resume; the two final weights files are equal."""
    run(cfg, stage_inputs, Workdir.at(tmp_path / "clean", seed=seed))
    shutdown.reset()
    try:
        with pytest.raises(shutdown.Preempted, match=f"checkpoint at step {stop_at} of {total}"):
            run(cfg, stage_inputs, Workdir.at(tmp_path / "stopped", seed=seed, progress=_preempt_at(stop_at)))
    finally:
        shutdown.reset()
    assert checkpoint.select_resume(tmp_path / "stopped" / "checkpoint" / "ckpt")[1]["step"] == stop_at
    run(cfg, stage_inputs, Workdir.at(tmp_path / "stopped", seed=seed))
    a = load_file(tmp_path / "clean" / "out" / weights)
    b = load_file(tmp_path / "stopped" / "out" / weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_in_rl_agentic_checkpoints_and_resume_is_exact(tmp_path):
    from posttrain.rl_agentic import run_rl_agentic
    from tests.posttrain._chain import artifacts, make_tokenizer
    from tests.posttrain.test_rl_agentic import _cfg as agentic_cfg

    made = artifacts(tmp_path / "in", make_tokenizer(), {"rl-reasoning": 0})
    _stopped_then_resumed(run_rl_agentic, agentic_cfg(synchronous=True, checkpoint_every=10), made, tmp_path, 5,
                          2, 3, "consolidated.safetensors")


def test_sigterm_in_reward_model_checkpoints_and_resume_is_exact(tmp_path):
    from posttrain.reward_model import RewardModelConfig, run_reward_model
    from tests.posttrain._chain import artifacts, make_tokenizer

    made = artifacts(tmp_path / "in", make_tokenizer(), {"rl-reasoning": 3})
    cfg = RewardModelConfig(steps=3, batch_pairs=4, optim={"lr": 1e-3}, max_len=48, gsm8k_pairs=20, mbpp_pairs=10,
                            arithmetic_pairs=20, heldout_percent=25, checkpoint_every=10)
    _stopped_then_resumed(run_reward_model, cfg, made, tmp_path, 1, 2, 3, "head.safetensors")

