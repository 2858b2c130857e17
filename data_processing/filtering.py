"""The keep-or-drop base every curation filter step shares (datatrove's BaseFilter shape).

A step only decides, per document: `True` (keep) or `(False, reason)` (drop, and why). Steps
that must see the whole corpus first (MinHash, SemDeDup) decide after their global pass; the
others decide one document at a time. `write_decisions` does the rest the same way for every
step: kept documents go to out/ shards, dropped ones to out/removed/ shards with
metadata removed_reason / removed_by (so nothing is lost silently), and the drop reasons are
counted. Malformed input records never reach a decision: common.iter_input_documents raises
naming the shard and document.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from data_processing.common import check_document
from data_processing.document import (SCHEMA, Document, ShardWriter, documents_table, filter_rows, read_shard,
                                      table_documents)
from runtime.stage import ProgressFn

Verdict = bool | tuple[bool, str]  # True, or (False, reason)
REMOVED_DIR = "removed"
PROGRESS_EVERY = 1000


def removed_metadata(metadata: dict[str, Any], reason: str, step: str) -> dict[str, Any]:
    """A dropped document's metadata: its own plus why and by which step it was dropped."""
    return {**metadata, "removed_reason": reason, "removed_by": step}


def count_metrics(documents_in: int, kept: int) -> dict[str, Any]:
    """The count metrics every filter step reports (status and README read these names)."""
    removed = documents_in - kept
    return {
        "documents_in": documents_in,
        "kept": kept,
        "removed": removed,
        "removal_rate": removed / documents_in if documents_in else 0.0,
    }


@dataclass
class FilterCounts:
    documents_in: int = 0
    kept: int = 0
    reasons: Counter = field(default_factory=Counter)  # drop reason -> documents

    def metrics(self) -> dict[str, Any]:
        return count_metrics(self.documents_in, self.kept)


def _drop_reason(verdict: Verdict) -> str | None:
    """None to keep, else the reason; anything but True / (False, reason) is a bug in the step."""
    if verdict is True:
        return None
    if isinstance(verdict, tuple) and len(verdict) == 2 and verdict[0] is False and isinstance(verdict[1], str) and verdict[1]:
        return verdict[1]
    raise TypeError(f"a filter verdict is True or (False, reason), got {verdict!r}")


def write_decisions(
    decided: Iterable[tuple[Document, Verdict]],
    out: Path,
    step: str,
    shard_size: int,
    progress: ProgressFn | None = None,
    total: int = 0,
) -> FilterCounts:
    """Write (document, verdict) pairs in order: kept ones to out/ shards, dropped ones to
    out/removed/ shards. Both directories are created even when empty."""
    kept_writer = ShardWriter(Path(out), shard_size)
    removed_writer = ShardWriter(Path(out) / REMOVED_DIR, shard_size)
    counts = FilterCounts()
    for doc, verdict in decided:
        counts.documents_in += 1
        reason = _drop_reason(verdict)
        if reason is None:
            kept_writer.write(doc)
            counts.kept += 1
        else:
            removed_writer.write(Document(doc.id, doc.text, doc.source, removed_metadata(doc.metadata, reason, step)))
            counts.reasons[reason] += 1
        if progress is not None and counts.documents_in % PROGRESS_EVERY == 0:
            progress(counts.documents_in, total, step)
    kept_writer.close()
    removed_writer.close()
    if progress is not None:
        progress(counts.documents_in, total or counts.documents_in, step)
    return counts


def write_shard_decisions(
    shards: list[Path],
    verdicts: Sequence[Verdict],
    out: Path,
    step: str,
    shard_size: int,
) -> FilterCounts:
    """write_decisions for a step that decided every document of its input shards at once
    (verdicts in shard order): each shard's kept rows go out as Arrow rows, never as Python
    objects (a dedup keeps almost everything); dropped ones get their reason as before. A shard
    whose rows are not usable documents is read document by document, so its error names it."""
    kept_writer = ShardWriter(Path(out), shard_size)
    removed_writer = ShardWriter(Path(out) / REMOVED_DIR, shard_size)
    counts = FilterCounts()
    start = 0
    for path in shards:
        table = pq.ParquetFile(path).read(use_threads=False)
        mine = verdicts[start:start + table.num_rows]
        start += table.num_rows
        reasons = [_drop_reason(v) for v in mine]
        if not _usable(table):
            docs = list(read_shard(path))
            for d in docs:
                check_document(d, str(path))
            table = documents_table(docs)
        keep = [r is None for r in reasons]
        kept_writer.write_table(filter_rows(table, keep))
        dropped = [i for i, r in enumerate(reasons) if r is not None]
        for i, doc in zip(dropped, table_documents(filter_rows(table, [not k for k in keep]))):
            removed_writer.write(Document(doc.id, doc.text, doc.source, removed_metadata(doc.metadata, reasons[i], step)))
            counts.reasons[reasons[i]] += 1
        counts.documents_in += table.num_rows
        counts.kept += table.num_rows - len(dropped)
    if start != len(verdicts):
        raise ValueError(f"{step}: {len(verdicts)} decisions for {start} documents")
    kept_writer.close()
    removed_writer.close()
    return counts


def _usable(table: pa.Table) -> bool:
    """The shard schema, every id a non-empty string, every text a string."""
    if table.schema != SCHEMA:
        return False
    ids, text = table.column("id"), table.column("text")
    # not pyarrow.compute: its first call imports pandas (0.2 s)
    return ids.null_count == 0 and text.null_count == 0 and "" not in ids.to_pylist()


def filter_documents(
    docs: Iterable[Document],
    keep: Callable[[Document], Verdict],
    out: Path,
    step: str,
    shard_size: int,
    progress: ProgressFn | None = None,
    total: int = 0,
) -> FilterCounts:
    """write_decisions for a step that decides one document at a time."""
    return write_decisions(((d, keep(d)) for d in docs), out, step, shard_size, progress, total)
