"""Admission control, stale-sample dropping, group validity, and the routing ring."""
from __future__ import annotations

from domains.task import Task
from rl.orchestrator import HashRing
from rl.sample import Sample, Status
from rl.staleness import admit, filter_groups, lag

T = Task("x", "", "")


def _s(group, versions, mask=None, status=Status.OK):
    return Sample(T, group, [1], response_ids=[5] * len(versions), versions=versions,
                  loss_mask=mask or [1] * len(versions), rollout_logprobs=[0.0] * len(versions), status=status)


def test_admission_allows_eta_plus_version_plus_one_batches():
    B = 8
    assert admit(0, 8, version=0, eta=0, batch=B) and not admit(8, 8, version=0, eta=0, batch=B)
    assert admit(8, 8, version=1, eta=0, batch=B)
    assert admit(8, 8, version=0, eta=1, batch=B) and not admit(16, 8, version=0, eta=1, batch=B)


def test_lag_reads_the_oldest_trained_token():
    s = _s(0, [3, 3, 5, 6], mask=[0, 1, 1, 1])       # the version-3 token at 0 is an observation
    assert lag(s, 7) == 4


def test_stale_members_dropped_and_minority_groups_dropped_whole():
    groups = {
        0: [_s(0, [5, 5]), _s(0, [5]), _s(0, [2, 5, 5, 5])],            # one stale (lag 3 > tau 2): 2/3 valid
        1: [_s(1, [1, 1]), _s(1, [1]), _s(1, [5])],                     # two stale: 1/3 valid -> whole group out
        2: [_s(2, [5]), _s(2, [5], status=Status.REWARD_ERROR)],        # 1/2 valid is not more than half
    }
    f = filter_groups(groups, version=5, tau=2)
    assert [s.group for s in f.kept] == [0, 0]
    assert f.dropped == {"stale": 3, "group_minority_valid": 2, "status:reward_error": 1}
    assert sorted(f.dropped_lengths) == [1, 1, 1, 1, 2, 4]
    assert f.kept_lengths == [2, 1] and f.lags == {0: 2}


def test_tau_zero_keeps_only_current_version():
    f = filter_groups({0: [_s(0, [3]), _s(0, [3]), _s(0, [2])]}, version=3, tau=0)
    assert len(f.kept) == 2 and f.dropped == {"stale": 1}


def test_ring_moves_only_the_lost_workers_keys():
    ring = HashRing()
    for w in ("w0", "w1", "w2"):
        ring.add(w)
    before = {k: ring.owner(str(k)) for k in range(300)}
    assert set(before.values()) == {"w0", "w1", "w2"}
    ring.remove("w1")
    after = {k: ring.owner(str(k)) for k in range(300)}
    assert all(after[k] == before[k] for k in before if before[k] != "w1")
    assert all(after[k] != "w1" for k in after)
