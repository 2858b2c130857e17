"""RL algorithms by name: advantage estimators and policy losses register themselves here.

A stage's config names them (`advantage: grpo`, `policy_loss: icepop`); rl.update.update and
assign_advantages look them up, so a new algorithm is one registered function in its own module
plus a config string. The module must be imported before the config is read (the names are
checked then); tests/rl/test_algorithms.py adds REINFORCE with a baseline this way.

    advantage estimator   fn(rewards [N], groups [N], std_normalize) -> advantages [N]
    policy loss           fn(logp [B,T], batch, params) -> (loss, stats): batch is rl.update.collate's
                          dict (train_logprobs, rollout_logprobs, advantages, response_mask),
                          params the stage's rl.update.UpdateParams

Built in: `grpo` (reward minus the group mean, optionally over the group std); `icepop` (GRPO's
PPO clip with IcePop's mask, GLM-5 reasoning RL), `ppo` (the same without IcePop) and
`double_sided_is` (GLM-5's agentic loss) from rl.loss. Distillation's per-token advantage
(rl.opd) and the reward model's Bradley-Terry loss are their stages' own objectives.
"""
from __future__ import annotations

from typing import Annotated, Any, Callable

import torch
import torch.nn.functional as F
from pydantic import AfterValidator

from rl.loss import double_sided_is_loss, group_advantages, grpo_icepop_loss
from rl.opd import opd_loss, token_advantages
from rl.registry import registered, registrar

ADVANTAGES: dict[str, Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]] = {}
POLICY_LOSSES: dict[str, Callable[[torch.Tensor, dict[str, torch.Tensor], Any], tuple[torch.Tensor, dict]]] = {}
PREFERENCE_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}
WITHOUT_PI_OLD: set[str] = set()        # policy losses that never read train_logprobs


def register_advantage(name: str):
    return registrar(ADVANTAGES, "advantage estimator", name)


def register_policy_loss(name: str, pi_old: bool = True):
    register = registrar(POLICY_LOSSES, "policy loss", name)

    def deco(fn):
        register(fn)                   # a refused name leaves WITHOUT_PI_OLD as it was
        if not pi_old:
            WITHOUT_PI_OLD.add(name)
        return fn
    return deco


def register_preference_loss(name: str):
    return registrar(PREFERENCE_LOSSES, "preference loss", name)


def _advantage_name(name: str) -> str:
    return registered(ADVANTAGES, "advantage estimator", name)


def _policy_loss_name(name: str) -> str:
    return registered(POLICY_LOSSES, "policy loss", name)


def _preference_loss_name(name: str) -> str:
    return registered(PREFERENCE_LOSSES, "preference loss", name)


# config field types: a name checked against the registry when the config is read
AdvantageName = Annotated[str, AfterValidator(_advantage_name)]
PolicyLossName = Annotated[str, AfterValidator(_policy_loss_name)]
PreferenceLossName = Annotated[str, AfterValidator(_preference_loss_name)]


@register_advantage("grpo")
def grpo_advantage(rewards: torch.Tensor, groups: torch.Tensor, std_normalize: bool) -> torch.Tensor:
    return group_advantages(rewards, groups, std_normalize)


@register_policy_loss("icepop")
def icepop(logp, batch, params):
    return grpo_icepop_loss(logp, batch["train_logprobs"], batch["rollout_logprobs"], batch["advantages"],
                            batch["response_mask"], params.eps_low, params.eps_high, params.icepop_beta)


@register_policy_loss("ppo")
def ppo(logp, batch, params):
    return grpo_icepop_loss(logp, batch["train_logprobs"], batch["rollout_logprobs"], batch["advantages"],
                            batch["response_mask"], params.eps_low, params.eps_high, None)


@register_policy_loss("double_sided_is", pi_old=False)
def double_sided_is(logp, batch, params):
    return double_sided_is_loss(logp, batch["rollout_logprobs"], batch["advantages"], batch["response_mask"],
                                params.eps_low, params.eps_high)


@register_policy_loss("opd")
def opd(logp, batch, params):
    adv = token_advantages(batch["teacher_logprobs"], batch["train_logprobs"], batch["response_mask"],
                           params.adv_clip)
    return opd_loss(logp, batch["train_logprobs"], batch["rollout_logprobs"], adv, batch["response_mask"],
                    params.eps_low, params.eps_high, params.icepop_beta)


@register_preference_loss("bradley_terry")
def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected), the mean over pairs."""
    return -F.logsigmoid(chosen - rejected).mean()
