"""The one record type that passes between curation steps, and its Parquet shard format.

A shard is a Parquet file with columns id (string), text (string), source (string) and
metadata (string: a JSON object). Metadata is JSON-encoded so shards keep one stable schema
whatever keys a step adds (quality scores, weights, cluster ids...).
"""
from __future__ import annotations

import contextlib
import contextvars
import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
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


def documents_table(docs: list[Document]) -> pa.Table:
    """Documents as a table of the shard schema."""
    return pa.Table.from_arrays(
        [string_array([d.id for d in docs]), string_array([d.text for d in docs]),
         string_array([d.source for d in docs]), string_array([d.metadata_json() for d in docs])],
        schema=SCHEMA,
    )


def write_shard(path: Path, docs: list[Document] | pa.Table) -> None:
    """Write one shard (documents, or a table of the shard schema) atomically (tmp file +
    rename), so a crash never leaves half a shard."""
    table = docs if isinstance(docs, pa.Table) else documents_table(docs)
    tmp = path.with_name(path.name + ".tmp")
    dirs = _UNCOMPRESSED_DIRS.get()
    plain = bool(dirs) and path.parent.resolve() in dirs
    pq.write_table(table, tmp, compression="none" if plain else "zstd")
    tmp.replace(path)


# Folders whose shards are scratch, read back once or twice on this machine and then deleted
# (`glmforge curate`'s ingest shards, and its step's kept shards when it writes them out as one
# file): written uncompressed there, since zstd costs more CPU than it saves. Same rows.
_UNCOMPRESSED_DIRS: contextvars.ContextVar[frozenset[Path]] = contextvars.ContextVar(
    "uncompressed_shard_dirs", default=frozenset())


@contextlib.contextmanager
def uncompressed_shards(*directories: Path) -> Iterator[None]:
    """Within the block, write_shard writes shards placed directly in these folders (not in their
    subfolders) without compression (this thread or task only)."""
    token = _UNCOMPRESSED_DIRS.set(_UNCOMPRESSED_DIRS.get() | {Path(d).resolve() for d in directories})
    try:
        yield
    finally:
        _UNCOMPRESSED_DIRS.reset(token)


def string_array(values: list[str]) -> pa.Array:
    """An Arrow string array of Python strings, built from their UTF-8 bytes and offsets: several
    times faster than pa.array on text, which also imports pandas (0.2 s) to ask whether it was
    given a Series. pa.array where the bytes would not fit 32-bit offsets or a string does not
    encode (a lone surrogate: its error is Arrow's, as before)."""
    try:
        data = [v.encode() for v in values]
    except UnicodeEncodeError:
        return pa.array(values, pa.string())
    offsets = np.zeros(len(data) + 1, dtype=np.int32)
    total = sum(map(len, data))
    if total >= 2**31:
        return pa.array(values, pa.string())
    np.cumsum(np.fromiter(map(len, data), dtype=np.int32, count=len(data)), out=offsets[1:])
    return pa.StringArray.from_buffers(len(data), pa.py_buffer(offsets), pa.py_buffer(b"".join(data)))


def bool_array(values: list[bool]) -> pa.BooleanArray:
    """An Arrow boolean array from its bits (pa.array imports pandas: string_array's note)."""
    bits = np.packbits(np.asarray(values, dtype=bool), bitorder="little")
    return pa.BooleanArray.from_buffers(pa.bool_(), len(values), [None, pa.py_buffer(bits.tobytes())])


def filter_rows(table: pa.Table, keep: list[bool]) -> pa.Table:
    """table.filter(keep), the same rows and one chunk per column as that gives a table of one
    chunk per column, without pyarrow.compute (whose first call imports 0.07 s of Python): the
    runs of kept rows sliced and joined. Other tables: table.filter."""
    if len(keep) != table.num_rows or any(c.num_chunks != 1 for c in table.columns):
        return table.filter(bool_array(keep))
    k = np.zeros(len(keep) + 2, dtype=np.int8)
    k[1:-1] = np.asarray(keep, dtype=bool)
    edges = np.flatnonzero(np.diff(k)).tolist()  # starts and ends of the kept runs, alternating
    if not edges:  # nothing kept (or no rows): filter's result has no chunks, or the empty one
        return table if not keep else pa.Table.from_batches([], schema=table.schema)
    if edges == [0, table.num_rows]:
        return table
    return pa.concat_tables([table.slice(s, e - s) for s, e in zip(edges[0::2], edges[1::2])]).combine_chunks()


