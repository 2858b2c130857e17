"""Exact and MinHash dedup split into shard-level steps, for a distributed engine to fan out.

Every function here is pure and picklable: it reads its input shard(s) or intermediate files
from a shared directory (`scratch`), writes its own output files there, and returns small
counts. No step holds more than one input shard, one band's bucket keys or the candidate-pair
graph (so no single process holds all signatures). The fan-out (Prefect tasks on Dask) lives in
tasks/dask_dedup.py; this module never imports Prefect or Dask.

The output equals the single-process steps (dedup_exact.run, minhash.run) for the same input
and config: same kept documents in the same order, same output shard boundaries, same removed/
shards and reasons, same metrics. The datatrove / NeMo-Curator shape:

Exact dedup (hash-partitioned shuffle):
  exact_partition(shard i)  -> keys/p{p}-s{i}: (text key, global row, id) for key-hash p
                               (exact_partition_shards: shards i..j in one file per p)
  exact_reduce(partition p) -> dups/s{i}-p{p}: (global row, id of the first occurrence)
  filter_shard(shard i)     -> pieces/{kept,removed}/s{i}
  assemble_shard(k)         -> out/part-k, out/removed/part-k (ShardWriter's boundaries)
MinHash dedup:
  minhash_shard(shard i)    -> sigs/s{i}.npy and buckets/b{b}-s{i}.npz (band key, global row)
  minhash_band(band b)      -> pairs/b{b}.npy: candidate pairs of that band's buckets
  minhash_split_pairs       -> vpairs/s{i}-in.npy: unique pairs grouped by first member's shard
  minhash_verify(shard i)   -> vpairs/s{i}.npy: pairs whose estimated Jaccard passes
  minhash_cluster           -> union-find over verified pairs (edges only), kept member per
                               cluster -> dups/s{i}.parquet
  then filter_shard / assemble_shard as above.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_processing.dedup_exact import text_key
from data_processing.document import SCHEMA, quality_score, shard_name, shard_paths
from data_processing.filtering import REMOVED_DIR, removed_metadata
from data_processing.minhash import (
    MinHashConfig,
    UnionFind,
    band_keys,
    band_weights,
    bucket_pairs,
    minhash_signatures,
)


@dataclass(frozen=True)
class ShardPlan:
    """Input shards with their global row offsets (from Parquet footers, no data read)."""

    shards: tuple[str, ...]
    offsets: tuple[int, ...]  # global row number of each shard's first row
    total: int

    def shard_of(self, rows: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.asarray(self.offsets), rows, side="right") - 1


def plan(input_dir: Path | str) -> ShardPlan:
    shards = shard_paths(Path(input_dir))
    if not shards:
        raise ValueError(f"{input_dir}: no part-*.parquet shards found (is this the parent's output?)")
    counts = []
    for s in shards:
        pf = pq.ParquetFile(s)
        missing = {"id", "text"} - set(pf.schema_arrow.names)
        if missing:
            raise ValueError(f"{s}: not a document shard, missing column(s) {sorted(missing)}")
        counts.append(pf.metadata.num_rows)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
    return ShardPlan(tuple(str(s) for s in shards), tuple(offsets), int(sum(counts)))


def _read_checked(path: str, columns: list[str]) -> dict[str, list]:
    cols = pq.read_table(path, columns=columns).to_pydict()
    for row, (i, t) in enumerate(zip(cols["id"], cols.get("text", cols["id"]))):
        if not isinstance(t, str):
            raise ValueError(f"{path}: row {row}: field 'text' must be a string, got {type(t).__name__}")
        if not isinstance(i, str) or not i:
            raise ValueError(f"{path}: row {row}: field 'id' is missing or empty")
    return cols


def _write_table(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, compression="zstd")
    tmp.replace(path)  # atomic: a retried task never sees half a file


def _save_npy(path: Path, a: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.npy")
    np.save(tmp, a)
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------
# Exact dedup: shuffle (text key, row) by key hash; each partition finds first occurrences.
_DUP_SCHEMA = pa.schema([("row", pa.int64()), ("reason", pa.string())])
_KEY_SCHEMA = pa.schema([("key", pa.binary(16)), ("row", pa.int64()), ("id", pa.string())])


def exact_partition(shard_path: str, shard_index: int, offset: int, partitions: int, scratch: str) -> int:
    return exact_partition_shards([(shard_path, shard_index, offset)], partitions, scratch)


def exact_partition_shards(shards: Sequence[tuple[str, int, int]], partitions: int, scratch: str) -> int:
    """exact_partition over consecutive shards (path, index, offset) at once: one key file per
    partition for all of them, keys/p{p}-s{first index}, so a batched task writes P files, not
    P per shard. Returns the number of documents read."""
    keys: list[bytes] = []
    ids: list[str] = []
    rows: list[np.ndarray] = []
    for shard_path, _, offset in shards:
        cols = _read_checked(shard_path, ["id", "text"])
        keys += [text_key(t) for t in cols["text"]]
        ids += cols["id"]
        rows.append(np.arange(offset, offset + len(cols["id"]), dtype=np.int64))
    row = np.concatenate(rows) if rows else np.empty(0, np.int64)
    part = np.array([int.from_bytes(k[:8], "little") % partitions for k in keys], dtype=np.int64)
    for p in range(partitions):
        sel = np.flatnonzero(part == p)
        table = pa.table({"key": [keys[i] for i in sel], "row": row[sel], "id": [ids[i] for i in sel]},
                         schema=_KEY_SCHEMA)  # typed even when empty: a partition may get no key
        _write_table(Path(scratch) / "keys" / f"p{p:04d}-s{shards[0][1]:05d}.parquet", table)
    return len(keys)


def exact_reduce(partition: int, shards: int | Sequence[int], sp: ShardPlan, scratch: str) -> int:
    """First occurrence (lowest global row) of each key in this partition; later rows are
    duplicates. Writes them grouped by the input shard they belong to. Returns the count.
    `shards`: how many shards exact_partition wrote, or the first shard index of each
    exact_partition_shards call."""
    firsts = range(shards) if isinstance(shards, int) else shards
    files = [Path(scratch) / "keys" / f"p{partition:04d}-s{s:05d}.parquet" for s in firsts]
    t = pa.concat_tables([pq.read_table(f) for f in files]).sort_by([("key", "ascending"), ("row", "ascending")])
    keys, rows, ids = t.column("key").to_pylist(), t.column("row").to_numpy(), t.column("id").to_pylist()
    dup_rows, reasons, first = [], [], None
    for i in range(len(keys)):
        if i and keys[i] == keys[i - 1]:
            dup_rows.append(int(rows[i]))
            reasons.append(f"duplicate_of:{ids[first]}")
        else:
            first = i
    _write_dups(np.array(dup_rows, dtype=np.int64), reasons, sp, Path(scratch) / "dups", f"-p{partition:04d}")
    return len(dup_rows)


def _write_dups(rows: np.ndarray, reasons: list[str], sp: ShardPlan, directory: Path, suffix: str) -> None:
    shard = sp.shard_of(rows) if rows.size else rows
    for s in np.unique(shard):
        sel = np.flatnonzero(shard == s)
        table = pa.table({"row": rows[sel], "reason": [reasons[i] for i in sel]}, schema=_DUP_SCHEMA)
        _write_table(directory / f"s{int(s):05d}{suffix}.parquet", table)


# ---------------------------------------------------------------------------------------------
# Shared tail: drop the rows marked as duplicates, then cut the survivors into output shards.
def filter_shard(shard_path: str, shard_index: int, offset: int, step: str, scratch: str) -> dict[str, int]:
    """Kept and removed documents of one input shard, in row order, as pieces/{kept,removed}/s{i}.
    Removed documents carry metadata removed_reason / removed_by as filtering.write_decisions writes."""
    dup_files = sorted((Path(scratch) / "dups").glob(f"s{shard_index:05d}*.parquet"))
    reason: dict[int, str] = {}
    for f in dup_files:
        t = pq.read_table(f)
        reason.update(zip((r - offset for r in t.column("row").to_pylist()), t.column("reason").to_pylist()))
    _read_checked(shard_path, ["id", "text"])
    t = _complete(pq.read_table(shard_path))
    removed_rows = np.array(sorted(reason), dtype=np.int64)
    keep = np.ones(t.num_rows, dtype=bool)
    keep[removed_rows] = False
    kept = t.filter(pa.array(keep))
    metas = t.column("metadata").to_pylist()
    new_meta = []
    for r in removed_rows.tolist():
        m = removed_metadata(json.loads(metas[r] or "{}"), reason[r], step)
        new_meta.append(json.dumps(m, sort_keys=True, ensure_ascii=False))
    removed = t.take(pa.array(removed_rows)).set_column(3, "metadata", pa.array(new_meta, pa.string()))
    root = Path(scratch) / "pieces"
    _write_table(root / "kept" / f"s{shard_index:05d}.parquet", kept.cast(SCHEMA))
    _write_table(root / "removed" / f"s{shard_index:05d}.parquet", removed.cast(SCHEMA))
    return {"kept": int(keep.sum()), "removed": int(removed_rows.size)}


def _complete(t: pa.Table) -> pa.Table:
    """The four document columns, filling a missing source/metadata like read_shard does."""
    n = t.num_rows
    src = t.column("source") if "source" in t.column_names else pa.array([""] * n)
    meta = t.column("metadata") if "metadata" in t.column_names else pa.array(["{}"] * n)
    return pa.table({"id": t.column("id"), "text": t.column("text"), "source": src, "metadata": meta}, schema=SCHEMA)


def assemble_shard(k: int, kind: str, counts: list[int], shard_size: int, scratch: str, out: str) -> int:
    """Output shard k of `kind` ("kept" -> out/, "removed" -> out/removed/): global survivor
    rows [k*shard_size, (k+1)*shard_size) taken from the pieces that hold them. The same
    boundaries ShardWriter draws when it streams the survivors in order."""
    lo, hi = k * shard_size, min((k + 1) * shard_size, sum(counts))
    parts, start = [], 0
    for s, c in enumerate(counts):
        a, b = max(lo, start), min(hi, start + c)
        if a < b:
            piece = pq.read_table(Path(scratch) / "pieces" / kind / f"s{s:05d}.parquet")
            parts.append(piece.slice(a - start, b - a))
        start += c
    directory = Path(out) if kind == "kept" else Path(out) / REMOVED_DIR
    _write_table(directory / shard_name(k), pa.concat_tables(parts).cast(SCHEMA))
    return hi - lo


# ---------------------------------------------------------------------------------------------
# MinHash dedup.
def minhash_shard(shard_path: str, shard_index: int, offset: int, cfg: MinHashConfig, scratch: str) -> dict:
    """Signatures of one shard, its bucket keys for every band, and its (row, id, score) table
    for choosing the kept member of a cluster."""
    if cfg.backend != "numpy":
        raise ValueError("dedup_minhash.backend: the distributed path buckets signatures itself; use backend: numpy")
    _read_checked(shard_path, ["id"])  # ids are checked here, texts by minhash_signatures
    sigs = minhash_signatures(shard_path, cfg)
    rows = np.arange(offset, offset + sigs.shape[0], dtype=np.int64)
    root = Path(scratch)
    _save_npy(root / "sigs" / f"s{shard_index:05d}.npy", sigs)
    for b, w in enumerate(band_weights(cfg.bands, cfg.rows)):
        key = band_keys(sigs, b, cfg.rows, w, rows)
        _save_npy(root / "buckets" / f"b{b:04d}-s{shard_index:05d}.npy", np.stack([key.view(np.int64), rows], axis=1))
    cols = _complete(pq.read_table(shard_path)).select(["id", "metadata"]).to_pydict()
    scores = [quality_score(json.loads(m or "{}")) for m in cols["metadata"]]
    _write_table(root / "meta" / f"s{shard_index:05d}.parquet",
                 pa.table({"row": rows, "id": cols["id"], "score": pa.array(scores, pa.float64())}))
    return {"documents": int(sigs.shape[0])}


def minhash_band(band: int, shards: int, scratch: str) -> int:
    """Candidate pairs of one band: buckets of equal keys over every shard (shard order keeps
    the rows ascending, which bucket_pairs needs)."""
    root = Path(scratch)
    kr = np.concatenate([np.load(root / "buckets" / f"b{band:04d}-s{s:05d}.npy") for s in range(shards)])
    pairs = bucket_pairs(kr[:, 0].view(np.uint64), kr[:, 1])
    _save_npy(root / "pairs" / f"b{band:04d}.npy", pairs)
    return int(len(pairs))


def minhash_split_pairs(bands: int, sp: ShardPlan, scratch: str) -> int:
    """Unique candidate pairs over all bands, grouped by the shard of their first member (the
    graph's edges, not signatures). Returns the number of unique candidate pairs."""
    root = Path(scratch)
    p = np.concatenate([np.load(root / "pairs" / f"b{b:04d}.npy") for b in range(bands)])
    p = np.unique(np.sort(p, axis=1), axis=0) if len(p) else np.empty((0, 2), dtype=np.int64)
    first = sp.shard_of(p[:, 0])
    for s in range(len(sp.shards)):
        _save_npy(root / "vpairs" / f"s{s:05d}-in.npy", p[first == s])
    return int(len(p))


def minhash_verify(shard_index: int, sp: ShardPlan, threshold: float | None, scratch: str) -> int:
    """Keep the pairs whose first member is in this shard and whose estimated Jaccard passes:
    loads this shard's signatures and, one at a time, each shard the partners live in."""
    root = Path(scratch)
    p = np.load(root / "vpairs" / f"s{shard_index:05d}-in.npy")
    if threshold is not None and len(p):
        mine = np.load(root / "sigs" / f"s{shard_index:05d}.npy")
        other_shard = sp.shard_of(p[:, 1])
        ok = np.zeros(len(p), dtype=bool)
        for s in np.unique(other_shard):
            sel = np.flatnonzero(other_shard == s)
            theirs = mine if s == shard_index else np.load(root / "sigs" / f"s{int(s):05d}.npy")
            a = mine[p[sel, 0] - sp.offsets[shard_index]]
            b = theirs[p[sel, 1] - sp.offsets[int(s)]]
            ok[sel] = (a == b).mean(axis=1) >= threshold  # minhash.estimated_jaccard on row pairs
        p = p[ok]
    _save_npy(root / "vpairs" / f"s{shard_index:05d}.npy", p)
    return int(len(p))


def minhash_cluster(sp: ShardPlan, scratch: str) -> dict:
    """Union-find over the verified pairs (only documents with a duplicate take part). The root
    of a cluster is its lowest row, as in minhash.cluster; the kept member is the highest quality
    score, ties -> the lowest id (minhash.choose_kept). Writes dups/s{i}.parquet."""
    root = Path(scratch)
    p = np.concatenate([np.load(root / "vpairs" / f"s{s:05d}.npy") for s in range(len(sp.shards))])
    nodes, local = np.unique(p, return_inverse=True) if len(p) else (np.empty(0, np.int64), np.empty(0, np.int64))
    local = local.reshape(-1, 2)
    uf = UnionFind(len(nodes))
    for i, j in local:
        uf.union(int(i), int(j))
    roots = nodes[np.array([uf.find(i) for i in range(len(nodes))], dtype=np.int64)] if len(nodes) else nodes
    # ids and scores of cluster members only, read shard by shard
    member_shard = sp.shard_of(nodes)
    ids: dict[int, str] = {}
    scores: dict[int, float] = {}
    for s in np.unique(member_shard):
        t = pq.read_table(root / "meta" / f"s{int(s):05d}.parquet")
        want = nodes[member_shard == s] - sp.offsets[int(s)]
        sel = t.take(pa.array(want))
        ids.update(zip(sel.column("row").to_pylist(), sel.column("id").to_pylist()))
        scores.update(zip(sel.column("row").to_pylist(), sel.column("score").to_pylist()))
    best: dict[int, int] = {}
    for n, r in zip(nodes.tolist(), roots.tolist()):
        j = best.get(r)
        if j is None or (-scores[n], ids[n]) < (-scores[j], ids[j]):
            best[r] = n
    kept = set(best.values())
    dup_rows = np.array([n for n in nodes.tolist() if n not in kept], dtype=np.int64)
    root_of = dict(zip(nodes.tolist(), roots.tolist()))
    reasons = [f"near_duplicate_of:{ids[best[root_of[n]]]}" for n in dup_rows.tolist()]
    _write_dups(dup_rows, reasons, sp, root / "dups", "")
    sizes = np.unique(roots, return_counts=True)[1] if len(roots) else np.empty(0, np.int64)
    return {
        "verified_pairs": int(len(p)),
        "clusters": int(len(sizes)),
        "largest_cluster": int(sizes.max()) if len(sizes) else (1 if sp.total else 0),
    }
