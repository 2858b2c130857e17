"""Stage `ingest`: raw documents (JSONL, Parquet, plain-text folders; local or s3://) ->
normalized, sharded Parquet (id, text, source, metadata).

Streams record by record, so memory is bounded by one shard; except that a JSONL file of
plain {id, text} records of a keep_ids source (`glmforge curate`'s input), up to 64 MB, is read
whole by Arrow's JSON reader into the same shards (any other file, or any doubt, goes record by
record). Nothing is silently dropped: a bad record (invalid UTF-8, invalid JSON, not an object,
missing or non-string text, empty text) goes to quarantine.jsonl with its file, line and
reason, and is counted in the metrics.

Resume: shards are written into the checkpoint directory, and after each shard the input
cursor (source, file, records consumed) is saved with it. A killed run resumes at that cursor
and produces byte-identical shards, so the published artifact has the same digests.
"""
from __future__ import annotations

import base64
import hashlib
import fnmatch
import functools
import json
import os
import shutil
import tempfile
import unicodedata
from collections import Counter
from dataclasses import dataclass
from json.encoder import encode_basestring
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator

from data_processing.common import expand_placeholders
from data_processing.document import (SCHEMA, Document, ShardWriter, documents_table, read_shard, shard_paths,
                                      table_documents)
from runtime.stage import Workdir

STAGE_VERSION = "1"


class SourceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="label stored in each document's `source` column")
    path: str = Field(description="file, folder, glob-free prefix or s3:// URI; `{stdlib}` = Python's stdlib dir")
    format: Literal["auto", "jsonl", "parquet", "text"] = Field("auto", description=(
        "how the files are read; auto: by extension (.jsonl/.ndjson/.json as JSONL, .parquet as Parquet, "
        "anything else as plain text)"))
    text_field: str = Field("text", description=(
        "the record field holding the text (JSONL and Parquet); records without it are quarantined"))
    text_template: str | None = Field(
        default=None, description='build text from several fields, e.g. "{title}\\n\\n{body}" (null fields become "")'
    )
    id_field: str | None = Field(default=None, description="the document id is `<name>/<value>`; records without it are quarantined")
    keep_ids: bool = Field(
        default=False,
        description="use each record's id (id_field, else `id`) as the document id unchanged; records without one "
        "get <name>/<file>#L<line>; a repeated id stops the run naming both places",
        exclude_if=lambda v: not v,  # left out of the dump when off, so existing stage keys stay the same
    )
    include: str = Field("*", description=(
        "filename pattern of the files taken in a folder or under an s3:// prefix, e.g. \"*.py\""))
    max_documents: int | None = Field(default=None, gt=0, description=(
        "stop reading the source after this many documents; null: all"))
    max_file_bytes: int = Field(default=1_000_000, gt=0, description="text files above this go to quarantine")
    split_on: str | None = Field(default=None, description="plain text: split each file into records at this separator")
    repo: str | None = Field(
        default=None, description="the files are one code repository: metadata gets repo and path (repo-level packing)"
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v or "/" in v:
            raise ValueError("source name must be non-empty and contain no '/'")
        return v


class IngestConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sources: list[SourceConfig] = Field(min_length=1, description=(
        "the raw sources, read in this order (at least one)"))
    shard_size: int = Field(default=2000, gt=0, description="documents per Parquet shard")


# ---------------------------------------------------------------- reading raw records


@dataclass
class Raw:
    """One raw record before validation: its location, and either parsed fields or an error."""

    file: str
    line: int | None
    fields: dict[str, Any] | None = None
    error: str | None = None
    raw: bytes | str | None = None


def resolve_path(path: str) -> str:
    """A source path with {stdlib} and {samples} expanded (local paths also get ~ expanded)."""
    path = expand_placeholders(path)
    return path if "://" in path else str(Path(path).expanduser())


def _list_files(src: SourceConfig) -> list[str]:
    """The source's files in a stable order (sorted relative paths)."""
    path = resolve_path(src.path)
    if path.startswith("s3://"):
        return _s3_list(path, src.include)
    p = Path(path)
    if p.is_file():
        return [str(p)]
    if p.is_dir():
        # os.walk, matching names before any stat: rglob("*") stats every entry, which took
        # 2.3 s on the Python standard library (13k files), on every stage key computed.
        found = []
        for folder, _, names in os.walk(p):
            rel = Path(folder).relative_to(p).as_posix()
            for name in fnmatch.filter(names, src.include):
                f = os.path.join(folder, name)
                if os.path.isfile(f):
                    found.append((name if rel == "." else f"{rel}/{name}", f))
        return [f for _, f in sorted(found)]
    raise FileNotFoundError(f"ingest source {src.name!r}: input {path!r} does not exist")


def _s3_list(uri: str, include: str) -> list[str]:
    return [u for u, _ in _s3_objects(uri, include)]


def _s3_objects(uri: str, include: str) -> list[tuple[str, str]]:
    """(uri, etag) of each object under an s3:// prefix matching `include`."""
    from runtime.store import S3Store

    bucket, _, key = uri[5:].partition("/")
    store = S3Store(f"s3://{bucket}")
    found = [
        (f"s3://{bucket}/{o['Key']}", o.get("ETag", ""))
        for page in store._client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key)
        for o in page.get("Contents", [])
    ]
    if not found:
        raise FileNotFoundError(f"ingest: input {uri!r} does not exist (no objects under that prefix)")
    return sorted((u, e) for u, e in found if fnmatch.fnmatch(u.rsplit("/", 1)[-1], include))


