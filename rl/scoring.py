"""Verifier rewards on a batch of rollouts: each sample's text scored in the reward worker
(rl.rewards), a failure recorded as the sample's status rather than raised."""
from __future__ import annotations

from collections import Counter

from rl.rewards import RewardWorker
from rl.sample import Sample, Status


def score(worker: RewardWorker, samples: list[Sample], timeout_s: float) -> Counter:
    """Set reward / status on each sample; returns failures by reason."""
    failures: Counter = Counter()
    todo = [s for s in samples if s.status in (Status.OK, Status.TRUNCATED)]
    for s, outcome in zip(todo, worker.score([(s.text, s.task) for s in todo], timeout_s)):
        s.reward_reason = outcome.reason
        if outcome.status == "ok":
            s.reward = float(outcome.score)
            s.rewards = {s.task.domain: s.reward}
        else:
            s.status, s.reward = Status.REWARD_ERROR, 0.0
            failures[f"{s.task.domain}:{outcome.status}"] += 1
    return failures
