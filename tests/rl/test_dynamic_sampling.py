"""DAPO's dynamic sampling and overlong handling (rl.dynamic_sampling)."""
from __future__ import annotations

import pytest

from domains.task import Task
from rl.dynamic_sampling import (
    DynamicSamplingConfig,
    OverlongConfig,
    apply_overlong,
    fill_batch,
    flat_groups,
    overlong_penalty,
)
from rl.sample import Sample, Status


def _group(gid: int, rewards: list[float]) -> list[Sample]:
    out = []
    for r in rewards:
        s = Sample(Task("t", f"p{gid}", ""), gid, [1, 2], response_ids=[3], loss_mask=[1], rollout_logprobs=[0.0])
        s.reward = r
        out.append(s)
    return out


class Rollouts:
    """A stand-in for a stage's rollout: round r's k-th group is flat unless its (r, k) is in
    `signal`; records every call."""

    def __init__(self, signal: set[tuple[int, int]]):
        self.signal, self.calls = signal, []

    def __call__(self, rnd: int, first: int, n: int):
        self.calls.append((rnd, first, n))
        samples = [s for k in range(n) for s in _group(first + k, [0.0, 1.0] if (rnd, k) in self.signal else [1.0, 1.0])]
        return samples, {"round": rnd}


def test_flat_groups_are_replaced_until_none_is_left():
    # round 0: groups 1 and 3 flat; round 1 draws 2, the first carries signal; round 2 draws 1, it does
    roll = Rollouts({(0, 0), (0, 2), (1, 0), (2, 0)})
    batch, first, info, stats = fill_batch(roll, 4, DynamicSamplingConfig(max_extra_groups=10))
    assert roll.calls == [(0, 0, 4), (1, 4, 2), (2, 6, 1)]
    assert sorted({s.group for s in batch}) == [0, 2, 4, 6] and not flat_groups(batch)
    assert info == {"round": 0} and sorted({s.group for s in first}) == [0, 1, 2, 3]
    assert stats == {"dynamic/flat_drawn": 2, "dynamic/extra_groups": 3, "dynamic/rounds": 2, "dynamic/replaced": 2,
                     "dynamic/flat_trained": 0}


def test_refills_stop_at_the_bound_and_the_rest_trains_flat():
    roll = Rollouts({(0, 0)})                                   # nothing drawn later carries signal
    batch, _, _, stats = fill_batch(roll, 4, DynamicSamplingConfig(max_extra_groups=5))
    assert sum(n for r, _, n in roll.calls if r > 0) == 5       # exactly the bound, never more
    assert len({s.group for s in batch}) == 4 and len(flat_groups(batch)) == 3
    assert stats["dynamic/extra_groups"] == 5 and stats["dynamic/flat_trained"] == 3 and stats["dynamic/replaced"] == 0


def test_off_draws_once_and_trains_what_it_drew():
    roll = Rollouts(set())
    batch, first, _, stats = fill_batch(roll, 3, DynamicSamplingConfig())
    assert roll.calls == [(0, 0, 3)] and batch == first and stats["dynamic/flat_trained"] == 3


def test_a_group_is_flat_on_its_trainable_samples_only():
    g = _group(0, [1.0, 0.0])
    g[1].status = Status.REWARD_ERROR                           # never trained: its 0 is not a disagreement
    assert flat_groups(g) == [0]


def test_overlong_penalty_follows_dapo():
    assert overlong_penalty(10, False, 20, 4) == 0.0
    assert overlong_penalty(16, False, 20, 4) == 0.0
    assert overlong_penalty(18, False, 20, 4) == pytest.approx(-0.5)
    assert overlong_penalty(20, True, 20, 4) == -1.0
    assert overlong_penalty(5, True, 20, 0) == -1.0


@pytest.mark.parametrize("mode", ["keep", "filter", "penalty"])
def test_overlong_modes(mode):
    ok, cut = _group(0, [1.0, 1.0])
    ok.response_ids, cut.response_ids = [5] * 3, [5] * 8
    cut.status, cut.loss_mask = Status.TRUNCATED, [1] * 8
    counts = apply_overlong([ok, cut], OverlongConfig(mode=mode, buffer=2), max_new_tokens=8)
    assert counts["overlong/truncated"] == 1
    if mode == "keep":
        assert cut.trainable and cut.reward == 1.0
    elif mode == "filter":
        assert not cut.trainable and counts["overlong/filtered"] == 1 and ok.trainable
    else:
        assert cut.reward == 0.0 and ok.reward == 1.0 and counts["overlong/penalised"] == 1
