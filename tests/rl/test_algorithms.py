"""A new RL algorithm is one registered function and a config string: REINFORCE with a constant
baseline, added here and nowhere else, trains through the rl-reasoning stage."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from runtime.stage import Workdir
from posttrain.reward_model import RewardModelConfig
from posttrain.rl_reasoning import run_rl_reasoning
from rl.algorithms import (
    ADVANTAGES,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    register_advantage,
    register_policy_loss,
)
from tests.posttrain.test_rl_reasoning import _cfg, inputs  # noqa: F401 (fixture)


@register_advantage("half_baseline")
def half_baseline(rewards: torch.Tensor, groups: torch.Tensor, std_normalize: bool) -> torch.Tensor:
    """r - 0.5: every sample moves, even where a group's rewards agree (GRPO gives those 0)."""
    return rewards.float() - 0.5


@register_policy_loss("reinforce")
def reinforce(logp, batch, params):
    """-A * log pi per token, averaged per sample: no ratio, no clip, no mismatch correction."""
    token_loss = -batch["advantages"][:, None] * logp
    mask = batch["response_mask"]
    loss = ((token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    return loss, {"reinforce_tokens": float(mask.sum())}


def test_registered_algorithm_trains_through_the_stage(inputs, tmp_path):  # noqa: F811
    cfg = _cfg(advantage="half_baseline", policy_loss="reinforce", icepop_beta=None)
    run_rl_reasoning(cfg, inputs, Workdir.at(tmp_path, seed=3))
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all("reinforce_tokens" in r and "clip_fraction" not in r for r in records)   # its loss ran
    start = load_file(inputs["sft"] / "consolidated.safetensors")
    end = load_file(tmp_path / "out" / "consolidated.safetensors")
    assert any(not torch.equal(start[k], end[k]) for k in start if k in end)


def test_unknown_names_are_refused_with_what_is_registered():
    assert {"grpo", "half_baseline"} <= set(ADVANTAGES)
    assert {"icepop", "ppo", "double_sided_is", "reinforce"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match="unknown policy loss 'nope'; registered: double_sided_is, icepop, opd, ppo"):
        _cfg(policy_loss="nope")
    with pytest.raises(ValueError, match="unknown preference loss 'hinge'; registered: bradley_terry"):
        RewardModelConfig(loss="hinge")
    with pytest.raises(ValueError, match="unknown advantage estimator 'x'"):
        _cfg(advantage="x")
    with pytest.raises(ValueError, match="is already registered"):
        register_policy_loss("icepop")(lambda logp, batch, params: None)


def test_bradley_terry_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    want = (-torch.log(torch.sigmoid(torch.tensor(2.0))) + torch.log(torch.tensor(2.0))) / 2
    assert torch.isclose(PREFERENCE_LOSSES["bradley_terry"](chosen, rejected), want)
