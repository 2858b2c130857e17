"""Fuzzy deduplication with MinHash + LSH, vectorised in NumPy.

Defaults: 5-gram word shingles and 14 bands x 8 rows = 112 permutations, datatrove's setting
(anchors.md). With b=14, r=8 the LSH S-curve 1-(1-s^8)^14 is 0.50 at Jaccard ~0.72, 0.92 at
0.8 and 0.99 at 0.85: near-duplicates at Jaccard >= 0.8 (NeMo/OLMo's target) are caught >90%
of the time while 112 hashes cost less than NeMo's 260 or OLMo's 286. `verify_threshold`
then rejects candidate pairs whose estimated Jaccard (share of equal signature slots) is lower,
so bucket collisions between merely similar documents do not merge clusters.

Fast path (backend "numpy"), per document:
  1. lowercase; words = runs of letters/digits/non-ASCII bytes, found on the UTF-8 bytes with
     NumPy (no Python loop per word). Punctuation separates words and is dropped.
  2. each word gets a 64-bit polynomial hash computed from prefix sums (wrapping uint64
     arithmetic; the base is odd so it has an inverse mod 2^64);
  3. shingle hash = polynomial combination of n consecutive word hashes, then splitmix64 mixing;
  4. permutation i: h_i(x) = (a_i * x + b_i) mod 2^64 >> 32 (multiply-shift, a_i odd); the
     signature keeps the minimum per permutation -> uint32[num_perm].
reference_signatures does exactly this one document at a time; text_signatures computes the same
numbers (tested bit for bit) for ~1 MB of text per batch (batch_signatures): one byte scan and
prefix sum over the joined texts, n-grams over the batch's word hashes gathered per document,
no np.unique (a repeated shingle does not change a minimum), and the (num_perm x shingles) hash
matrix in blocks whose minima per document come from one np.minimum.reduceat. Profiled on 3,000
bench documents, the per-document loop spent ~40% in the hash matrix, ~10% in np.unique, ~35%
hashing words and the rest in per-call NumPy overhead; batched it takes ~3x fewer CPU-seconds,
about half in the hash matrix (~0.9 ns per hash) and most of the rest hashing words.
Backend "datasketch" builds datasketch MinHash objects from the same shingles (slower, for
cross-checking), and can use datasketch's MinHashLSH with Redis storage.

Clusters: union-find over all LSH candidate pairs. Kept per cluster: the document with the
highest quality score (metadata["quality"]["score"], 0 when absent), ties -> the lowest id.
"""
from __future__ import annotations

import json
import os
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import pyarrow.parquet as pq
from pydantic import Field, model_validator

from data_processing.common import DaskConfig, StepConfig
from data_processing.document import quality_score, read_ids_and_metadata, shard_paths
from data_processing.filtering import Verdict, write_shard_decisions
from runtime.stage import OPERATIONAL, Workdir

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_WORD_BASE = np.uint64(0x100000001B3)  # FNV prime: odd, so invertible mod 2^64
_SHINGLE_BASE = np.uint64(0x9E3779B97F4A7C15)


