"""On-policy distillation (OPD) loss: the teacher's log-probs as a per-token advantage.

The student samples y; the teacher scores the student's exact token ids; per token

    A_t   = sg(log pi_teacher(y_t) - log pi_student_old(y_t))      (group size 1: no baseline)
    rho_t = pi_train(theta_old)(y_t) / pi_infer(theta_old)(y_t)     the RL core's IS correction
    w_t   = IcePop(rho_t)  (rl.loss.icepop_weights; rho itself inside [1/beta, beta], 0 outside)
    r_t   = pi_theta(y_t) / pi_train(theta_old)(y_t)
    l_t   = -min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)
    loss  = mean_i ( sum_t sg(w_t) * l_t / |y_i| )

This is GRPO + IcePop (rl.loss.grpo_icepop_loss) with the per-sample advantage replaced by a
per-token one: at r = 1 the gradient is -sum_t w_t A_t grad log pi_theta(y_t), the policy
gradient of the reverse KL(pi_student || pi_teacher) on the student's own samples. Tokens where
the teacher is more confident than the student are pushed up, the others down.
"""
from __future__ import annotations

import torch

from rl.loss import _per_sample_mean, icepop_weights


def token_advantages(teacher: torch.Tensor, student: torch.Tensor, mask: torch.Tensor,
                     clip: float | None = None) -> torch.Tensor:
    """sg(teacher - student) on masked tokens ([B,T] log-probs), 0 elsewhere; optionally clipped
    to [-clip, clip] (a teacher far more confident than a random student otherwise dominates)."""
    a = (teacher.detach() - student.detach()) * mask
    return a.clamp(-clip, clip) if clip is not None else a


def opd_loss(logp: torch.Tensor, train_old: torch.Tensor, rollout: torch.Tensor, adv: torch.Tensor,
             mask: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.28,
             beta: float | None = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The module doc's loss; adv [B,T] per token. beta=None turns IcePop off (w = 1)."""
    a = adv.detach().to(logp.dtype)
    ratio = torch.exp(logp - train_old.detach())
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    token_loss = -torch.minimum(ratio * a, clipped * a)
    w = torch.ones_like(logp) if beta is None else icepop_weights(train_old, rollout, beta)
    loss = _per_sample_mean(w * token_loss, mask)
    n = mask.sum().clamp(min=1)
    with torch.no_grad():
        stats = {
            "icepop_masked_fraction": float(((w == 0).float() * mask).sum() / n) if beta is not None else 0.0,
            "advantage_mean": float((a * mask).sum() / n),
            "reverse_kl": float((-a * mask).sum() / n),    # mean log pi_student - log pi_teacher on samples
        }
    return loss, stats
