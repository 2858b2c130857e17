"""Pieces every curation step shares: the config base class, text normalisation, checked
input reading, readers for labelled text sources, and content digests of the raw files a stage
reads (its key's fingerprint). The keep-or-drop filter base is data_processing.filtering.
"""
from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import sysconfig
import unicodedata
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from data_processing.document import Document, read_documents, read_shard, shard_paths

# The repo's real sample data (see samples/SOURCES.md); config paths may say {samples}. An
# installed package carries it as data_processing/samples (pyproject package-data).
_PKG_SAMPLES = Path(__file__).resolve().parent / "samples"
SAMPLES_DIR = _PKG_SAMPLES if _PKG_SAMPLES.is_dir() else Path(__file__).resolve().parents[1] / "samples"


class StepConfig(BaseModel):
    """Base of every stage config: frozen, unknown keys rejected (a typo is an error)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class DaskConfig(StepConfig):
    """Run a dedup stage's shard-level steps (data_processing.sharded_dedup) as Prefect tasks on
    prefect-dask's DaskTaskRunner (tasks/dask_dedup.py) instead of in one process. The output is
    the same either way, so the whole section is operational: it stays out of the stage key.

    address unset: a LocalCluster of `workers` worker processes (threads with processes=False)
    started for the stage. address set ("tcp://scheduler:8786"): that cluster's workers run the
    tasks; they read the input and write scratch and output under $GLMFORGE_HOME, which must
    then be storage every worker mounts at the same path.
    shards_per_task: input shards one Prefect task handles (each other step is cut into the same
    number of tasks); more per task = less Prefect overhead, fewer tasks to spread."""

    address: str | None = Field(None, description=(
        "a running Dask scheduler (tcp://scheduler:8786) whose workers run the tasks; unset: a LocalCluster "
        "started for the stage"))
    workers: int = Field(default=2, ge=1, description="worker processes of the LocalCluster (address unset)")
    threads_per_worker: int = Field(default=1, ge=1, description="threads in each LocalCluster worker")
    processes: bool = Field(True, description=(
        "LocalCluster workers as processes; False: threads in the flow's process (fast start, for tests)"))  # False: worker threads in the flow's process (fast start, for tests)
    shards_per_task: int = Field(default=1, ge=1, description=(
        "input shards one Prefect task handles; more per task: less Prefect overhead, fewer tasks to spread"))
    partitions: int = Field(default=0, ge=0, description="exact-dedup shuffle partitions; 0 = one per task")

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"(?:(?:tcp|tls|ucx|ws|wss)://)?[^\s/:]+:\d+", v):
            raise ValueError(f"{v!r} is not a Dask scheduler address like tcp://scheduler:8786")
        return v

    @model_validator(mode="after")
    def _local_fields_need_no_address(self) -> "DaskConfig":
        local = {"workers", "threads_per_worker", "processes"} & self.model_fields_set
        if self.address is not None and local:
            raise ValueError(f"{', '.join(sorted(local))}: sizes the LocalCluster, not used with address "
                             f"{self.address} (that cluster's workers run the tasks)")
        return self


def expand_placeholders(s: str) -> str:
    """Resolve the placeholders configs may use: {stdlib} (this Python's standard library)
    and {samples} (the repo's samples/), so presets stay portable across machines."""
    return s.replace("{stdlib}", sysconfig.get_paths()["stdlib"]).replace("{samples}", str(SAMPLES_DIR))


def expand_path(p: str | Path) -> Path:
    return Path(expand_placeholders(str(p))).expanduser()


# ---------------------------------------------------------------------------------------------
# Normalisation shared by exact dedup and decontamination.
_WS = re.compile(r"\s+")
_WORD = re.compile(r"\w+")


def normalize_text(text: str) -> str:
    """NFKC, casefold, collapse every whitespace run to one space, strip the ends."""
    return _WS.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def normalized_words(text: str) -> list[str]:
    """Word tokens of normalize_text(text); punctuation is dropped (so `x=1` and `x = 1` agree)."""
    return _WORD.findall(normalize_text(text))


# ---------------------------------------------------------------------------------------------
# Reading a parent's shards, every record checked.
def check_document(doc: Document, where: str) -> None:
    """Raise a ValueError naming the shard and document when a record is not a usable Document."""
    if not isinstance(doc.text, str):
        raise ValueError(f"{where}: document {doc.id!r}: field 'text' must be a string, got {type(doc.text).__name__}")
    if not isinstance(doc.id, str) or not doc.id:
        raise ValueError(f"{where}: document with text {doc.text[:40]!r}: field 'id' is missing or empty")


def iter_input_documents(directory: Path) -> Iterator[Document]:
    """Documents of a parent's shard directory, each checked (text is a string, id present)."""
    directory = Path(directory)
    if not shard_paths(directory):
        raise ValueError(f"{directory}: no part-*.parquet shards found (is this the parent's output?)")
    for path in shard_paths(directory):
        for doc in read_shard(path):
            check_document(doc, str(path))
            yield doc


def count_documents(directory: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in shard_paths(directory))


# ---------------------------------------------------------------------------------------------
# Labelled / raw text sources (quality classifier training, eval sets, tokenizer corpora).
class TextSource(StepConfig):
    """Where to read real text from.

    path: a file or directory; {stdlib} and {samples} are expanded.
    glob: files to take inside a directory (sorted, so the choice is reproducible).
    fields: for .jsonl/.json, the keys whose string values are joined into one text
        (dotted keys reach nested objects, e.g. "object.body"); ("*",) takes the raw JSON
        record; ignored for other files.
    unit: how a file becomes texts: the whole file, blank-line paragraphs, lines, or (for .py)
        the module/class/function docstrings.
    transform: "shuffle_words" shuffles each text's words (seeded) - a real-text negative
        class for the quality classifier: same vocabulary, no syntax.
    """

    path: str = Field(description="a file or directory; {stdlib} and {samples} are expanded")
    glob: str = Field("*", description="the files to take inside a directory (sorted, so the choice is reproducible)")
    fields: tuple[str, ...] = Field(("text",), description=(
        "for .jsonl/.json: the keys whose string values are joined into one text (dotted keys reach nested "
        "objects); [\"*\"]: the raw JSON record"))
    unit: Literal["file", "paragraph", "line", "docstring"] = Field("file", description=(
        "how a file becomes texts: the whole file, blank-line paragraphs, lines, or (for .py) its "
        "docstrings"))
    transform: Literal["none", "shuffle_words"] = Field("none", description=(
        "shuffle_words: each text's words shuffled (seeded), a real-text negative class for the quality "
        "classifier"))
    min_chars: int = Field(default=1, ge=0, description="texts shorter than this (after stripping) are dropped")
    limit: int | None = Field(default=None, ge=1, description="at most this many texts from the source; null: all")

    @field_validator("path")
    @classmethod
    def _path_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("path must not be empty")
        return v


def _get_field(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = ast.get_docstring(node)
            if d:
                out.append(d)
    return out


def _split(text: str, unit: str) -> list[str]:
    if unit == "file":
        return [text]
    if unit == "paragraph":
        return [p for p in re.split(r"\n\s*\n", text)]
    if unit == "line":
        return text.splitlines()
    return _docstrings(text)


def _texts_of_file(path: Path, src: TextSource) -> Iterator[str]:
    if path.suffix in (".jsonl", ".json"):
        raw = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".json":
            try:
                records = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: invalid JSON: {e}") from e
            if not isinstance(records, list):
                raise ValueError(f"{path}: expected a JSON array of objects")
            numbered = list(enumerate(records, 1))
        else:
            numbered = []
            for lineno, line in enumerate(raw.split("\n"), 1):  # not splitlines(): U+2028 may sit in a string
                if not line.strip():
                    continue
                try:
                    numbered.append((lineno, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from e
        for lineno, rec in numbered:
            if src.fields == ("*",):  # the raw record itself (e.g. API responses as noise)
                parts = [json.dumps(rec, ensure_ascii=False)]
            else:
                parts = [v for f in src.fields if isinstance(v := _get_field(rec, f), str)]
            if parts:
                yield from _split("\n\n".join(parts), "file" if src.unit == "docstring" else src.unit)
    elif path.suffix == ".parquet":
        for doc in read_shard(path):
            yield from _split(doc.text, src.unit)
    else:
        yield from _split(path.read_text(encoding="utf-8", errors="replace"), src.unit)


def source_files(src: TextSource) -> list[Path]:
    root = expand_path(src.path)
    if root.is_file():
        return [root]
    if root.is_dir():
        return sorted(p for p in root.glob(src.glob) if p.is_file())
    raise ValueError(f"text source {src.path!r}: {root} does not exist")


def read_text_source(src: TextSource, seed: int = 0) -> list[str]:
    """The texts of one source (at most src.limit), stripped, shorter than min_chars dropped."""
    rng = random.Random(seed)
    out: list[str] = []
    for path in source_files(src):
        for t in _texts_of_file(path, src):
            t = t.strip()
            if len(t) < max(src.min_chars, 1):
                continue
            if src.transform == "shuffle_words":
                words = t.split()
                rng.shuffle(words)
                t = " ".join(words)
            out.append(t)
            if src.limit is not None and len(out) >= src.limit:
                return out
    return out


def content_digest(paths: Iterable[Path]) -> str:
    """sha256 over the contents of files, in the given order: part of a stage key, so edited raw
    data is not served from cache. Contents, not names or mtimes, so a fresh clone at another
    path gets the same key."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())  # per file: no ambiguous concatenation
    return h.hexdigest()


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
            n += 1
    return n


__all__ = [
    "StepConfig",
    "TextSource",
    "normalize_text",
    "normalized_words",
    "expand_path",
    "read_text_source",
    "iter_input_documents",
    "count_documents",
    "content_digest",
    "read_documents",
    "SAMPLES_DIR",
]
