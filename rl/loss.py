"""Policy-gradient losses over per-token log-probs.

Shapes: B samples, T positions. Every tensor is aligned with the targets of the forward pass
(rl.update.collate): `mask` [B,T] is 1 on trained response tokens, `adv` [B] is one advantage
per sample, broadcast to its tokens.

GRPO + IcePop (reasoning RL; GLM-5 section 4.2, IcePop as in slime's `icepop_function`):
    rho_t   = pi_train(theta_old)(y_t) / pi_infer(theta_old)(y_t)       the train/inference mismatch
    w_t     = rho_t if 1/beta <= rho_t <= beta else 0                   IcePop: mask, not clip
    r_t     = pi_theta(y_t) / pi_train(theta_old)(y_t)
    l_t     = -min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)   PPO clip, no KL term
    loss    = mean_i ( sum_t sg(w_t) * l_t  /  |y_i| )
w is a constant (no gradient through rho). Masked tokens stay in the 1/|y_i| denominator: the
mask removes their gradient, it does not up-weight the rest of the sample.
"""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, std_normalize: bool = False,
                     eps: float = 1e-6) -> torch.Tensor:
    """rewards [N], groups [N] (group id per sample) -> advantages [N]: reward minus its group's
    mean, divided by the group's std when std_normalize (population std, + eps). A group whose
    rewards are all equal gets advantage 0 everywhere: it carries no learning signal."""
    adv = torch.zeros_like(rewards, dtype=torch.float)
    for g in groups.unique():
        sel = groups == g
        r = rewards[sel].float()
        a = r - r.mean()
        if std_normalize:
            a = a / (r.std(unbiased=False) + eps)
        adv[sel] = a
    return adv


def _per_sample_mean(token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def icepop_weights(train_old: torch.Tensor, rollout: torch.Tensor, beta: float) -> torch.Tensor:
    """sg(rho) inside [1/beta, beta], 0 outside. train_old, rollout [B,T] log-probs."""
    rho = torch.exp(train_old.detach() - rollout.detach())
    inside = (rho >= 1.0 / beta) & (rho <= beta)
    return torch.where(inside, rho, torch.zeros_like(rho))


def grpo_icepop_loss(logp: torch.Tensor, train_old: torch.Tensor, rollout: torch.Tensor, adv: torch.Tensor,
                     mask: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.28,
                     beta: float | None = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO + IcePop loss (module doc). beta=None turns IcePop off (w = 1)."""
    a = adv[:, None].to(logp.dtype)
    ratio = torch.exp(logp - train_old.detach())
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    token_loss = -torch.minimum(ratio * a, clipped * a)
    if beta is None:
        w = torch.ones_like(logp)
    else:
        w = icepop_weights(train_old, rollout, beta)
    loss = _per_sample_mean(w * token_loss, mask)
    n = mask.sum().clamp(min=1)
    with torch.no_grad():
        # a token is clipped when the clipped branch is the one min() took and it differs
        clip_active = ((clipped * a) < (ratio * a)) & (ratio != clipped)
        stats = {
            "icepop_masked_fraction": float(((w == 0).float() * mask).sum() / n) if beta is not None else 0.0,
            "clip_fraction": float((clip_active.float() * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
        }
    return loss, stats


def double_sided_is_loss(logp: torch.Tensor, rollout: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                         eps_low: float, eps_high: float) -> tuple[torch.Tensor, dict[str, float]]:
    """GLM-5's agentic-RL loss, with the rollout log-probs as pi_old (no pi_old forward pass):
        r = pi_theta / pi_rollout;  f(r) = r if 1 - eps_low < r < 1 + eps_high else 0
        loss = -mean( sg(f(r)) * A * log pi_theta )
    The gradient is sg(f(r)) * A * grad log pi: tokens outside the band contribute nothing, and
    unlike PPO's clip, A < 0 with r above the band gives no gradient either."""
    r = torch.exp(logp.detach() - rollout.detach())
    inside = (r > 1 - eps_low) & (r < 1 + eps_high)
    f = torch.where(inside, r, torch.zeros_like(r))
    token_loss = -(f * adv[:, None].to(logp.dtype) * logp)
    loss = _per_sample_mean(token_loss, mask)
    n = mask.sum().clamp(min=1)
    return loss, {"is_masked_fraction": float(((~inside).float() * mask).sum() / n)}