def fingerprint(cfg: "IngestConfig") -> str:
    """Names, sizes and mtimes (local) or ETags (S3) of every input file: changes when raw data
    changes, without reading it. Part of the stage key."""
    h = hashlib.sha256()
    for src in cfg.sources:
        path = resolve_path(src.path)
        if path.startswith("s3://"):
            for uri, etag in _s3_objects(path, src.include):
                h.update(f"{uri}\0{etag}\n".encode())
            continue
        root = _source_root(src)
        for f in _list_files(src):
            st = os.stat(f)
            h.update(f"{os.path.relpath(f, root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _format_of(src: SourceConfig, file: str) -> str:
    if src.format != "auto":
        return src.format
    name = file.lower()
    if name.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


class _LocalCopy:
    """A local path for a file that may live in S3 (downloaded to a temp file, deleted after)."""

    def __init__(self, file: str):
        self.file, self.tmp = file, None

    def __enter__(self) -> Path:
        if not self.file.startswith("s3://"):
            return Path(self.file)
        from runtime.store import S3Store

        bucket, _, key = self.file[5:].partition("/")
        fd, name = tempfile.mkstemp(suffix=Path(key).suffix)
        os.close(fd)
        self.tmp = Path(name)
        S3Store(f"s3://{bucket}").get_file(key, self.tmp)
        return self.tmp

    def __exit__(self, *exc: Any) -> None:
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)


def _read_jsonl(path: Path, file: str) -> Iterator[Raw]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            stripped = line.strip()
            if not stripped:
                continue  # blank lines are not records
            try:
                text = stripped.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Raw(file, lineno, error=f"invalid_utf8: invalid UTF-8 at byte {e.start}", raw=stripped)
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield Raw(file, lineno, error=f"invalid_json: {e.msg} (column {e.colno})", raw=text)
                continue
            if not isinstance(obj, dict):
                yield Raw(file, lineno, error=f"not_object: record is a JSON {type(obj).__name__}, not an object", raw=text)
                continue
            yield Raw(file, lineno, fields=obj, raw=text)


def _read_parquet(path: Path, file: str) -> Iterator[Raw]:
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for rec in batch.to_pylist():
            row += 1
            yield Raw(file, row, fields=rec)


def _read_text(path: Path, file: str, max_bytes: int, split_on: str | None) -> Iterator[Raw]:
    size = path.stat().st_size
    if size > max_bytes:
        yield Raw(file, None, error=f"too_large: file is {size} bytes, above max_file_bytes={max_bytes}", raw=None)
        return
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        yield Raw(file, None, error=f"invalid_utf8: invalid UTF-8 at byte {e.start}", raw=data)
        return
    if split_on is None:
        yield Raw(file, None, fields={"text": text})
        return
    line = 1
    for part in text.split(split_on):
        if part.strip():
            yield Raw(file, line + len(part) - len(part.lstrip("\n")), fields={"text": part})
        line += part.count("\n") + split_on.count("\n")


