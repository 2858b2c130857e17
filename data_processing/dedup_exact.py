"""Exact deduplication on a normalised-text hash.

Rule: two documents are duplicates when sha256(normalize_text(text)) is equal, where
normalize_text = Unicode NFKC, then casefold, then every whitespace run -> one space, ends
stripped. So "Hello  World\n" and "hello world" collide, "hello, world" does not (punctuation
is kept: exact dedup should not merge texts that differ in content). The first occurrence in
input order (shard order, then row order) is kept; later ones go to removed/ with reason
`duplicate_of:<kept id>`. Running the step on its own output removes nothing (idempotent).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Iterator

from pydantic import Field

from data_processing.common import RemovedWriter, StepConfig, count_documents, iter_input_documents, normalize_text
from data_processing.document import Document, ShardWriter
from glmforge.stage import Workdir


class DedupExactConfig(StepConfig):
    shard_size: int = Field(default=10_000, ge=1)


def text_key(text: str) -> bytes:
    """16 bytes of sha256 over the normalised text: collision odds are negligible at 1e12 docs."""
    return hashlib.sha256(normalize_text(text).encode("utf-8")).digest()[:16]


class ExactDeduplicator:
    """Stateful keep() filter: first occurrence of each normalised text passes."""

    def __init__(self) -> None:
        self.seen: dict[bytes, str] = {}

    def keep(self, doc: Document) -> bool | tuple[bool, str]:
        key = text_key(doc.text)
        first = self.seen.get(key)
        if first is None:
            self.seen[key] = doc.id
            return True
        return False, f"duplicate_of:{first}"


def dedup_exact(docs: Iterable[Document]) -> Iterator[Document]:
    """Documents in, unique documents out (the plain-function form)."""
    d = ExactDeduplicator()
    for doc in docs:
        if d.keep(doc) is True:
            yield doc


def run(cfg: DedupExactConfig, inputs: dict[str, Path], workdir: Workdir) -> dict:
    (parent,) = inputs.values()
    total = count_documents(parent)
    dedup = ExactDeduplicator()
    writer = ShardWriter(workdir.out, cfg.shard_size)
    removed = RemovedWriter(workdir.out, cfg.shard_size, step="dedup-exact")
    n = 0
    for doc in iter_input_documents(parent):
        verdict = dedup.keep(doc)
        if verdict is True:
            writer.write(doc)
        else:
            removed.write(doc, verdict[1])
        n += 1
        if n % 5000 == 0:
            workdir.progress(n, total, "dedup-exact")
    writer.close()
    removed.close()
    workdir.progress(n, total, "dedup-exact")
    return {
        "documents_in": n,
        "kept": n - removed.count,
        "removed": removed.count,
        "removal_rate": removed.count / n if n else 0.0,
    }
