"""The one record type that passes between curation steps, and its Parquet shard format.

A shard is a Parquet file with columns id (string), text (string), source (string) and
metadata (string: a JSON object). Metadata is JSON-encoded so shards keep one stable schema
whatever keys a step adds (quality scores, weights, cluster ids...).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema(
    [("id", pa.string()), ("text", pa.string()), ("source", pa.string()), ("metadata", pa.string())]
)
SHARD_GLOB = "part-*.parquet"


class Document:
    """One record: id, text, source and a metadata dict. Read from a shard, the metadata stays
    the shard's JSON string until someone reads it, and is written back as that same string if
    nobody did: a step that passes most documents through unchanged (a dedup's kept ones)
    never decodes and re-encodes their metadata."""

    __slots__ = ("id", "text", "source", "_metadata", "_metadata_json")

    def __init__(self, id: str, text: str, source: str = "", metadata: dict[str, Any] | None = None, *,
                 metadata_json: str | None = None):
        self.id, self.text, self.source = id, text, source
        self._metadata = metadata if metadata is not None or metadata_json is not None else {}
        self._metadata_json = metadata_json if metadata is None else None

    @property
    def metadata(self) -> dict[str, Any]:
        if self._metadata is None:
            self._metadata = json.loads(self._metadata_json or "{}")
            self._metadata_json = None       # the dict may now change: encode it again on write
        return self._metadata

    @metadata.setter
    def metadata(self, value: dict[str, Any]) -> None:
        self._metadata, self._metadata_json = value, None

    def metadata_json(self) -> str:
        """The metadata as a shard stores it (sorted keys)."""
        if self._metadata_json is not None:
            return self._metadata_json
        return json.dumps(self._metadata, sort_keys=True, ensure_ascii=False)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Document) and (self.id, self.text, self.source) == (other.id, other.text, other.source)
                and self.metadata == other.metadata)

    def __repr__(self) -> str:
        return f"Document(id={self.id!r}, text={self.text[:40]!r}, source={self.source!r}, metadata={self.metadata!r})"


def shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def write_shard(path: Path, docs: list[Document]) -> None:
    """Write one shard atomically (tmp file + rename), so a crash never leaves half a shard."""
    # from_arrays, not pa.table(dict): that one imports pandas (0.2 s) to ask if it was given a DataFrame
    table = pa.Table.from_arrays(
        [pa.array([d.id for d in docs], pa.string()), pa.array([d.text for d in docs], pa.string()),
         pa.array([d.source for d in docs], pa.string()), pa.array([d.metadata_json() for d in docs], pa.string())],
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
            yield Document(cols["id"][i], cols["text"][i], sources[i] or "", metadata_json=metas[i] or "{}")


def read_ids_and_metadata(directory: Path) -> Iterator[tuple[str, str]]:
    """(id, metadata JSON) of every document of a shard directory, in order, without reading
    the text column (most of a shard's bytes)."""
    for path in shard_paths(directory):
        pf = pq.ParquetFile(path)
        meta = "metadata" in pf.schema_arrow.names
        for batch in pf.iter_batches(batch_size=8192, columns=["id", "metadata"] if meta else ["id"]):
            cols = batch.to_pydict()
            yield from zip(cols["id"], cols["metadata"] if meta else ["{}"] * len(cols["id"]))


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