def read_source(src: SourceConfig, start_file: int = 0, skip: int = 0, *, fast_root: str | None = None,
                seen: dict[str, str] | None = None) -> Iterator[tuple[int, int, Raw | FileRows]]:
    """Yield (file_index, records consumed in that file, record) from start_file, skipping
    the first `skip` records of start_file (resume). With fast_root (the source's root) and a
    fast_path_source, a JSONL file that _jsonl_rows takes whole comes as one item
    (file_index, its records, FileRows)."""
    fast = fast_root is not None and fast_path_source(src)
    for fi, file in enumerate(_list_files(src)):
        if fi < start_file:
            continue
        fmt = _format_of(src, file)
        with _LocalCopy(file) as local:
            if fast and fmt == "jsonl" and not (fi == start_file and skip):
                rows = _jsonl_rows(local, file, src, fast_root, seen)
                if rows is not None:
                    yield fi, rows.table.num_rows, rows
                    continue
            if fmt == "jsonl":
                records = _read_jsonl(local, file)
            elif fmt == "parquet":
                records = _read_parquet(local, file)
            else:
                records = _read_text(local, file, src.max_file_bytes, src.split_on)
            for n, rec in enumerate(records, start=1):
                if fi == start_file and n <= skip:
                    continue
                yield fi, n, rec


# ---------------------------------------------------------------- JSONL files read whole by Arrow

FAST_JSONL_MAX_BYTES = 64 << 20  # larger files are streamed record by record (bounded memory)
_ASCII_SPACE = np.zeros(256, dtype=bool)  # the ASCII characters str.rstrip() strips
_ASCII_SPACE[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True
_ASCII_SPACE_BYTES = bytes(np.flatnonzero(_ASCII_SPACE).tolist())


@dataclass
class FileRows:
    """Every record of one JSONL file as shard rows (fast path): what the per-record path makes
    of them, with their ids and text bytes for the checks and counts of run()."""

    file: str
    table: pa.Table  # the shard schema, one chunk per column
    ids: list[str]
    text_bytes: np.ndarray  # int64[rows]: UTF-8 bytes of each text


def _normalized(text: pa.StringArray) -> tuple[pa.StringArray | None, np.ndarray]:
    """normalize_text of every string of the array, and the UTF-8 bytes of each; (None, _) if
    one would be empty (quarantined: left to the per-record path). Done on the bytes: an ASCII
    text without CR is NFC already, so only its trailing whitespace goes (bytes.rstrip of the
    ASCII characters str.rstrip strips); the others go through normalize_text."""
    n = len(text)
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int32, count=n + 1, offset=text.offset * 4).astype(np.int64)
    data = text.buffers()[2]
    body = np.frombuffer(data, dtype=np.uint8, count=int(offsets[-1]))
    lengths = np.diff(offsets)
    if not lengths.all():
        return None, lengths
    used = body[offsets[0]:]
    changed: dict[int, bytes | memoryview] = {}  # row -> its normalized text's bytes
    wide = np.flatnonzero((used >= 0x80) | (used == 13))  # non-ASCII, or a CR
    rows = np.searchsorted(offsets, wide + offsets[0], side="right") - 1  # ascending
    # the distinct rows (not np.unique: it imports numpy.ma, 0.03 s)
    wide_rows = rows[np.concatenate(([True], rows[1:] != rows[:-1]))].tolist() if rows.size else []
    for row in wide_rows:
        t = text[row].as_py()
        u = normalize_text(t)
        if not u:
            return None, lengths
        if u != t:
            changed[row] = u.encode()
    raw = memoryview(data)
    wide_set = set(wide_rows)
    for row in np.flatnonzero(_ASCII_SPACE[body[offsets[1:] - 1]]).tolist():
        if row not in wide_set:  # ASCII: the text up to its last byte that is not a space
            start, end = int(offsets[row]), int(offsets[row + 1])
            while end > start and raw[end - 1] in _ASCII_SPACE_BYTES:
                end -= 1
            if end == start:
                return None, lengths
            changed[row] = raw[start:end]
    if not changed:
        return text, lengths
    pieces, start = [], 0
    for row in sorted(changed):
        pieces += (raw[offsets[start]:offsets[row]], changed[row])
        lengths[row] = len(changed[row])
        start = row + 1
    pieces.append(raw[offsets[start]:offsets[n]])
    return _strings(b"".join(pieces), lengths), lengths


