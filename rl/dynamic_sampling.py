"""DAPO's batch shaping for GRPO stages: dynamic sampling and overlong responses.

Dynamic sampling. A group whose rewards all agree has zero advantage for every sample: it
carries no GRPO signal, only dilutes the token mean. After a step's draw is scored, each such
group is replaced by a fresh prompt's group (drawn, generated and scored like the first), until
every group of the batch carries signal or the step's bound on extra groups is spent; a group
still flat then trains with zero advantage, as without dynamic sampling. The step's reward and
verified figures stay those of its first draw (what the policy does on the prompt distribution):
the trained batch is selected for disagreement and its reward says nothing about progress.

Overlong responses (a response that hit max_new_tokens before its stop token):
    keep     trained on as scored
    filter   kept in its group's baseline but out of the loss (loss mask zeroed)
    penalty  DAPO's soft punishment, added to the reward: 0 up to max_new_tokens - buffer tokens,
             then falling linearly to -1 at max_new_tokens; a truncated response gets -1
"""
from __future__ import annotations

from typing import Any, Callable, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from rl.sample import Sample, Status

Info = TypeVar("Info")


class DynamicSamplingConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_extra_groups: int = Field(0, ge=0, description=(
        "groups a step may draw beyond prompts_per_step to replace zero-variance ones (DAPO's dynamic sampling); "
        "0: off, zero-variance groups train with zero advantage"))


class OverlongConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["keep", "filter", "penalty"] = Field("keep", description=(
        "a response that hit max_new_tokens: keep (trained as scored), filter (out of the loss, still in its "
        "group's baseline), penalty (DAPO's soft overlong punishment added to the reward)"))
    buffer: int = Field(0, ge=0, description="penalty: the last tokens before max_new_tokens over which the "
                        "penalty grows linearly from 0 to 1")


def overlong_penalty(length: int, truncated: bool, max_new_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens."""
    if truncated or length >= max_new_tokens:
        return -1.0
    start = max_new_tokens - buffer
    return 0.0 if length <= start else (start - length) / buffer


def apply_overlong(samples: list[Sample], cfg: OverlongConfig, max_new_tokens: int) -> dict[str, int]:
    """Apply `cfg` to scored samples in place; returns {"overlong/truncated", "overlong/filtered",
    "overlong/penalised"} counts."""
    scored = [s for s in samples if s.status in (Status.OK, Status.TRUNCATED)]
    truncated = [s for s in scored if s.status == Status.TRUNCATED]
    counts = {"overlong/truncated": len(truncated), "overlong/filtered": 0, "overlong/penalised": 0}
    if cfg.mode == "filter":
        for s in truncated:
            s.loss_mask = [0] * len(s.loss_mask)
        counts["overlong/filtered"] = len(truncated)
    elif cfg.mode == "penalty":
        for s in scored:
            p = overlong_penalty(len(s.response_ids), s.status == Status.TRUNCATED, max_new_tokens, cfg.buffer)
            if p:
                s.reward += p
                s.rewards["overlong"] = p
                counts["overlong/penalised"] += 1
    return counts


def flat_groups(samples: list[Sample]) -> list[int]:
    """Ids of the groups whose trainable samples' rewards all agree (no GRPO signal), in order."""
    rewards: dict[int, list[float]] = {}
    for s in samples:
        rewards.setdefault(s.group, [])
        if s.trainable:
            rewards[s.group].append(s.reward)
    return [g for g, r in rewards.items() if len(set(r)) <= 1]


def fill_batch(rollout: Callable[[int, int, int], tuple[list[Sample], Info]], groups: int,
               cfg: DynamicSamplingConfig) -> tuple[list[Sample], list[Sample], Info, dict[str, Any]]:
    """The batch a step trains on. rollout(round, first_group_id, n) draws n prompts for that
    round of the step, generates and scores their groups (ids first_group_id ..) and returns the
    samples (every rank the same, gathered) with the stage's own info on them. Round 0 is the
    step's draw of `groups` groups; each later round draws as many groups as are still flat,
    within the bound, and each of its groups that carries signal takes the place of a flat one.
    Returns (the trained samples, round 0's samples, round 0's info, stats): dynamic/flat_drawn
    (flat groups of round 0), dynamic/extra_groups (drawn beyond the step's), dynamic/rounds, dynamic/replaced, dynamic/flat_trained (flat
    groups left in the batch when the bound was spent)."""
    first, info = rollout(0, 0, groups)
    batch = list(first)
    flat_drawn = len(flat_groups(first))
    budget, rnd, next_id, replaced = cfg.max_extra_groups, 0, groups, 0
    while budget > 0:
        flat = flat_groups(batch)
        if not flat:
            break
        rnd += 1
        n = min(len(flat), budget)
        fresh, _ = rollout(rnd, next_id, n)
        next_id, budget = next_id + n, budget - n
        still_flat = set(flat_groups(fresh))
        useful = {s.group for s in fresh} - still_flat
        out = set(flat[:len(useful)])
        batch = [s for s in batch if s.group not in out] + [s for s in fresh if s.group in useful]
        replaced += len(useful)
    stats = {"dynamic/flat_drawn": flat_drawn, "dynamic/extra_groups": next_id - groups, "dynamic/rounds": rnd, "dynamic/replaced": replaced,
             "dynamic/flat_trained": len(flat_groups(batch))}
    return batch, first, info, stats


def totals(records: list[dict[str, Any]]) -> dict[str, int] | None:
    """A stage's dynamic-sampling and overlong counts over its steps (None when it recorded none)."""
    keys = sorted({k for r in records for k in r if k.startswith(("dynamic/", "overlong/"))})
    return {k: int(sum(r.get(k, 0) for r in records)) for k in keys} or None
