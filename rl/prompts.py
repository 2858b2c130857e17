"""Drawing a step's prompts: a pure function of (seed, step, round), so a resumed stage replays
the prompts an uninterrupted one drew."""
from __future__ import annotations

import random

from domains.task import Task


def draw_tasks(pools: dict[str, list[Task]], weights: dict[str, float], n: int, seed: int, step: int,
               rnd: int = 0) -> list[Task]:
    """n prompts for `step` (round `rnd` of its dynamic sampling, rl.dynamic_sampling): a source
    by weight, then a prompt of it, uniformly."""
    rng = random.Random(seed * 1_000_003 + step if rnd == 0 else f"{seed}/{step}/{rnd}")
    names = list(pools)
    return [rng.choice(pools[d]) for d in rng.choices(names, weights=[weights[d] for d in names], k=n)]
