"""Multi-query associative recall (MQAR; Zoology, Arora et al. 2023, arXiv 2312.04927):
token-id documents a small attention model learns in minutes, and their scorer.

A document of `seq_len` token ids holds `n_pairs` key/value pairs "k v" (single tokens: keys
from `key_ids`, values from `value_ids`, distinct keys per document), then the same keys asked
again later, each query written as "k v" too. The training target is the value after each
query's key: `labels[t]` (already shifted, as GLMModel takes them: the token that should follow
`input_ids[t]`) is the value where `input_ids[t]` is a query's key, and -100 everywhere else
(the first occurrences are unpredictable, and so is the filler). Every other position holds a
filler token drawn from `filler_ids` (or a fixed `filler_id`).

Layouts:
  pairs_first  (Zoology) the pairs fill positions 0..2N-1; the queries sit at random slots of
               the rest. Query-to-key distances then span the whole sequence, so a sliding
               window of W sees the key of a query at position q only when q - key_pos < W.
  spread       the pairs sit at random slots of the first `pair_fraction` of the sequence and
               the queries at random slots after the last pair.
Keys are queried at most once per document (a second query could copy from the first, closer
one), in random order.

Id ranges are half-open (lo, hi). Pick ranges that do not overlap; for a pipeline mix, a
reserved range (e.g. the last ids of the vocabulary, or ids beyond the tokenizer's) keeps the
task from colliding with text.

Everything is deterministic in (spec, seed) and torch-only (no tokenizer, no Prefect):
    doc = mqar_document(spec, seed)                   # one document, with its positions
    batch = mqar_batch(spec, batch_size, seed)        # {"input_ids", "labels"} [B, T]
    acc = mqar_accuracy(model, spec, n_docs, seed)    # greedy accuracy on the answer positions
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

IGNORE = -100
Layout = Literal["pairs_first", "spread"]


@dataclass(frozen=True)
class MQARSpec:
    seq_len: int
    n_pairs: int
    key_ids: tuple[int, int]
    value_ids: tuple[int, int]
    filler_ids: tuple[int, int] | None = None     # None: every filler position is filler_id
    filler_id: int = 0
    n_queries: int | None = None                  # None = n_pairs (every key asked once)
    layout: Layout = "pairs_first"
    pair_fraction: float = 0.5                    # spread: pairs live in this leading share
    min_gap: int = 0                              # queries start at least this far after the pairs

    def __post_init__(self):
        for name in ("key_ids", "value_ids") + (("filler_ids",) if self.filler_ids is not None else ()):
            lo, hi = getattr(self, name)
            if not 0 <= lo < hi:
                raise ValueError(f"{name} must be a half-open range lo < hi with lo >= 0, got {(lo, hi)}")
        ranges = [("key_ids", self.key_ids), ("value_ids", self.value_ids)]
        if self.filler_ids is not None:
            ranges.append(("filler_ids", self.filler_ids))
        for i, (a, ra) in enumerate(ranges):
            for b, rb in ranges[i + 1:]:
                if ra[0] < rb[1] and rb[0] < ra[1]:
                    raise ValueError(f"{a} {ra} and {b} {rb} overlap")
        if self.filler_ids is None and any(lo <= self.filler_id < hi for _, (lo, hi) in ranges):
            raise ValueError(f"filler_id {self.filler_id} lies in a key or value range")
        if self.n_pairs < 1:
            raise ValueError(f"n_pairs must be >= 1, got {self.n_pairs}")
        if self.n_pairs > self.key_ids[1] - self.key_ids[0]:
            raise ValueError(f"n_pairs={self.n_pairs} needs that many distinct keys; key_ids has "
                             f"{self.key_ids[1] - self.key_ids[0]}")
        if not 1 <= self.queries <= self.n_pairs:
            raise ValueError(f"n_queries must be in [1, n_pairs={self.n_pairs}], got {self.n_queries}")
        if self.layout not in ("pairs_first", "spread"):
            raise ValueError(f"layout must be 'pairs_first' or 'spread', got {self.layout!r}")
        if not 0 < self.pair_fraction < 1:
            raise ValueError(f"pair_fraction must be in (0, 1), got {self.pair_fraction}")
        # pairs region (2N tokens at least) + gap + 2 tokens per query
        need = 2 * self.n_pairs + self.min_gap + 2 * self.queries
        if self.seq_len < need:
            raise ValueError(f"seq_len={self.seq_len} is too short for {self.n_pairs} pairs and "
                             f"{self.queries} queries (needs >= {need})")
        if self.layout == "spread" and int(self.pair_fraction * self.seq_len) < 2 * self.n_pairs:
            raise ValueError(f"spread: the first {self.pair_fraction} of {self.seq_len} tokens cannot "
                             f"hold {self.n_pairs} pairs")

    @property
    def queries(self) -> int:
        return self.n_pairs if self.n_queries is None else self.n_queries


@dataclass
class MQARDocument:
    input_ids: list[int]
    labels: list[int]                # IGNORE except at query positions (= the value)
    key_pos: list[int] = field(default_factory=list)     # per query: position of the key's pair
    query_pos: list[int] = field(default_factory=list)   # per query: position of the asked key

    @property
    def distances(self) -> list[int]:
        """Per query: query position - key position (what a sliding window must reach)."""
        return [q - k for q, k in zip(self.query_pos, self.key_pos)]


def _slots(rng: random.Random, lo: int, hi: int, n: int) -> list[int]:
    """n non-overlapping 2-token slots (start positions, ascending) inside [lo, hi)."""
    free = (hi - lo) - 2 * n                      # spare tokens to spread between the slots
    if free < 0:
        raise ValueError(f"cannot fit {n} pairs in [{lo}, {hi})")
    # stars and bars: choose where the n slots go among n + free items
    cuts = sorted(rng.sample(range(n + free), n))
    return [lo + c + i for i, c in enumerate(cuts)]     # slot i starts after c - i spare tokens + i slots


def mqar_document(spec: MQARSpec, seed: int | str, filler: Sequence[int] | None = None) -> MQARDocument:
    """One MQAR document, deterministic in (spec, seed).

    filler: token ids (e.g. a packed sequence of real text, at least seq_len long) to use, in
    order, at the positions the pairs and queries leave free, instead of spec's filler; the
    text then stays contiguous between the planted tokens, so an LM loss on the whole document
    still trains language modelling there (for mixing MQAR into pretraining data). Its ids
    must avoid the key and value ranges, or a filler token could pose as a key."""
    rng = random.Random(f"mqar/{seed}")
    T, N, Q = spec.seq_len, spec.n_pairs, spec.queries
    if filler is not None:
        if len(filler) < T:
            raise ValueError(f"filler has {len(filler)} tokens, need seq_len={T}")
        bad = [t for t in filler[:T] if spec.key_ids[0] <= t < spec.key_ids[1] or spec.value_ids[0] <= t < spec.value_ids[1]]
        if bad:
            raise ValueError(f"filler contains key/value ids {sorted(set(bad))[:5]}: reserve those ids for MQAR")
        ids = [-1] * T
    elif spec.filler_ids is None:
        ids = [spec.filler_id] * T
    else:
        lo, hi = spec.filler_ids
        fill_rng = random.Random(f"mqar-filler/{seed}")   # own stream: the layout does not depend on the filler
        ids = [fill_rng.randrange(lo, hi) for _ in range(T)]
    labels = [IGNORE] * T
    keys = rng.sample(range(*spec.key_ids), N)
    values = [rng.randrange(*spec.value_ids) for _ in range(N)]
    if spec.layout == "pairs_first":
        pair_pos = [2 * i for i in range(N)]
        q_lo = 2 * N + spec.min_gap
    else:
        pair_pos = _slots(rng, 0, int(spec.pair_fraction * T), N)
        q_lo = pair_pos[-1] + 2 + spec.min_gap
    if T - q_lo < 2 * Q:
        raise ValueError(f"seq_len={T}: no room for {Q} queries after position {q_lo}")
    query_pos = _slots(rng, q_lo, T, Q)
    for p, k, v in zip(pair_pos, keys, values):
        ids[p], ids[p + 1] = k, v
    asked = rng.sample(range(N), Q)
    for p, j in zip(query_pos, asked):
        ids[p], ids[p + 1] = keys[j], values[j]
        labels[p] = values[j]
    if filler is not None:
        it = iter(filler)
        ids = [next(it) if t < 0 else t for t in ids]
    return MQARDocument(ids, labels, [pair_pos[j] for j in asked], list(query_pos))


def mqar_batch(spec: MQARSpec, batch_size: int, seed: int | str) -> dict[str, torch.Tensor]:
    """{"input_ids", "labels"} [B, T] long: documents seeded f"{seed}/{i}" (i < batch_size)."""
    docs = [mqar_document(spec, f"{seed}/{i}") for i in range(batch_size)]
    return {"input_ids": torch.tensor([d.input_ids for d in docs]),
            "labels": torch.tensor([d.labels for d in docs])}


def mqar_samples(spec: MQARSpec, n: int, seed: int | str) -> list[tuple[list[int], list[int]]]:
    """n documents as (token ids, loss mask) for data_processing.packing.pack_samples: the mask
    is 1 on the tokens that are training targets (each query's value), i.e. at position t + 1
    where labels[t] is set (collate shifts it back)."""
    out = []
    for i in range(n):
        d = mqar_document(spec, f"{seed}/{i}")
        mask = [0] * spec.seq_len
        for q in d.query_pos:
            mask[q + 1] = 1
        out.append((d.input_ids, mask))
    return out


# ---------------------------------------------------------------- scoring
def score_logits(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(correct, total) of greedy predictions at the labelled positions: argmax over the whole
    vocabulary must equal the label. logits [B,T,V], labels [B,T] (-100 = not scored)."""
    mask = labels != IGNORE
    pred = logits.argmax(-1)
    return int((pred[mask] == labels[mask]).sum()), int(mask.sum())


@torch.no_grad()
def mqar_accuracy(model: torch.nn.Module, spec: MQARSpec, n_docs: int, seed: int | str,
                  batch_size: int = 8, windows: Sequence[int] = ()) -> dict[str, float]:
    """Greedy accuracy of `model` (GLMModel or any callable returning .logits) on n_docs
    documents: {"acc", "n"} plus, per window W in `windows`, the accuracy over queries whose key
    lies within W tokens ("acc_within_W") and beyond ("acc_beyond_W"), with their counts.
    All queries of a document are scored in one teacher-forced forward."""
    was_training = model.training
    model.eval()
    hits: list[tuple[bool, int]] = []
    try:
        for s in range(0, n_docs, batch_size):
            docs = [mqar_document(spec, f"{seed}/{i}") for i in range(s, min(n_docs, s + batch_size))]
            ids = torch.tensor([d.input_ids for d in docs])
            pred = model(ids).logits.argmax(-1)
            for b, d in enumerate(docs):
                for q, dist in zip(d.query_pos, d.distances):
                    hits.append((int(pred[b, q]) == d.labels[q], dist))
    finally:
        model.train(was_training)
    return summarize(hits, windows)


def summarize(hits: Sequence[tuple[bool, int]], windows: Sequence[int] = ()) -> dict[str, float]:
    """[(correct, distance)] -> {"acc", "n", "acc_within_W", "n_within_W", "acc_beyond_W", ...}.
    A query is within W when distance < W (a window of W tokens ending at the query, itself
    included, holds the key). Accuracy over an empty set is NaN."""
    def acc(sel):
        return sum(c for c, _ in sel) / len(sel) if sel else float("nan")

    out: dict[str, float] = {"acc": acc(hits), "n": len(hits)}
    for w in windows:
        within = [h for h in hits if h[1] < w]
        beyond = [h for h in hits if h[1] >= w]
        out[f"acc_within_{w}"], out[f"n_within_{w}"] = acc(within), len(within)
        out[f"acc_beyond_{w}"], out[f"n_beyond_{w}"] = acc(beyond), len(beyond)
    return out


# ---------------------------------------------------------------- copy warm-up
def copy_batch(seq_len: int, batch_size: int, token_ids: tuple[int, int], seed: int | str
               ) -> dict[str, torch.Tensor]:
    """Induction warm-up documents: a random run of n tokens from token_ids, a gap of g random
    tokens, the same run again, then random tokens to seq_len; n and g are drawn per document
    (n in [seq_len // 8, seq_len // 3], g in [0, seq_len - 2n]), so the repeat sits at no fixed
    offset and a positional shortcut (attend n back) does not solve it. Labels (shifted) are set
    where the next token can be copied: positions n + g .. n + g + n - 2. The circuit this
    teaches (find the current token earlier, copy what followed it) is the one MQAR needs."""
    lo, hi = token_ids
    if not 0 <= lo < hi:
        raise ValueError(f"token_ids must be a half-open range lo < hi, got {token_ids}")
    if seq_len < 16:
        raise ValueError(f"seq_len must be >= 16, got {seq_len}")
    g = torch.Generator().manual_seed(zlib_seed(f"copy/{seed}"))
    ids = torch.randint(lo, hi, (batch_size, seq_len), generator=g)
    labels = torch.full_like(ids, IGNORE)
    for b in range(batch_size):
        n = int(torch.randint(seq_len // 8, seq_len // 3 + 1, (1,), generator=g))
        gap = int(torch.randint(0, seq_len - 2 * n + 1, (1,), generator=g))
        s = n + gap
        ids[b, s: s + n] = ids[b, :n]
        labels[b, s: s + n - 1] = ids[b, s + 1: s + n]
    return {"input_ids": ids, "labels": labels}


def zlib_seed(s: str) -> int:
    """A stable 32-bit seed from a string (Python's hash() is salted per process)."""
    import zlib

    return zlib.crc32(s.encode())


# ---------------------------------------------------------------- fact recall (knowledge in weights)
def fact_table(n_first: int, n_second: int, value_ids: tuple[int, int], seed: int | str) -> torch.Tensor:
    """A fixed random map (a, b) -> value id, [n_first, n_second], the same for every document."""
    g = torch.Generator().manual_seed(zlib_seed(f"facts/{seed}"))
    return torch.randint(value_ids[0], value_ids[1], (n_first, n_second), generator=g)


def fact_batch(seq_len: int, batch_size: int, first_ids: int, second_ids: int, table: torch.Tensor,
               seed: int | str) -> dict[str, torch.Tensor]:
    """Documents of seq_len // 3 facts "a b table[a, b]": a from ids first_ids .. first_ids +
    n_first - 1, b from second_ids .. second_ids + n_second - 1 (table's shape), random per fact.
    The value never appears in the context first, so predicting it needs the table stored in
    the weights, and a two-token key makes the attention and MLP layers compute the lookup
    (one-token keys are memorised by the embedding and head alone). This is the task where
    weight precision matters, unlike MQAR, whose answer is in the context.
    labels[t] (shifted) = the value at every b position; the rest -100 (pads to seq_len)."""
    na, nb = table.shape
    g = torch.Generator().manual_seed(zlib_seed(f"fact-doc/{seed}"))
    n = seq_len // 3
    a = torch.randint(0, na, (batch_size, n), generator=g)
    b = torch.randint(0, nb, (batch_size, n), generator=g)
    v = table[a, b]
    ids = torch.stack([a + first_ids, b + second_ids, v], -1).reshape(batch_size, -1)
    labels = torch.full_like(ids, IGNORE)
    labels[:, 1::3] = v
    pad = seq_len - 3 * n
    if pad:
        ids = torch.cat([ids, ids[:, :pad]], 1)
        labels = torch.cat([labels, torch.full_like(ids[:, :pad], IGNORE)], 1)
    return {"input_ids": ids, "labels": labels}