def _strings(data: bytes, lengths: np.ndarray) -> pa.StringArray:
    """An Arrow string array of consecutive UTF-8 strings of these byte lengths."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.StringArray.from_buffers(len(lengths), pa.py_buffer(offsets), pa.py_buffer(data))


def fast_path_source(src: SourceConfig) -> bool:
    """Sources whose JSONL files may be read by _jsonl_rows: records {id, text} kept with their
    own ids and nothing else to do per record."""
    return (src.keep_ids and src.id_field is None and src.text_template is None and src.repo is None
            and src.max_documents is None and src.text_field != "id")


def _jsonl_rows(path: Path, file: str, src: SourceConfig, root: str, seen: dict[str, str] | None) -> FileRows | None:
    """A JSONL file's documents read whole by Arrow's JSON reader (several times faster than
    json.loads and a Document per record), or None unless that gives exactly what the
    per-record path gives: every line one object of exactly the fields id and text, both
    strings, the id non-empty and new, the text non-empty once normalized (_normalized); valid
    UTF-8, no blank line, no BOM, no CR outside strings. None (the file goes the per-record way, which
    quarantines and names lines as always) on anything else, and on any error of the reader."""
    if path.stat().st_size > FAST_JSONL_MAX_BYTES:
        return None
    data = path.read_bytes()
    if not data or data.startswith(b"\xef\xbb\xbf") or b"\r" in data:
        return None
    # Each line must end with the "}" of an object that starts on it (the fields are strings:
    # no other "}" ends a line), so no object spans lines; with as many rows as lines, each line
    # holds exactly one. Blank lines (skipped, but counted in line numbers) are refused.
    raw = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(raw == 10)
    lines = newlines.size + (not data.endswith(b"\n"))
    plain = newlines.size and newlines[0] and (raw[newlines - 1] == ord("}")).all()  # each line "...}\n"
    if not (plain and data[-256:].rstrip().endswith(b"}")) and not all(
            line.rstrip().endswith(b"}") for line in data.removesuffix(b"\n").split(b"\n")):
        return None
    from pyarrow import json as pj  # 0.01 s, only when a file is read this way

    schema = pa.schema([("id", pa.string()), (src.text_field, pa.string())])
    try:
        table = pj.read_json(pa.BufferReader(data),
                             read_options=pj.ReadOptions(use_threads=False, block_size=len(data) + 1),
                             parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error"))
        table.validate(full=True)  # UTF-8
    except (pa.ArrowException, ValueError):
        return None
    n = table.num_rows
    if n != lines or table.schema != schema or any(c.num_chunks != 1 or c.null_count for c in table.columns):
        return None
    ids_arr, text = table.column("id").chunk(0), table.column(src.text_field).chunk(0)
    ids = ids_arr.to_pylist()
    if "" in ids or len(set(ids)) != n or (seen is not None and not seen.keys().isdisjoint(ids)):
        return None  # bad or repeated ids: the per-record path says which
    text, lengths = _normalized(text)
    if text is None:
        return None
    # metadata {"file": ..., "line": ...} as Document.metadata_json writes it (sorted keys)
    head = f'{{"file": {encode_basestring(_relative(file, root))}, "line": '.encode()
    numbers = [b"%d" % line for line in range(1, n + 1)]
    metadata = _strings(head + (b"}" + head).join(numbers) + b"}",
                        np.fromiter(map(len, numbers), dtype=np.int64, count=n) + len(head) + 1)
    name = src.name.encode()
    sources = _strings(name * n, np.full(n, len(name), dtype=np.int64))
    rows = pa.Table.from_arrays([ids_arr, text, sources, metadata], schema=SCHEMA)
    return FileRows(file, rows, ids, lengths)


# ---------------------------------------------------------------- validation


def normalize_text(text: str) -> str:
    """NFC, Unix newlines, no trailing whitespace at the end of the document."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return unicodedata.normalize("NFC", text).rstrip()


