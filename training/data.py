"""Micro-batches from packed token shards, sharded by rank, shuffled per epoch, resumable.

Order: epoch e visits the sequences in a permutation seeded by (seed, e); rank r of W takes
positions r, r+W, r+2W, ... of it, after the permutation is cut to a multiple of W so every
rank has the same number of sequences (ranks step in lockstep; at most W-1 sequences of an
epoch are skipped). A rank's micro-batches are consecutive runs of micro_batch_size of its
share; an epoch's last partial micro-batch is dropped.

The position (epoch, index into the rank's share) is the whole state: `state_dict()` goes into
the checkpoint meta and `load_state_dict()` makes the next batch exactly the one that would have
come next. Every rank has the same state, so one copy is saved.

Batch tensors (B micro-batch, T seq_len):
  input_ids [B,T] long; labels [B,T] = input_ids shifted left, the last position and padding
  targets are -100; doc_ids [B,T] long, a new id at every document start (doc_starts), so the
  model restarts positions and masks attention per document.
Items may carry "loss_mask" [T] (SFT data, data_processing.packing.pack_samples): 1 where the
token is a training target. labels[t] predicts token t+1, so it becomes -100 where
loss_mask[t+1] is 0 (prompt, user, tool and padding tokens contribute no loss).
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

IGNORE = -100


def doc_ids_from_starts(doc_starts: np.ndarray, seq_len: int) -> np.ndarray:
    """Offsets where documents start -> one id per token (0, 0, 1, 1, 1, 2, ...)."""
    marks = np.zeros(seq_len, dtype=np.int64)
    marks[np.asarray(doc_starts, dtype=np.int64)] = 1
    marks[0] = 0  # a sequence always starts a document (or its continuation): id 0
    return np.cumsum(marks)


def collate(items: list[dict[str, np.ndarray]], pad_id: int | None) -> dict[str, torch.Tensor]:
    ids = torch.from_numpy(np.stack([it["input_ids"] for it in items]))                  # [B,T]
    T = ids.shape[1]
    docs = torch.from_numpy(np.stack([doc_ids_from_starts(it["doc_starts"], T) for it in items]))
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:]
    if pad_id is not None:
        labels[labels == pad_id] = IGNORE
    if "loss_mask" in items[0]:
        mask = torch.from_numpy(np.stack([it["loss_mask"] for it in items]))           # [B,T]
        labels[:, :-1][mask[:, 1:] == 0] = IGNORE
    return {"input_ids": ids, "labels": labels, "doc_ids": docs}


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def rank_share(n: int, seed: int, epoch: int, rank: int, world: int) -> np.ndarray:
    order = epoch_order(n, seed, epoch)
    usable = n - n % world
    return order[:usable][rank::world]


class PackedLoader:
    """Iterates micro-batches forever (epoch after epoch) over a PackedDataset."""

    def __init__(self, dataset: Any, micro_batch_size: int, rank: int = 0, world: int = 1,
                 seed: int = 0, seq_len: int | None = None):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} not in [0, {world})")
        per_rank = len(dataset) // world
        if per_rank < micro_batch_size:
            raise ValueError(
                f"{len(dataset)} sequences cannot give {world} rank(s) a micro-batch of {micro_batch_size}"
            )
        self.dataset, self.B, self.rank, self.world, self.seed = dataset, micro_batch_size, rank, world, seed
        # Training on a prefix of longer packed sequences is allowed (crop), never the reverse.
        self.seq_len = seq_len or dataset.seq_len
        if self.seq_len > dataset.seq_len:
            raise ValueError(f"seq_len {self.seq_len} exceeds the packed data's {dataset.seq_len}")
        self.pad_id = dataset.meta.get("pad_id")
        self.epoch, self.index = 0, 0
        self._share: np.ndarray | None = None

    def batches_per_epoch(self) -> int:
        return (len(self.dataset) // self.world) // self.B

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "world": self.world}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed or state["world"] != self.world:
            raise ValueError(
                f"data-loader state is for seed {state['seed']} / world {state['world']}, "
                f"this run has seed {self.seed} / world {self.world}: the order would differ"
            )
        self.epoch, self.index, self._share = int(state["epoch"]), int(state["index"]), None

    def _items(self, indices: np.ndarray) -> list[dict[str, np.ndarray]]:
        items = [self.dataset[int(i)] for i in indices]
        if self.seq_len < self.dataset.seq_len:
            items = [{**{k: v[: self.seq_len] for k, v in it.items() if k in ("input_ids", "loss_mask")},
                      "doc_starts": it["doc_starts"][it["doc_starts"] < self.seq_len]} for it in items]
        return items

    def next_batch(self) -> dict[str, torch.Tensor]:
        if self._share is None:
            self._share = rank_share(len(self.dataset), self.seed, self.epoch, self.rank, self.world)
        if self.index + self.B > len(self._share):
            self.epoch, self.index = self.epoch + 1, 0
            self._share = rank_share(len(self.dataset), self.seed, self.epoch, self.rank, self.world)
        idx = self._share[self.index: self.index + self.B]
        self.index += self.B
        return collate(self._items(idx), self.pad_id)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()


def eval_batches(dataset: Any, micro_batch_size: int, max_sequences: int, rank: int = 0,
                 world: int = 1) -> Iterator[dict[str, torch.Tensor]]:
    """The first max_sequences held-out sequences (fixed, unshuffled), split across ranks."""
    n = min(len(dataset), max_sequences)
    mine = list(range(rank, n, world))
    pad_id = dataset.meta.get("pad_id")
    for s in range(0, len(mine), micro_batch_size):
        yield collate([dataset[i] for i in mine[s: s + micro_batch_size]], pad_id)
