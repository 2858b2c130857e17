"""Off-policy control for asynchronous RL: admission (the main limit) and dropping (the backstop).

Admission, as in AReaL: with B samples per training step and the trainer at policy version v,
at most (eta + v + 1) * B samples may have been submitted in total, so no sample starts more
than eta versions behind the policy that trains on it.

Dropping: every generated token records the version that sampled it. A trajectory whose oldest
trained token is more than tau versions behind the current policy is dropped. A group is kept
when more than half of its members are valid; its baseline is then taken over the valid members
only (rl.loss.group_advantages on them), padding and dropped members contribute nothing.
Dropping favours short trajectories (long ones live longer and go stale), so the lengths of
kept and dropped samples are reported side by side.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rl.sample import Sample


def admit(submitted: int, n: int, version: int, eta: int, batch: int) -> bool:
    """May n more samples be submitted now?"""
    return submitted + n <= (eta + version + 1) * batch


def lag(sample: Sample, version: int) -> int:
    """Current version minus the oldest version among the sample's trained tokens."""
    trained = [v for v, m in zip(sample.versions, sample.loss_mask) if m]
    return version - min(trained) if trained else 0


@dataclass
class Filtered:
    kept: list[Sample]
    dropped: Counter = field(default_factory=Counter)      # reason -> samples
    kept_lengths: list[int] = field(default_factory=list)
    dropped_lengths: list[int] = field(default_factory=list)
    lags: Counter = field(default_factory=Counter)          # lag -> kept samples


def filter_groups(groups: dict[int, list[Sample]], version: int, tau: int) -> Filtered:
    out = Filtered([])
    for g, members in sorted(groups.items()):
        valid = []
        for s in members:
            if not s.trainable:
                out.dropped[f"status:{s.status.value}"] += 1
                out.dropped_lengths.append(len(s.response_ids))
            elif lag(s, version) > tau:
                out.dropped["stale"] += 1
                out.dropped_lengths.append(len(s.response_ids))
            else:
                valid.append(s)
        if 2 * len(valid) > len(members):
            out.kept += valid
            out.kept_lengths += [len(s.response_ids) for s in valid]
            out.lags.update(lag(s, version) for s in valid)
        else:
            out.dropped["group_minority_valid"] += len(valid)
            out.dropped_lengths += [len(s.response_ids) for s in valid]
    return out