def to_document(src: SourceConfig, rec: Raw, root: str) -> Document | str:
    """A Document, or why the record is quarantined: "code: detail"."""
    if rec.error:
        return rec.error
    fields = dict(rec.fields or {})
    if src.text_template is not None:
        try:
            text = src.text_template.format_map({k: "" if v is None else v for k, v in fields.items()})
        except KeyError as e:
            return f"missing_text: missing field {e.args[0]!r} used by text_template"
    elif src.text_field not in fields:
        return f"missing_text: missing field {src.text_field!r}"
    else:
        text = fields.pop(src.text_field)
    if not isinstance(text, str):
        return f"non_string_text: field {src.text_field!r} is {type(text).__name__}, not a string"
    text = normalize_text(text)
    if not text:
        return f"empty_text: field {src.text_field!r} is empty after normalization"
    rel = _relative(rec.file, root)
    id_key = src.id_field or ("id" if src.keep_ids else None)
    own_id = fields.get(id_key) if id_key is not None else None
    if src.keep_ids and own_id is not None:
        if isinstance(own_id, bool) or not isinstance(own_id, (str, int)) or own_id == "":
            return f"bad_id: field {id_key!r} is {own_id!r}, not a non-empty string or integer"
        doc_id = str(own_id)
    elif src.id_field is not None and not src.keep_ids:
        if own_id is None:
            return f"missing_id: missing id field {src.id_field!r}"
        doc_id = f"{src.name}/{own_id}"
    else:
        doc_id = f"{src.name}/{rel}" + (f"#L{rec.line}" if rec.line is not None else "")
    meta = {"file": rel, **({"line": rec.line} if rec.line is not None else {})}
    if src.repo is not None:
        meta.update(repo=src.repo, path=rel)
    extra = {k: v for k, v in fields.items() if k != id_key}
    if extra:
        meta["fields"] = json.loads(json.dumps(extra, default=str))
    return Document(id=doc_id, text=text, source=src.name, metadata=meta)


@functools.lru_cache(maxsize=256)
def _relative(file: str, root: str) -> str:
    """A record's file relative to its source's root (asked once per record: cached per file)."""
    return os.path.relpath(file, root) if not file.startswith("s3://") else file[len(root):].lstrip("/")


def _source_root(src: SourceConfig) -> str:
    path = resolve_path(src.path)
    if path.startswith("s3://"):
        return path.rstrip("/")
    p = Path(path)
    return str(p.parent if p.is_file() else p)


def quarantine_record(src: SourceConfig, rec: Raw, reason: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"source": src.name, "file": rec.file, "line": rec.line, "reason": reason}
    raw = rec.raw if rec.raw is not None else (json.dumps(rec.fields, default=str) if rec.fields else None)
    if isinstance(raw, bytes):
        entry["raw_base64"] = base64.b64encode(raw).decode()
    elif raw is not None:
        entry["raw"] = raw
    return entry


# ---------------------------------------------------------------- the stage


@dataclass
class Cursor:
    """Where the input stands after the last completed shard."""

    source: int = 0
    file: int = 0
    consumed: int = 0  # records consumed in that file
    shard: int = 0  # next shard index
    quarantine_bytes: int = 0
    documents: int = 0
    text_bytes: int = 0
    reasons: dict[str, int] | None = None
    per_source: dict[str, int] | None = None


def _load_cursor(path: Path) -> Cursor:
    if not path.exists():
        return Cursor(reasons={}, per_source={})
    return Cursor(**json.loads(path.read_text()))


def _save_cursor(path: Path, c: Cursor) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(c.__dict__, sort_keys=True))
    os.replace(tmp, path)


def _seen_ids(shards_dir: Path) -> dict[str, str]:
    seen: dict[str, str] = {}
    for p in shard_paths(shards_dir):
        for d in read_shard(p):
            seen.setdefault(d.id, d.metadata.get("file", "?") + (f":{d.metadata['line']}" if "line" in d.metadata else ""))
    return seen


