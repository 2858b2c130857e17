"""Drawing a step's prompts: a pure function of (seed, step, round), so a resumed stage replays
the prompts an uninterrupted one drew."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from domains.task import Task


def draw_tasks(pools: dict[str, list[Task]], weights: dict[str, float], n: int, seed: int, step: int,
               rnd: int = 0, within: dict[str, list[float]] | None = None) -> list[Task]:
    """n prompts for `step` (round `rnd` of its dynamic sampling, rl.dynamic_sampling): a source
    by weight, then a prompt of it, uniformly or by `within`'s per-prompt weights."""
    rng = random.Random(seed * 1_000_003 + step if rnd == 0 else f"{seed}/{step}/{rnd}")
    names = list(pools)
    picks = rng.choices(names, weights=[weights[d] for d in names], k=n)
    if within is None:
        return [rng.choice(pools[d]) for d in picks]
    return [rng.choices(pools[d], weights=within[d])[0] for d in picks]


PASS_RATE_BINS = ("0", "(0,1/4]", "(1/4,1/2]", "(1/2,3/4]", "(3/4,1)", "1")


def histogram(rates: list[float]) -> dict[str, int]:
    """Pass rates binned: "0" (never solved), "(0,1/4]" .. "(3/4,1)", "1" (always solved)."""
    out = dict.fromkeys(PASS_RATE_BINS, 0)
    for p in rates:
        key = ("0" if p <= 0 else "1" if p >= 1 else "(0,1/4]" if p <= 0.25 else "(1/4,1/2]" if p <= 0.5
               else "(1/2,3/4]" if p <= 0.75 else "(3/4,1)")
        out[key] += 1
    return out


class PromptPoolConfig(BaseModel):
    """How an RL stage draws from rl-prompts' measured pool (GLM-4.5's prompt filtering and
    response scaling)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    measured: bool = Field(False, description="draw from rl-prompts' measured pool (filtered and weighted below) "
                           "instead of each domain's whole pool, uniformly")
    drop_solved: bool = Field(True, description="leave out the prompts the SFT model always solved (pass rate 1)")
    drop_unsolved: bool = Field(False, description="leave out the prompts it never solved (pass rate 0)")
    weighting: Literal["uniform", "difficulty"] = Field("uniform", description=(
        "within a domain: uniform, or difficulty (a prompt drawn in proportion to 1 - its pass rate)"))
    hard_below: float = Field(0.25, ge=0, le=1, description="a prompt whose pass rate is at most this is hard")
    hard_group_scale: int = Field(1, ge=1, description="a hard prompt's group is this many times group_size "
                                  "(response scaling; GLM-4.5 samples hard prompts 4x); 1: off")


def read_pool(path: Path) -> list[dict[str, Any]]:
    """rl-prompts' pool.jsonl: one measured prompt per line."""
    return [json.loads(x) for x in Path(path).read_text(encoding="utf-8").splitlines() if x.strip()]


def pool_tasks(rows: list[dict[str, Any]], domains: dict[str, float], policy: PromptPoolConfig, stage: str
               ) -> tuple[dict[str, list[Task]], dict[str, list[float]] | None]:
    """The measured pool under `policy`, per domain of positive weight: (tasks, each with its
    pass rate in meta["pass_rate"]; per-task draw weights, or None when uniform). A ValueError of
    one line when a domain is not in the pool or the policy leaves it no prompt."""
    pools: dict[str, list[Task]] = {}
    weights: dict[str, list[float]] = {}
    for d, w in domains.items():
        if w <= 0:
            continue
        rows_d = [r for r in rows if r["domain"] == d]
        if not rows_d:
            raise ValueError(f"{stage}: prompt_pool.measured draws domain {d!r}, which rl-prompts did not measure "
                             f"(add it to rl_prompts.domains)")
        kept = [r for r in rows_d if not (policy.drop_solved and r["pass_rate"] >= 1.0)
                and not (policy.drop_unsolved and r["pass_rate"] <= 0.0)]
        if policy.weighting == "difficulty":
            kept = [r for r in kept if r["pass_rate"] < 1.0]
        if not kept:
            rates = [r["pass_rate"] for r in rows_d]
            raise ValueError(f"{stage}: prompt_pool leaves no prompt of domain {d!r}: of {len(rates)} measured, "
                             f"{sum(p >= 1 for p in rates)} always solved, {sum(p <= 0 for p in rates)} never "
                             f"(drop_solved={policy.drop_solved}, drop_unsolved={policy.drop_unsolved}, "
                             f"weighting={policy.weighting})")
        pools[d] = [Task(d, r["prompt"], r["answer"], {**r["meta"], "pass_rate": r["pass_rate"]}) for r in kept]
        weights[d] = [1.0 - r["pass_rate"] for r in kept]
    return pools, weights if policy.weighting == "difficulty" else None


def group_size(task: Task, size: int, policy: PromptPoolConfig) -> int:
    """Samples of `task`'s group: `size`, times hard_group_scale for a hard measured prompt."""
    p = task.meta.get("pass_rate")
    return size * policy.hard_group_scale if p is not None and p <= policy.hard_below else size