def shard_paths(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob(SHARD_GLOB))


def read_shard(path: Path, batch_size: int = 1024) -> Iterator[Document]:
    """Stream one shard in record batches (bounded memory)."""
    pf = pq.ParquetFile(path)
    missing = {"id", "text"} - set(pf.schema_arrow.names)
    if missing:
        raise ValueError(f"{path}: not a document shard, missing column(s) {sorted(missing)}")
    for batch in pf.iter_batches(batch_size=batch_size, use_threads=False):
        yield from table_documents(batch)


def table_documents(rows: pa.Table | pa.RecordBatch) -> Iterator[Document]:
    """The documents of a table or record batch of shard rows (source and metadata optional)."""
    cols = rows.to_pydict()
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
        for batch in pf.iter_batches(batch_size=8192, columns=["id", "metadata"] if meta else ["id"],
                                     use_threads=False):
            cols = batch.to_pydict()
            yield from zip(cols["id"], cols["metadata"] if meta else ["{}"] * len(cols["id"]))


def read_documents(directory: Path) -> Iterator[Document]:
    """All documents of a shard directory, in shard order."""
    for path in shard_paths(directory):
        yield from read_shard(path)


class ShardWriter:
    """Collects documents, or tables of documents' rows, and writes numbered shards of
    `shard_size` documents."""

    def __init__(self, directory: Path, shard_size: int, start_index: int = 0):
        if shard_size <= 0:
            raise ValueError(f"shard_size must be positive, got {shard_size}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shard_size = shard_size
        self.index = start_index
        self.buffer: list[Document] = []
        self.tables: list[pa.Table] = []     # rows given as tables (write_table), in order
        self.written = 0

    def write(self, doc: Document) -> Path | None:
        """Buffer a document; returns the shard path when this call completed a shard."""
        if self.tables:                      # rows are pending as a table: keep their order
            self.write_table(documents_table([doc]))
            return None
        self.buffer.append(doc)
        if len(self.buffer) >= self.shard_size:
            return self.flush()
        return None

    def write_all(self, docs: Iterable[Document]) -> None:
        for d in docs:
            self.write(d)

    def write_table(self, table: pa.Table) -> None:
        """Buffer a table's rows (the shard schema; documents passed through unchanged need no
        Python objects), writing every shard it completes."""
        if self.buffer:
            self.tables.append(documents_table(self.buffer))
            self.buffer = []
        self.tables.append(table)
        rows = pa.concat_tables(self.tables)
        while rows.num_rows >= self.shard_size:
            self._write(rows.slice(0, self.shard_size))
            rows = rows.slice(self.shard_size)
        self.tables = [rows] if rows.num_rows else []

    def write_rows(self, table: pa.Table) -> Path:
        """Write a table of the shard schema as the next shard, chunks as given (nothing may be
        buffered: the caller assembles whole shards)."""
        if self.buffer or self.tables:
            raise ValueError("ShardWriter.write_rows: documents are buffered")
        return self._write(table)

    def flush(self) -> Path | None:
        if self.tables:
            if self.buffer:
                self.tables.append(documents_table(self.buffer))
                self.buffer = []
            rows, self.tables = pa.concat_tables(self.tables), []
            return self._write(rows) if rows.num_rows else None
        if not self.buffer:
            return None
        path, self.buffer = self._write(self.buffer), []
        return path

    def _write(self, rows: list[Document] | pa.Table) -> Path:
        path = self.directory / shard_name(self.index)
        write_shard(path, rows)
        self.written += len(rows)
        self.index += 1
        return path

    def close(self) -> None:
        self.flush()


def quality_score(metadata: dict[str, Any]) -> float:
    """The combined score the quality step writes to metadata["quality"]["score"]; 0 when absent.
    Dedup steps keep the highest-scoring member of a duplicate group."""
    q = metadata.get("quality")
    return float(q.get("score", 0.0)) if isinstance(q, dict) else 0.0
