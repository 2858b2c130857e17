"""The RL losses against values computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from rl.loss import (
    double_sided_is_loss,
    group_advantages,
    grpo_icepop_loss,
    icepop_weights,
)


def test_group_advantages_mean_centred_and_std_normalised():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    a = group_advantages(r, g)
    assert torch.allclose(a, torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3]))
    s = group_advantages(r, g, std_normalize=True)
    std = math.sqrt(2 / 9)
    assert torch.allclose(s, torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3]) / (std + 1e-6))
    flat = group_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), std_normalize=True)
    assert flat.tolist() == [0.0, 0.0]


def test_icepop_masks_exactly_out_of_band_tokens_and_weights_in_band_by_rho():
    rollout = torch.zeros(1, 5)
    # rho = exp(train - rollout): 0.4 (out), 0.5 (edge, in), 1.5 (in), 2.0 (edge, in), 2.5 (out)
    train = torch.log(torch.tensor([[0.4, 0.5, 1.5, 2.0, 2.5]]))
    w = icepop_weights(train, rollout, beta=2.0)
    assert torch.allclose(w, torch.tensor([[0.0, 0.5, 1.5, 2.0, 0.0]]))


def test_grpo_icepop_loss_value_and_denominator_keeps_masked_tokens():
    # one sample, 4 response tokens; pi_theta == pi_old (ratio 1), A = 2
    rollout = torch.zeros(1, 4)
    train = torch.log(torch.tensor([[1.0, 3.0, 1.2, 0.1]]))      # rho: 1 (in), 3 (out), 1.2 (in), 0.1 (out)
    logp = train.clone().requires_grad_(True)
    adv = torch.tensor([2.0])
    mask = torch.ones(1, 4)
    loss, stats = grpo_icepop_loss(logp, train, rollout, adv, mask)
    # token losses: -1 * A weighted by rho = [-2*1, 0, -2*1.2, 0]; divided by |y| = 4 (not 2)
    assert loss.item() == pytest.approx(-(2 * 1.0 + 2 * 1.2) / 4)
    assert stats["icepop_masked_fraction"] == pytest.approx(0.5)
    loss.backward()
    # d/dlogp of -w*A*exp(logp - old) at ratio 1 = -w*A / |y|
    assert torch.allclose(logp.grad, torch.tensor([[-2 * 1.0 / 4, 0.0, -2 * 1.2 / 4, 0.0]]))


def test_no_gradient_through_rho():
    rollout = torch.zeros(1, 3, requires_grad=True)
    train = torch.log(torch.tensor([[1.1, 0.9, 1.3]])).requires_grad_(True)
    logp = train.detach().clone().requires_grad_(True)
    loss, _ = grpo_icepop_loss(logp, train, rollout, torch.tensor([1.0]), torch.ones(1, 3))
    loss.backward()
    assert rollout.grad is None and train.grad is None
    assert logp.grad is not None and logp.grad.abs().sum() > 0


def test_ppo_clip_acts_only_when_ratio_leaves_the_band():
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    # ratio 1.5 with A > 0: clipped at 1.28 (no gradient); ratio 1.1: unclipped
    logp = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_(True)
    loss, stats = grpo_icepop_loss(logp, old, old, torch.tensor([1.0]), mask, beta=None)
    assert loss.item() == pytest.approx(-(1.28 + 1.1) / 2)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == pytest.approx(-1.1 / 2)
    # ratio exactly 1 (the first optimizer step on a rollout batch): nothing is clipped
    _, stats1 = grpo_icepop_loss(old.clone(), old, old, torch.tensor([1.0]), mask)
    assert stats1["clip_fraction"] == 0.0 and stats1["ratio_mean"] == 1.0


def test_double_sided_is_negative_advantage_above_band_gives_zero_gradient_unlike_ppo():
    rollout = torch.zeros(1, 1)
    logp = torch.log(torch.tensor([[1.5]])).requires_grad_(True)      # r = 1.5 > 1 + eps_high
    loss, stats = double_sided_is_loss(logp, rollout, torch.tensor([-1.0]), torch.ones(1, 1), 0.2, 0.28)
    loss.backward()
    assert logp.grad.item() == 0.0 and stats["is_masked_fraction"] == 1.0
    ppo_logp = torch.log(torch.tensor([[1.5]])).requires_grad_(True)
    ppo, _ = grpo_icepop_loss(ppo_logp, rollout, rollout, torch.tensor([-1.0]), torch.ones(1, 1), beta=None)
    ppo.backward()
    assert ppo_logp.grad.item() != 0.0          # PPO's min() keeps the unclipped branch for A < 0


def test_double_sided_is_in_band_gradient_is_sg_f_times_advantage():
    rollout = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.1, 0.7]])).requires_grad_(True)   # r = 1.1 (in), 0.7 (out)
    loss, _ = double_sided_is_loss(logp, rollout, torch.tensor([2.0]), torch.ones(1, 2), 0.2, 0.28)
    assert loss.item() == pytest.approx(-(1.1 * 2.0 * math.log(1.1)) / 2)
    loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(-1.1 * 2.0 / 2) and logp.grad[0, 1].item() == 0.0