class MinHashConfig(StepConfig):
    shingle: Literal["word", "char"] = Field("word", description="shingles of words or of characters")
    ngram: int = Field(default=5, ge=1, description="words (or characters) per shingle")
    # datatrove maps every number to "0" before shingling; off by default because documents
    # that differ only in their numbers (GSM8K problems from one template, version tables) are
    # different data, not duplicates
    norm_numbers: bool = Field(False, description=(
        "map every number to \"0\" before shingling (datatrove's choice); off: documents differing only in "
        "their numbers are not duplicates"))
    bands: int = Field(default=14, ge=1, description="LSH bands; bands x rows = the permutations in a signature")
    rows: int = Field(default=8, ge=1, description=(
        "signature rows per LSH band: two documents are candidates when all rows of one band agree"))
    verify_threshold: float | None = Field(default=0.7, ge=0.0, le=1.0, description=(
        "drop candidate pairs whose estimated Jaccard (share of equal signature slots) is below this; null: "
        "keep every LSH candidate"))
    backend: Literal["numpy", "datasketch"] = Field("numpy", description=(
        "numpy: the vectorised signatures; datasketch: datasketch MinHash objects (slower, for "
        "cross-checking; needed for lsh_storage redis)"))
    lsh_storage: Literal["memory", "redis"] = Field("memory", description=(
        "where the LSH index lives: in memory, or Redis (datasketch's MinHashLSH, backend datasketch)"))
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="the Redis server of lsh_storage redis")
    seed: int = Field(1, description="seed of the hash permutations")
    # processes computing signatures; same output whatever the count, so not in the key
    workers: int = Field(default=1, ge=1, json_schema_extra=OPERATIONAL, description=(
        "processes computing signatures (same output whatever the count; operational, not in the key)"))
    shard_size: int = Field(default=10_000, ge=1, description="documents per output Parquet shard")
    # set: the stage runs sharded on Dask when it runs as a Prefect task (same output, not in the key)
    dask: DaskConfig | None = Field(default=None, json_schema_extra=OPERATIONAL, description=(
        "set: the stage runs sharded on Dask when it runs as a Prefect task (backend numpy; same output, "
        "not in the key)"))

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows

    @model_validator(mode="after")
    def _check(self) -> "MinHashConfig":
        if self.lsh_storage == "redis" and self.backend != "datasketch":
            raise ValueError("lsh_storage: redis is datasketch's MinHashLSH; set backend: datasketch")
        if self.dask is not None and self.backend != "numpy":
            raise ValueError("dask: the distributed path buckets signatures itself; it needs backend: numpy")
        if self.backend == "datasketch" and self.shingle == "char" and self.ngram > 64:
            raise ValueError("ngram: char shingles longer than 64 are not useful")
        return self


# ---------------------------------------------------------------------------------------------
# Hashing
def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: spreads polynomial hashes over all 64 bits."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _powers(base: np.uint64, n: int) -> np.ndarray:
    """base^i mod 2^64 for i < n, by doubling (a vectorised multiply per step, not a cumprod
    chain: the batched path needs millions)."""
    p = np.ones(max(n, 1), dtype=np.uint64)
    k = 1
    while k < n:
        m = min(k, n - k)
        np.multiply(p[:m], p[k - 1 : k] * base, out=p[k : k + m])  # base^k, no scalar overflow warning
        k += m
    return p[:n]


_INV_BASE = np.uint64(pow(int(_WORD_BASE), -1, 2**64))
_POW_CACHE: dict[str, np.ndarray] = {"p": _powers(_WORD_BASE, 1 << 16), "q": _powers(_INV_BASE, 1 << 16)}


def _pows(n: int) -> tuple[np.ndarray, np.ndarray]:
    if len(_POW_CACHE["p"]) < n:
        size = 1 << (n - 1).bit_length()
        _POW_CACHE["p"], _POW_CACHE["q"] = _powers(_WORD_BASE, size), _powers(_INV_BASE, size)
    return _POW_CACHE["p"][:n], _POW_CACHE["q"][:n]


