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

from data_processing.common import DaskConfig, StepConfig, count_documents, iter_input_documents, normalize_text
from data_processing.document import Document
from data_processing.filtering import Verdict, filter_documents
from runtime.stage import OPERATIONAL, Workdir


class DedupExactConfig(StepConfig):
    shard_size: int = Field(default=10_000, ge=1, description="documents per output Parquet shard")
    # set: the stage runs sharded on Dask when it runs as a Prefect task (same output, not in the key)
    dask: DaskConfig | None = Field(default=None, json_schema_extra=OPERATIONAL, description=(
        "set: the stage runs sharded on Dask when it runs as a Prefect task (same output; operational, not "
        "in the key)"))


def text_key(text: str) -> bytes:
    """16 bytes of sha256 over the normalised text: collision odds are negligible at 1e12 docs."""
    return hashlib.sha256(normalize_text(text).encode("utf-8")).digest()[:16]


class ExactDeduplicator:
    """Stateful keep() filter: first occurrence of each normalised text passes."""

    def __init__(self) -> None:
        self.seen: dict[bytes, str] = {}

    def keep(self, doc: Document) -> Verdict:
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
    counts = filter_documents(
        iter_input_documents(parent), ExactDeduplicator().keep, workdir.out, "dedup-exact", cfg.shard_size,
        workdir.progress, count_documents(parent),
    )
    return counts.metrics()
