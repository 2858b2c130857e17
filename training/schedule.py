"""Learning-rate schedules as pure functions of the step, so resuming needs no scheduler state.

lr_factor(step) multiplies every param group's base lr (the optimizer's lr for step `step`,
0-based): a linear warm-up over warmup_steps, then
  cosine:   from 1 down to min_lr_ratio at the last step;
  wsd:      1 (stable) until the last decay_fraction of the steps, then linearly to min_lr_ratio;
  constant: 1.
"""
from __future__ import annotations

import math


def lr_factor(step: int, total: int, schedule: str, warmup: int = 0, min_ratio: float = 0.1,
              decay_fraction: float = 0.2) -> float:
    assert 0 <= step < total, f"step {step} outside [0, {total})"
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, total - 1 - warmup)
        progress = min(1.0, (step - warmup) / span)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * (total - warmup)))
        decay_start = total - decay_steps
        if step < decay_start:
            return 1.0
        progress = (step - decay_start + 1) / decay_steps
        return 1.0 - (1.0 - min_ratio) * progress
    raise ValueError(f"unknown schedule {schedule!r}; choose cosine, wsd or constant")