def _word_hashes(text: str) -> np.ndarray:
    """64-bit hash of every word of lowercased text, without a Python loop over words."""
    b = np.frombuffer(text.lower().encode("utf-8"), dtype=np.uint8)
    if b.size == 0:
        return np.empty(0, dtype=np.uint64)
    word = (b >= 128) | ((b >= 48) & (b <= 57)) | ((b >= 97) & (b <= 122)) | (b == 95)
    edges = np.diff(word.astype(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    if starts.size == 0:
        return np.empty(0, dtype=np.uint64)
    p, q = _pows(b.size)
    # S[i] = sum_{j<i} b[j] * q^j ; hash(s,e) = (S[e]-S[s]) * p^(e-1) = sum b[j] p^(e-1-j)
    s = np.zeros(b.size + 1, dtype=np.uint64)
    np.cumsum(b.astype(np.uint64) * q, dtype=np.uint64, out=s[1:])
    return (s[ends] - s[starts]) * p[ends - 1]


def _char_hashes(text: str) -> np.ndarray:
    """Code points of the whitespace-normalised, lowercased text (one 'word' per character)."""
    t = " ".join(text.lower().split())
    return np.frombuffer(t.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64) * _WORD_BASE


_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def shingle_hashes(text: str, shingle: str = "word", ngram: int = 5, norm_numbers: bool = False) -> np.ndarray:
    """Unique 64-bit hashes of the document's n-gram shingles. A document shorter than n units
    is one shingle of all its units (so short documents still dedup against each other)."""
    if norm_numbers:
        text = _NUMBER.sub("0", text)
    units = _word_hashes(text) if shingle == "word" else _char_hashes(text)
    if units.size == 0:
        return units
    n = min(ngram, units.size)
    m = units.size - n + 1
    acc = units[:m].copy()
    for k in range(1, n):
        acc = acc * _SHINGLE_BASE + units[k : k + m]
    return np.unique(_mix64(acc))


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
    return a, b


_EMPTY = np.uint32(0xFFFFFFFF)


def signature(hashes: np.ndarray, a: np.ndarray, b: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """MinHash signature (uint32[num_perm]) of a set of 64-bit shingle hashes."""
    if hashes.size == 0:
        return np.full(a.size, _EMPTY, dtype=np.uint32)
    out = np.full(a.size, np.iinfo(np.uint64).max, dtype=np.uint64)
    for i in range(0, hashes.size, chunk):  # bounded memory for very long documents
        h = hashes[i : i + chunk, None] * a[None, :] + b[None, :]
        np.minimum(out, h.min(axis=0), out=out)
    return (out >> np.uint64(32)).astype(np.uint32)


def text_signatures(texts: Sequence[str], cfg: MinHashConfig) -> np.ndarray:
    """Signatures of many texts: uint32[len(texts), num_perm]."""
    if cfg.backend == "datasketch":
        return _datasketch_signatures(texts, cfg)
    return batch_signatures(texts, cfg)


def reference_signatures(texts: Sequence[str], cfg: MinHashConfig) -> np.ndarray:
    """The numpy backend's signatures one document at a time (shingle_hashes + signature): the
    plain statement of what batch_signatures computes, kept for tests and cross-checks."""
    a, b = permutations(cfg.num_perm, cfg.seed)
    out = np.empty((len(texts), cfg.num_perm), dtype=np.uint32)
    for i, t in enumerate(texts):
        out[i] = signature(shingle_hashes(t, cfg.shingle, cfg.ngram, cfg.norm_numbers), a, b)
    return out


# Batched fast path: the same numbers as reference_signatures, for many documents per NumPy call.
_WORD_BYTE = np.zeros(256, dtype=bool)  # the bytes _word_hashes counts as word characters
_WORD_BYTE[48:58] = _WORD_BYTE[97:123] = _WORD_BYTE[95] = _WORD_BYTE[128:] = True
_BATCH_BYTES = 1 << 20  # text characters per batch (work arrays of ~8 MB each)
# shingles per (num_perm x _BLOCK) hash block: 7 MB at 112 permutations, measured fastest (2-core EPYC, busy)
_BLOCK = 8192


def _batch_word_units(texts: Sequence[str], norm_numbers: bool) -> tuple[np.ndarray, np.ndarray]:
    """_word_hashes of every text, concatenated, and the number per text. The texts are joined
    with (and preceded by) "\\n", which is no word byte, so no word crosses two documents; a
    word's polynomial hash does not depend on where it sits (prefix sums times inverse powers)."""
    enc = [(_NUMBER.sub("0", t) if norm_numbers else t).lower().encode("utf-8") for t in texts]
    b = np.frombuffer(b"\n".join([b""] + enc), dtype=np.uint8)
    doc_ends = np.cumsum([len(e) + 1 for e in enc], dtype=np.int64)  # one past each text's last byte
    word = np.zeros(b.size + 2, dtype=bool)
    # _WORD_BYTE[b], by comparisons: twice as fast as the lookup (which widens b to intp)
    word[1:-1] = (b >= 128) | ((b >= 48) & (b <= 57)) | ((b >= 97) & (b <= 122)) | (b == 95)
    edges = np.flatnonzero(word[1:] != word[:-1])  # word starts and ends alternate
    counts = np.diff(np.searchsorted(edges[0::2], doc_ends), prepend=0)
    p, q = _pows(b.size)
    c = np.multiply(b, q, dtype=np.uint64)
    np.cumsum(c, out=c)  # c[i] = sum_{j<=i} b[j] q^j; every edge is >= 1 (the leading separator)
    # hash(word [s, e)) = (c[e-1] - c[s-1]) * p^(e-1) = sum_j b[j] p^(e-1-j)
    edges -= 1
    g = c[edges]
    return (g[1::2] - g[0::2]) * p[edges[1::2]], counts


def _batch_shingles(units: np.ndarray, counts: np.ndarray, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """What shingle_hashes computes for each document, before np.unique (a repeated shingle does
    not change a minimum), concatenated, and the number per document."""
    per_doc = np.where(counts >= ngram, counts - ngram + 1, np.minimum(counts, 1))
    total = int(per_doc.sum())
    if total == 0:
        return np.empty(0, dtype=np.uint64), per_doc
    first_unit = np.cumsum(counts) - counts
    m = units.size - ngram + 1
    acc = np.empty(0, dtype=np.uint64)
    if m > 0:  # n-grams over the whole batch; those that cross documents are not gathered
        acc = units[:m].copy()
        for k in range(1, ngram):
            acc *= _SHINGLE_BASE
            acc += units[k : k + m]
    first_out = np.cumsum(per_doc) - per_doc
    idx = np.arange(total, dtype=np.int64) + np.repeat(first_unit - first_out, per_doc)
    short = np.flatnonzero((counts > 0) & (counts < ngram))
    if short.size:  # documents with fewer units than ngram: one shingle of all their units
        idx[first_out[short]] = 0
        out = acc[idx] if acc.size else np.zeros(total, dtype=np.uint64)
        for d in short:
            u = units[first_unit[d] : first_unit[d] + counts[d]]
            v = u[:1].copy()
            for k in range(1, u.size):
                v *= _SHINGLE_BASE
                v += u[k]
            out[first_out[d]] = v[0]
    else:
        out = acc[idx]
    return _mix64(out), per_doc


def _min_hashes(sh: np.ndarray, per_doc: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per document and permutation, min over its shingles x of a*x + b (mod 2^64), computed
    over (num_perm x _BLOCK) blocks of the concatenated shingles: uint64[num_perm, docs]."""
    out = np.full((a.size, per_doc.size), np.iinfo(np.uint64).max, dtype=np.uint64)
    nz = np.flatnonzero(per_doc)
    offs = (np.cumsum(per_doc) - per_doc)[nz]  # strictly increasing: the non-empty documents' starts
    buf = np.empty((a.size, _BLOCK), dtype=np.uint64)
    ac, bc = a[:, None], b[:, None]
    for i in range(0, sh.size, _BLOCK):
        x = sh[i : i + _BLOCK]
        h = buf[:, : x.size]
        np.multiply(ac, x[None, :], out=h)
        h += bc
        j0 = int(np.searchsorted(offs, i, side="right")) - 1  # the document that holds shingle i
        j1 = int(np.searchsorted(offs, i + x.size, side="left"))
        seg = offs[j0:j1] - i
        seg[0] = 0
        cols = nz[j0:j1]
        out[:, cols] = np.minimum(out[:, cols], np.minimum.reduceat(h, seg, axis=1))
    return out


def batch_signatures(texts: Sequence[str], cfg: MinHashConfig) -> np.ndarray:
    """Signatures of many texts (uint32[len(texts), num_perm]), equal to reference_signatures:
    texts are hashed in batches of ~_BATCH_BYTES, so there is no Python step per word and a few
    NumPy calls per batch rather than per document."""
    a, b = permutations(cfg.num_perm, cfg.seed)
    out = np.empty((len(texts), cfg.num_perm), dtype=np.uint32)
    i = 0
    while i < len(texts):
        j, size = i, 0
        while j < len(texts) and (j == i or size + len(texts[j]) <= _BATCH_BYTES):
            size += len(texts[j])
            j += 1
        batch = texts[i:j]
        if cfg.shingle == "word":
            units, counts = _batch_word_units(batch, cfg.norm_numbers)
        else:
            per = [_char_hashes(_NUMBER.sub("0", t) if cfg.norm_numbers else t) for t in batch]
            units = np.concatenate(per) if per else np.empty(0, dtype=np.uint64)
            counts = np.array([u.size for u in per], dtype=np.int64)
        sh, per_doc = _batch_shingles(units, counts, cfg.ngram)
        out[i:j] = (_min_hashes(sh, per_doc, a, b) >> np.uint64(32)).T
        i = j
    return out


def _datasketch_signatures(texts: Sequence[str], cfg: MinHashConfig) -> np.ndarray:
    from datasketch import MinHash

    sets = [[int(h).to_bytes(8, "little") for h in shingle_hashes(t, cfg.shingle, cfg.ngram, cfg.norm_numbers)] for t in texts]
    out = np.empty((len(texts), cfg.num_perm), dtype=np.uint32)
    for i, m in enumerate(MinHash.bulk(sets, num_perm=cfg.num_perm, seed=cfg.seed)):
        out[i] = m.hashvalues.astype(np.uint32)  # datasketch hash values are < 2^32
        if not sets[i]:
            out[i] = _EMPTY
    return out


def minhash_signatures(shard_path: Path | str, cfg: MinHashConfig) -> np.ndarray:
    """Signatures of every document of one shard (row order). Standalone and picklable, so it
    runs in a process pool or as one Prefect task per shard."""
    names = pq.ParquetFile(shard_path).schema_arrow.names
    if "text" not in names:
        raise ValueError(f"{shard_path}: not a document shard, missing column(s) ['text']")
    # ParquetFile, not pq.read_table: that one imports pyarrow.dataset and with it pandas (0.3 s)
    texts = pq.ParquetFile(shard_path).read(columns=["text"], use_threads=False).column("text").to_pylist()
    for row, t in enumerate(texts):
        if not isinstance(t, str):
            raise ValueError(f"{shard_path}: row {row}: field 'text' must be a string, got {type(t).__name__}")
    return text_signatures(texts, cfg)


# ---------------------------------------------------------------------------------------------
# LSH and clustering
class UnionFind:
    def __init__(self, n: int):
        self.parent = np.arange(n)

    def find(self, x: int) -> int:
        p = self.parent
        root = x
        while p[root] != root:
            root = p[root]
        while p[x] != root:  # path compression
            p[x], x = root, p[x]
        return int(root)

    def union(self, x: int, y: int) -> bool:
        rx, ry = self.find(x), self.find(y)
        if rx == ry:
            return False
        self.parent[max(rx, ry)] = min(rx, ry)
        return True


def band_weights(bands: int, rows: int) -> list[np.ndarray]:
    """Per-band multipliers that fold a band's `rows` hashes into one bucket key (fixed seed:
    every shard of a distributed run must bucket the same way)."""
    rng = np.random.default_rng(0x5EED)
    return [rng.integers(1, 2**63, size=rows, dtype=np.uint64) | np.uint64(1) for _ in range(bands)]


def band_keys(sigs: np.ndarray, band: int, rows: int, weights: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Bucket key of every signature for one band; `index` (global row numbers) makes empty
    documents' keys unique, so they match nothing."""
    block = sigs[:, band * rows : (band + 1) * rows].astype(np.uint64)
    key = _mix64((block * weights[None, :]).sum(axis=1, dtype=np.uint64) + np.uint64(band))
    empty = (sigs == _EMPTY).all(axis=1)
    key[empty] = index[empty].astype(np.uint64) ^ _MASK64
    return key


def bucket_pairs(key: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Pairs (first member, other member) of every bucket of equal keys; `index` must be
    ascending so the first member is the lowest row number: int64[k, 2]."""
    n = key.size
    order = np.argsort(key, kind="stable")
    k = key[order]
    same = np.flatnonzero(k[1:] == k[:-1]) + 1  # positions equal to their predecessor
    if same.size == 0:
        return np.empty((0, 2), dtype=np.int64)
    run_start = np.ones(n, dtype=bool)
    run_start[same] = False
    first = np.maximum.accumulate(np.where(run_start, np.arange(n), 0))  # first member of each run
    return np.stack([index[order[first[same]]], index[order[same]]], axis=1).astype(np.int64)


def lsh_candidate_pairs(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """Pairs (i, j), i < j, that share at least one band: int64[k, 2]. Within a bucket each
    member is paired with the bucket's first member (enough for union-find; k stays ~n)."""
    index = np.arange(sigs.shape[0], dtype=np.int64)
    pairs = [bucket_pairs(band_keys(sigs, b, rows, w, index), index) for b, w in enumerate(band_weights(bands, rows))]
    pairs = [p for p in pairs if len(p)]
    if not pairs:
        return np.empty((0, 2), dtype=np.int64)
    p = np.sort(np.concatenate(pairs), axis=1)
    # np.unique(p, axis=0) by one int64 key per pair (i * n + j, n^2 < 2^63): the same rows in
    # the same order, without np.unique's import of numpy.ma (0.03 s)
    n = np.int64(sigs.shape[0])
    key = np.sort(p[:, 0] * n + p[:, 1])
    key = key[np.concatenate(([True], key[1:] != key[:-1]))]
    return np.stack([key // n, key % n], axis=1)


def _datasketch_pairs(sigs: np.ndarray, cfg: MinHashConfig) -> np.ndarray:
    """Candidate pairs through datasketch's MinHashLSH (memory or Redis storage)."""
    from urllib.parse import urlparse

    from datasketch import LeanMinHash, MinHashLSH

    storage = {"type": "dict"}
    if cfg.lsh_storage == "redis":
        u = urlparse(cfg.redis_url)
        storage = {
            "type": "redis",
            "basename": f"glmforge-minhash-{os.getpid()}".encode(),
            "redis": {"host": u.hostname or "127.0.0.1", "port": u.port or 6379, "db": int((u.path or "/0")[1:] or 0)},
        }
    lsh = MinHashLSH(num_perm=cfg.num_perm, params=(cfg.bands, cfg.rows), storage_config=storage)
    pairs = set()
    for i, s in enumerate(sigs):
        if (s == _EMPTY).all():
            continue
        m = LeanMinHash(seed=cfg.seed, hashvalues=s, scheme="affine32")
        for j in lsh.query(m):
            pairs.add((min(i, j), max(i, j)))
        lsh.insert(i, m, check_duplication=False)
    if cfg.lsh_storage == "redis":  # leave no keys behind in a shared server
        import redis

        client = redis.Redis.from_url(cfg.redis_url)
        for key in list(client.scan_iter(match=storage["basename"] + b"*")):
            client.delete(key)
    return np.array(sorted(pairs), dtype=np.int64).reshape(-1, 2)


def estimated_jaccard(sigs: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    return (sigs[pairs[:, 0]] == sigs[pairs[:, 1]]).mean(axis=1)


def cluster(sigs: np.ndarray, cfg: MinHashConfig) -> tuple[np.ndarray, dict]:
    """Cluster root (a row index) of every document, and stats."""
    if cfg.backend == "datasketch":
        pairs = _datasketch_pairs(sigs, cfg)
    else:
        pairs = lsh_candidate_pairs(sigs, cfg.bands, cfg.rows)
    candidates = len(pairs)
    if cfg.verify_threshold is not None and len(pairs):
        pairs = pairs[estimated_jaccard(sigs, pairs) >= cfg.verify_threshold]
    uf = UnionFind(sigs.shape[0])
    for i, j in pairs:
        uf.union(int(i), int(j))
    roots = np.array([uf.find(i) for i in range(sigs.shape[0])], dtype=np.int64)
    return roots, {"candidate_pairs": candidates, "verified_pairs": int(len(pairs))}


def choose_kept(roots: np.ndarray, ids: Sequence[str], scores: Sequence[float]) -> np.ndarray:
    """Boolean keep mask: per cluster the highest score, ties -> the lowest id."""
    best: dict[int, int] = {}
    for i, r in enumerate(roots):
        r = int(r)
        j = best.get(r)
        if j is None or (-scores[i], ids[i]) < (-scores[j], ids[j]):
            best[r] = i
    keep = np.zeros(len(roots), dtype=bool)
    keep[list(best.values())] = True
    return keep


def verdicts(roots: np.ndarray, keep: np.ndarray, ids: Sequence[str]) -> list[Verdict]:
    """Each document's decision: kept, or dropped as a near-duplicate of its cluster's kept one."""
    kept_of_root = {int(roots[i]): ids[i] for i in np.flatnonzero(keep)}
    return [True if keep[i] else (False, f"near_duplicate_of:{kept_of_root[int(roots[i])]}") for i in range(len(ids))]


# ---------------------------------------------------------------------------------------------
def run(cfg: MinHashConfig, inputs: dict[str, Path], workdir: Workdir) -> dict:
    (parent,) = inputs.values()
    shards = shard_paths(parent)
    if not shards:
        raise ValueError(f"{parent}: no part-*.parquet shards found")
    # Signatures are checkpointed per shard (written atomically), so a retried run only
    # computes the shards the killed attempt did not finish.
    ckpt = workdir.checkpoint / "signatures"
    ckpt.mkdir(parents=True, exist_ok=True)
    todo = [s for s in shards if not (ckpt / f"{s.stem}.npy").exists()]
    done = len(shards) - len(todo)
    workdir.progress(done, len(shards), "minhash signatures")

    def save(shard: Path, sig: np.ndarray) -> None:
        nonlocal done
        tmp = ckpt / f"{shard.stem}.tmp.npy"
        np.save(tmp, sig)
        tmp.replace(ckpt / f"{shard.stem}.npy")
        done += 1
        workdir.progress(done, len(shards), "minhash signatures")

    if cfg.workers > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=cfg.workers) as pool:
            for shard, sig in zip(todo, pool.map(minhash_signatures, todo, [cfg] * len(todo))):
                save(shard, sig)
    else:
        for shard in todo:
            save(shard, minhash_signatures(shard, cfg))
    workdir.persist_checkpoint()
    parts = [np.load(ckpt / f"{s.stem}.npy") for s in shards]
    sigs = np.concatenate(parts) if parts else np.empty((0, cfg.num_perm), dtype=np.uint32)

    ids, metas = zip(*read_ids_and_metadata(parent)) if len(sigs) else ((), ())
    ids = list(ids)
    roots, stats = cluster(sigs, cfg)
    sizes = np.bincount(roots, minlength=len(roots))
    # quality scores break ties inside a duplicate cluster: decode the metadata of members only
    scores = [quality_score(json.loads(m or "{}")) if sizes[r] > 1 else 0.0 for m, r in zip(metas, roots)]
    keep = choose_kept(roots, ids, scores)

    counts = write_shard_decisions(shards, verdicts(roots, keep, ids), workdir.out, "dedup-minhash", cfg.shard_size)
    return {
        **counts.metrics(),
        "clusters": int((sizes > 1).sum()),
        "largest_cluster": int(sizes.max()) if len(ids) else 0,
        **stats,
        "num_perm": cfg.num_perm,
        "bands": cfg.bands,
        "rows": cfg.rows,
    }

