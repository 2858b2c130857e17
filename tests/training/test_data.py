"""The packed-data loader: rank sharding, seeded per-epoch order, exact resume, doc ids, labels."""
from __future__ import annotations

import numpy as np
import pytest

from data_processing.packing import PackedDataset
from training.data import IGNORE, PackedLoader, collate, doc_ids_from_starts, rank_share


class Numbered:
    """n sequences whose tokens all equal the sequence index: batches reveal which were read."""

    def __init__(self, n: int, seq_len: int = 8):
        self.n, self.seq_len, self.meta = n, seq_len, {"pad_id": None}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"input_ids": np.full(self.seq_len, i, dtype=np.int64), "doc_starts": np.array([0])}


def _seen(loader: PackedLoader, batches: int) -> list[int]:
    return [int(b["input_ids"][j, 0]) for _ in range(batches) for b in [loader.next_batch()] for j in range(loader.B)]


@pytest.mark.parametrize("n, world", [(40, 2), (41, 2), (30, 4)])
def test_rank_shares_are_disjoint_and_cover_the_epoch(n, world):
    shares = [rank_share(n, seed=3, epoch=0, rank=r, world=world) for r in range(world)]
    assert len({len(s) for s in shares}) == 1                     # lockstep: equal shares
    flat = np.concatenate(shares)
    assert len(set(flat.tolist())) == len(flat)                   # disjoint
    assert len(flat) == n - n % world                             # all but at most world-1
    if n % world == 0:
        assert sorted(flat.tolist()) == list(range(n))            # covering


def test_order_is_seeded_and_changes_per_epoch():
    a = [rank_share(50, 1, e, 0, 1).tolist() for e in range(2)]
    b = [rank_share(50, 1, e, 0, 1).tolist() for e in range(2)]
    c = rank_share(50, 2, 0, 0, 1).tolist()
    assert a == b
    assert a[0] != a[1] and sorted(a[0]) == sorted(a[1]) == list(range(50))
    assert c != a[0]


def test_loader_reads_each_ranks_share_across_epochs():
    ds, B, world = Numbered(24), 3, 2
    loaders = [PackedLoader(ds, B, rank=r, world=world, seed=5) for r in range(world)]
    per_epoch = loaders[0].batches_per_epoch()
    assert per_epoch == 4
    epoch0 = [set(_seen(ld, per_epoch)) for ld in loaders]
    assert epoch0[0].isdisjoint(epoch0[1]) and epoch0[0] | epoch0[1] == set(range(24))
    nxt = _seen(loaders[0], 1)                                     # rolls into epoch 1
    assert loaders[0].epoch == 1 and nxt == rank_share(24, 5, 1, 0, world)[:B].tolist()


def test_resume_continues_with_exactly_the_next_sample():
    ds = Numbered(37)
    full = PackedLoader(ds, 4, rank=1, world=2, seed=9)
    want = _seen(full, 12)                                        # crosses an epoch boundary
    first = PackedLoader(ds, 4, rank=1, world=2, seed=9)
    head = _seen(first, 5)
    state = dict(first.state_dict())
    resumed = PackedLoader(ds, 4, rank=1, world=2, seed=9)
    resumed.load_state_dict(state)
    assert head + _seen(resumed, 7) == want
    with pytest.raises(ValueError, match="seed"):
        PackedLoader(ds, 4, rank=1, world=2, seed=10).load_state_dict(state)


def test_too_small_dataset_is_refused():
    with pytest.raises(ValueError, match="micro-batch"):
        PackedLoader(Numbered(5), 4, rank=0, world=2)


def test_doc_ids_labels_and_padding():
    assert doc_ids_from_starts(np.array([0, 3, 5]), 7).tolist() == [0, 0, 0, 1, 1, 2, 2]
    b = collate([{"input_ids": np.array([5, 6, 7, 0, 9, 1, 1]), "doc_starts": np.array([0, 4])}], pad_id=1)
    assert b["doc_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1]]
    # labels[t] = input_ids[t+1]; the last position and pad targets are ignored
    assert b["labels"].tolist() == [[6, 7, 0, 9, IGNORE, IGNORE, IGNORE]]


def test_real_packed_shards(packed):
    ds = PackedDataset(packed["pack"], "train")
    loader = PackedLoader(ds, 2, rank=0, world=2, seed=0)
    b = loader.next_batch()
    assert b["input_ids"].shape == (2, ds.seq_len) and b["doc_ids"].shape == (2, ds.seq_len)
    i = int(rank_share(len(ds), 0, 0, 0, 2)[0])
    item = ds[i]
    assert b["input_ids"][0].tolist() == item["input_ids"].tolist()
    starts = item["doc_starts"].tolist()
    ids = b["doc_ids"][0].tolist()
    assert all(ids[s] == ids[s - 1] + 1 for s in starts if s > 0)  # a new id at every document start
    assert len(set(ids)) == len(starts)


def test_store_backed_shards_give_the_same_batches(packed):
    from runtime.store import LocalStore

    local = PackedDataset(packed["pack"], "train")
    remote = PackedDataset((LocalStore(packed["pack"].parent), "pack"), "train")   # byte-range reads
    a, b = PackedLoader(local, 3, rank=1, world=2, seed=4), PackedLoader(remote, 3, rank=1, world=2, seed=4)
    for _ in range(3):
        x, y = a.next_batch(), b.next_batch()
        assert all(x[k].equal(y[k]) for k in x)
