"""The reward-hacking signal: rewarded rollouts re-checked by an independent check.

A policy that finds a hole in its reward (a solution that memorised the tests, a verifier it can
satisfy without solving the task) keeps its reward while the independent check stops agreeing.
Each step re-checks up to `per_step` rewarded samples (seeded choice, so a resumed step picks the
same ones) of the domains that have a check (rl.rewards.RECHECKS, or an environment's recheck(),
whose result the sample already carries as reward_recheck), and records

    reward_recheck_disagreement   share of re-checked samples the check disagrees with (None: none)
    reward_rechecked              how many were re-checked

A step whose disagreement is at least `alert` over at least MIN_RECHECKED samples is an alert:
logged as a warning and listed in the stage's result (`reward_recheck.alert_steps`), which
`glmforge status` shows. The check never changes a reward.
"""
from __future__ import annotations

import logging
import random
from typing import Any, Sequence

from rl.rewards import RECHECKS, RewardWorker
from rl.sample import Sample, Status

log = logging.getLogger("glmforge")
MIN_RECHECKED = 2


def recheck_rewarded(worker: RewardWorker, samples: Sequence[Sample], per_step: int, seed: int, step: int,
                     timeout_s: float) -> None:
    """Set reward_recheck (1.0 agrees, 0.0 disagrees) on up to per_step rewarded samples."""
    todo = [s for s in samples if s.reward >= 1.0 and s.status in (Status.OK, Status.TRUNCATED)
            and s.task.domain in RECHECKS and s.reward_recheck is None]
    if per_step <= 0 or not todo:
        return
    chosen = random.Random(seed * 1_000_003 + step).sample(todo, min(per_step, len(todo)))
    for s, out in zip(chosen, worker.recheck([(s.text, s.task) for s in chosen], timeout_s)):
        if out.status == "ok":
            s.reward_recheck = out.score


def step_metrics(samples: Sequence[Sample]) -> dict[str, Any]:
    checked = [s.reward_recheck for s in samples if s.reward_recheck is not None]
    return {"reward_recheck_disagreement": (sum(c < 1.0 for c in checked) / len(checked)) if checked else None,
            "reward_rechecked": len(checked)}


def is_alert(record: dict[str, Any], alert: float) -> bool:
    share = record.get("reward_recheck_disagreement")
    return share is not None and record.get("reward_rechecked", 0) >= MIN_RECHECKED and share >= alert


def warn(stage: str, record: dict[str, Any], alert: float) -> None:
    if is_alert(record, alert):
        log.warning("%s step %d: the independent check disagrees with %.0f%% of %d rewarded samples it "
                    "re-checked (alert at %.0f%%): the policy may be exploiting its reward", stage, record["step"],
                    100 * record["reward_recheck_disagreement"], record["reward_rechecked"], 100 * alert)


def summary(records: Sequence[dict[str, Any]], alert: float) -> dict[str, Any]:
    """For the stage's result: totals, the mean share, and the steps that raised an alert."""
    checked = sum(r.get("reward_rechecked", 0) for r in records)
    disagreed = sum(r.get("reward_rechecked", 0) * r["reward_recheck_disagreement"] for r in records
                    if r.get("reward_recheck_disagreement") is not None)
    return {"rechecked": checked, "disagreement": (disagreed / checked) if checked else None, "alert_at": alert,
            "alert_steps": [r["step"] for r in records if is_alert(r, alert)]}
