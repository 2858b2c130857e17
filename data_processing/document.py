"""The one record type that passes between curation steps, and its Parquet shard format.

A shard is a Parquet file with columns id (string), text (string), source (string) and
metadata (string: a JSON object). Metadata is JSON-encoded so shards keep one stable schema
whatever keys a step adds (quality scores, weights, cluster ids...).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema(
    [("id", pa.string()), ("text", pa.string()), ("source", pa.string()), ("metadata", pa.string())]
)
SHARD_GLOB = "part-*.parquet"


@dataclass
class Document:
    id: str
    text: str
    source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


def shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def write_shard(path: Path, docs: list[Document]) -> None:
    """Write one shard atomically (tmp file + rename), so a crash never leaves half a shard."""
    table = pa.table(
        {
            "id": [d.id for d in docs],
            "text": [d.text for d in docs],
            "source": [d.source for d in docs],
            "metadata": [json.dumps(d.metadata, sort_keys=True, ensure_ascii=False) for d in docs],
        },
        schema=SCHEMA,
    )
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, compression="zstd")
    tmp.replace(path)


def shard_paths(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob(SHARD_GLOB))


def read_shard(path: Path, batch_size: int = 1024) -> Iterator[Document]:
    """Stream one shard in record batches (bounded memory)."""
    pf = pq.ParquetFile(path)
    missing = {"id", "text"} - set(pf.schema_arrow.names)
    if missing:
        raise ValueError(f"{path}: not a document shard, missing column(s) {sorted(missing)}")
    for batch in pf.iter_batches(batch_size=batch_size):
        cols = batch.to_pydict()
        n = len(cols["id"])
        sources = cols.get("source", [""] * n)
        metas = cols.get("metadata", [None] * n)
        for i in range(n):
            yield Document(cols["id"][i], cols["text"][i], sources[i] or "", json.loads(metas[i] or "{}"))


def read_documents(directory: Path) -> Iterator[Document]:
    """All documents of a shard directory, in shard order."""
    for path in shard_paths(directory):
        yield from read_shard(path)


class ShardWriter:
    """Collects documents and writes numbered shards of `shard_size` documents."""

    def __init__(self, directory: Path, shard_size: int, start_index: int = 0):
        if shard_size <= 0:
            raise ValueError(f"shard_size must be positive, got {shard_size}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shard_size = shard_size
        self.index = start_index
        self.buffer: list[Document] = []
        self.written = 0

    def write(self, doc: Document) -> Path | None:
        """Buffer a document; returns the shard path when this call completed a shard."""
        self.buffer.append(doc)
        if len(self.buffer) >= self.shard_size:
            return self.flush()
        return None

    def write_all(self, docs: Iterable[Document]) -> None:
        for d in docs:
            self.write(d)

    def flush(self) -> Path | None:
        if not self.buffer:
            return None
        path = self.directory / shard_name(self.index)
        write_shard(path, self.buffer)
        self.written += len(self.buffer)
        self.buffer = []
        self.index += 1
        return path

    def close(self) -> None:
        self.flush()


def quality_score(metadata: dict[str, Any]) -> float:
    """The combined score the quality step writes to metadata["quality"]["score"]; 0 when absent.
    Dedup steps keep the highest-scoring member of a duplicate group."""
    q = metadata.get("quality")
    return float(q.get("score", 0.0)) if isinstance(q, dict) else 0.0