def _link_or_copy(src: Path, dst: Path) -> None:
    """dst with src's bytes: a hard link where the file system allows (a shard is never changed
    in place: rewritten through a temporary file and a rename), else a copy."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def run(cfg: IngestConfig, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]:
    for src in cfg.sources:  # a missing input fails before any work
        _list_files(src)
    ckpt = workdir.checkpoint
    shards_dir = ckpt / "shards"
    shards_dir.mkdir(parents=True, exist_ok=True)
    qpath = ckpt / "quarantine.jsonl"
    cursor_path = ckpt / "cursor.json"
    c = _load_cursor(cursor_path)
    reasons, per_source = Counter(c.reasons), Counter(c.per_source)

    # Drop what a killed attempt wrote after its last checkpoint: those records are re-read.
    for p in shard_paths(shards_dir):
        if int(p.stem.split("-")[1]) >= c.shard:
            p.unlink()
    with open(qpath, "ab") as f:
        f.truncate(c.quarantine_bytes)

    # keep_ids: id -> where it was first seen, rebuilt from the kept shards on resume
    seen = _seen_ids(shards_dir) if any(s.keep_ids for s in cfg.sources) else None
    writer = ShardWriter(shards_dir, cfg.shard_size, start_index=c.shard)
    # rows of files read whole (FileRows) not yet in a shard; they and writer.buffer's documents
    # are never both pending. A shard is one table of one chunk per column either way, so its
    # bytes are the same whichever way its records were read.
    carry: list[pa.Table] = []
    carried = 0
    pending = {"documents": 0, "bytes": 0, "reasons": Counter(), "sources": Counter()}
    qfile = open(qpath, "a", encoding="utf-8")
    pos = (c.source, c.file, c.consumed)

    def checkpoint() -> None:
        nonlocal c
        qfile.flush()
        reasons.update(pending["reasons"])
        per_source.update(pending["sources"])
        c = Cursor(
            source=pos[0], file=pos[1], consumed=pos[2], shard=writer.index,
            quarantine_bytes=qpath.stat().st_size,
            documents=c.documents + pending["documents"], text_bytes=c.text_bytes + pending["bytes"],
            reasons=dict(reasons), per_source=dict(per_source),
        )
        _save_cursor(cursor_path, c)
        pending.update(documents=0, bytes=0, reasons=Counter(), sources=Counter())
        workdir.persist_checkpoint()

    try:
        for si, src in enumerate(cfg.sources):
            if si < c.source:
                continue
            root = _source_root(src)
            start_file, skip = (c.file, c.consumed) if si == c.source else (0, 0)
            taken = 0
            if si == c.source:  # documents of this source taken before the checkpoint
                taken = per_source.get(src.name, 0)
            for fi, n, rec in read_source(src, start_file, skip, fast_root=root, seen=seen):
                if src.max_documents is not None and taken >= src.max_documents:
                    break
                if isinstance(rec, FileRows):  # a whole file, checked: every record a document
                    if writer.buffer:
                        carry.append(documents_table(writer.buffer))
                        carried, writer.buffer = len(writer.buffer), []
                    if seen is not None:
                        seen.update((i, f"{rec.file}:{line}") for line, i in enumerate(rec.ids, start=1))
                    done = 0
                    while done < n:
                        take = min(cfg.shard_size - carried, n - done)
                        carry.append(rec.table.slice(done, take))
                        carried += take
                        taken += take
                        pending["documents"] += take
                        pending["bytes"] += int(rec.text_bytes[done:done + take].sum())
                        pending["sources"][src.name] += take
                        done += take
                        pos = (si, fi, done)
                        if carried == cfg.shard_size:
                            writer.write_rows(pa.concat_tables(carry).combine_chunks())
                            carry, carried = [], 0
                            checkpoint()
                            workdir.progress(c.documents, 0, f"ingest: {src.name}")
                    continue
                if carry:  # a record after rows read whole: those rows join the buffer as documents
                    writer.buffer = [d for t in carry for d in table_documents(t)]
                    carry, carried = [], 0
                result = to_document(src, rec, root)
                pos = (si, fi, n)
                if isinstance(result, str):
                    qfile.write(json.dumps(quarantine_record(src, rec, result), ensure_ascii=False) + "\n")
                    pending["reasons"][result.split(":")[0]] += 1
                else:
                    if seen is not None:
                        here = rec.file + (f":{rec.line}" if rec.line is not None else "")
                        if result.id in seen:
                            raise ValueError(f"ingest source {src.name!r}: duplicate id {result.id!r} at {here}, "
                                             f"first seen at {seen[result.id]}; ids must be unique within the input")
                        seen[result.id] = here
                    taken += 1
                    pending["documents"] += 1
                    pending["bytes"] += len(result.text.encode())
                    pending["sources"][src.name] += 1
                    if writer.write(result) is not None:
                        checkpoint()
                        workdir.progress(c.documents, 0, f"ingest: {src.name}")
            pos = (si + 1, 0, 0)
        if carry:
            writer.write_rows(pa.concat_tables(carry).combine_chunks())
        writer.flush()
        checkpoint()
    finally:
        qfile.close()

    for p in shard_paths(shards_dir):
        _link_or_copy(p, workdir.out / p.name)
    shutil.copyfile(qpath, workdir.out / "quarantine.jsonl")
    return {
        "documents": c.documents,
        "text_bytes": c.text_bytes,
        "shards": c.shard,
        "quarantined": sum(reasons.values()),
        "quarantine_reasons": dict(sorted(reasons.items())),
        "documents_per_source": dict(sorted(per_source.items())),
    }

