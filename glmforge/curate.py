"""Run one curation step on its own: `glmforge curate STEP --input PATH --output PATH`.

The input (JSONL, Parquet or a folder of them or of text files; local or s3://) is read by the
ingest stage's reader into document shards, the step runs in a temporary workdir exactly as it
does in the pipeline, and its output is written to PATH:
- a directory or s3:// prefix receives everything the step wrote (shards, removed documents,
  reports, models);
- a `.jsonl` or `.parquet` file receives the kept documents, and the step's other files go to
  a sibling directory `<name>.files/`, so nothing the step produced is lost.

Document ids: a record's own `id` (a non-empty string or an integer) is its id in the output;
a record without one gets `<input name>/<file>#L<line>`. Two records with the same id stop the
run with an error naming both files and lines; other fields go to `metadata.fields`.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from json.encoder import encode_basestring  # what json.dumps(s, ensure_ascii=False) returns
from pathlib import Path
from typing import Any

from data_processing import ingest  # before pyarrow: the package sets Arrow's allocator

import pyarrow as pa
import pyarrow.parquet as pq

from data_processing.document import SCHEMA, read_documents, shard_paths, uncompressed_shards
from glmforge.config import ConfigError, parse_override, preset_section
from runtime.stage import StageSpec, Workdir
from runtime.store import open_store

# Root steps read raw inputs named in their config rather than document shards.
ROOT_INPUT_FIELD = {"issue-pr": "issues"}


def curation_steps() -> dict[str, StageSpec]:
    from glmforge.pipeline import CURATION

    return {s.name: s for s in CURATION if s.name != "ingest"}


def step_config(spec: StageSpec, preset: str, overrides: list[str], input_path: str | None) -> Any:
    """The step's section of `preset`, with `--set` overrides relative to the section."""
    section = preset_section(preset, spec.section)
    for item in overrides:
        key, value = parse_override(item)
        key = key.removeprefix(spec.section + ".")
        cur = section
        parts = key.split(".")
        for p in parts[:-1]:
            cur = cur[int(p)] if isinstance(cur, list) else cur.setdefault(p, {})
        cur[parts[-1]] = value
    if input_path is not None and spec.name in ROOT_INPUT_FIELD:
        section[ROOT_INPUT_FIELD[spec.name]] = [input_path]
    try:
        return spec.config_cls.model_validate(section)
    except Exception as e:  # pydantic ValidationError: name the step's fields
        raise ConfigError(f"curate {spec.name}: invalid config: {e}") from None


def documents_from(input_path: str, work: Path, text_field: str = "text", text_template: str | None = None) -> tuple[Path, dict[str, Any]]:
    """Read any supported input into document shards; returns (shard dir, ingest metrics)."""
    name = Path(input_path.rstrip("/")).stem.replace(".", "-") or "input"
    source = ingest.SourceConfig(name=name, path=input_path, text_field=text_field, text_template=text_template,
                                 keep_ids=True)
    cfg = ingest.IngestConfig(sources=[source], shard_size=5000)
    wd = Workdir.at(work / "ingest")
    with uncompressed_shards(wd.checkpoint / "shards"):  # scratch, read back here and deleted
        metrics = ingest.run(cfg, {}, wd)
    return wd.out, metrics


def check_documents(input_path: str, docs: Path, read: dict[str, Any], text_field: str,
                    text_template: str | None) -> None:
    """ValueError naming why `input_path` gave no document: the count of each quarantine reason,
    the first quarantined record, and for a missing text field the fields that record has and the
    options that choose the text. (The quarantine file is in a temporary folder removed on error.)"""
    if read.get("documents"):
        return
    if not read.get("quarantined"):
        raise ValueError(f"input {input_path}: no records found")
    counts = ", ".join(f"{reason} {n}" for reason, n in read["quarantine_reasons"].items())
    first = json.loads((docs / "quarantine.jsonl").read_text(encoding="utf-8").split("\n")[0])  # not splitlines(): U+2028
    where = f"{first['file']}:{first['line']}" if first.get("line") is not None else first["file"]
    msg = (f"input {input_path}: every record was quarantined ({counts}); first at {where}: "
           f"{first['reason'].partition(': ')[2] or first['reason']}")
    if "missing_text" in read["quarantine_reasons"]:
        try:
            record = json.loads(first.get("raw", ""))
        except (ValueError, TypeError):
            record = None
        if isinstance(record, dict):
            msg += f" (its fields: {', '.join(map(repr, record))})"
        msg += (f"; fix --text-template {text_template!r}" if text_template else
                f"; choose the text field with --text-field (now {text_field!r}) or build the text with --text-template")
    raise ValueError(msg)


def write_output(out_dir: Path, output: str) -> list[str]:
    """Write a step's output directory to `output` (see module doc). Returns what was written."""
    is_file = output.endswith((".jsonl", ".parquet"))
    remote = output.startswith("s3://")
    staging = Path(tempfile.mkdtemp(prefix="glmforge-curate-out-"))
    try:
        if is_file:
            name = output.rstrip("/").rsplit("/", 1)[-1]
            docs_file = staging / name
            _write_docs(out_dir, docs_file)
            extras = staging / f"{name}.files"
            for p in sorted(out_dir.rglob("*")):
                if p.is_file() and p.parent == out_dir and p in shard_paths(out_dir):
                    continue
                if p.is_file():
                    target = extras / p.relative_to(out_dir)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(p, target)
        else:
            shutil.copytree(out_dir, staging, dirs_exist_ok=True)
        written = [p.relative_to(staging).as_posix() for p in sorted(staging.rglob("*")) if p.is_file()]
        if remote:
            base = output.rsplit("/", 1)[0] if is_file else output
            open_store(base).push_dir(staging, "")
        else:
            dest = Path(output).parent if is_file else Path(output)
            dest.mkdir(parents=True, exist_ok=True)
            _move_tree(staging, dest)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_tree(src: Path, dest: Path) -> None:
    """shutil.copytree(src, dest, dirs_exist_ok=True), each file renamed into place where it can
    be (the same file system: no copy) and copied where not; src is left to be removed."""
    for p in sorted(src.rglob("*")):
        target = dest / p.relative_to(src)
        if p.is_dir():
            target.mkdir(exist_ok=True)
            continue
        try:
            os.replace(p, target)
        except OSError:
            shutil.copy2(p, target)


def _write_docs(shards: Path, path: Path) -> None:
    if path.suffix == ".parquet":
        tables = [pq.read_table(p) for p in shard_paths(shards)]
        pq.write_table(pa.concat_tables(tables) if tables else SCHEMA.empty_table(), path, compression="zstd")
        return
    with open(path, "w", encoding="utf-8") as f:
        for d in read_documents(shards):     # the metadata as stored: JSON already, never decoded here
            f.write(f'{{"id": {_json_string(d.id)}, "text": {_json_string(d.text)}, '
                    f'"source": {_json_string(d.source)}, "metadata": {d.metadata_json()}}}\n')


def _json_string(value: Any) -> str:
    """json.dumps(value, ensure_ascii=False): for a string, the escaping function it calls
    (json.dumps builds a JSONEncoder on every call with non-default options)."""
    return encode_basestring(value) if type(value) is str else json.dumps(value, ensure_ascii=False)


def curate(
    step: str,
    input_path: str,
    output: str,
    overrides: list[str] | None = None,
    extra_inputs: dict[str, str] | None = None,
    preset: str = "tiny",
    seed: int = 0,
    text_field: str = "text",
    text_template: str | None = None,
) -> dict[str, Any]:
    """Run one curation step on `input_path`, write to `output`; returns the step's metrics."""
    steps = curation_steps()
    if step not in steps:
        raise ValueError(f"unknown curation step {step!r}; steps: {', '.join(steps)}")
    spec = steps[step]
    cfg = step_config(spec, preset, list(overrides or []), input_path)  # validated before any work
    extra_inputs = dict(extra_inputs or {})
    unknown = set(extra_inputs) - set(spec.parents)
    if unknown:
        raise ValueError(f"--with {sorted(unknown)}: {step} takes inputs from {list(spec.parents) or 'none'}")
    with tempfile.TemporaryDirectory(prefix=f"glmforge-curate-{step}-") as tmp:
        work = Path(tmp)
        inputs: dict[str, Path] = {}
        read: dict[str, Any] = {}
        if spec.parents:
            docs, read = documents_from(input_path, work, text_field, text_template)
            if set(spec.parents) - set(extra_inputs):  # the step reads these documents
                check_documents(input_path, docs, read, text_field, text_template)
            for parent in spec.parents:
                inputs[parent] = Path(extra_inputs.get(parent, docs))
                if not inputs[parent].exists():
                    raise FileNotFoundError(f"--with {parent}={inputs[parent]}: no such directory")
        wd = Workdir.at(work / step, seed=seed)
        # kept shards that become one output file are scratch too (removed/ ones are output)
        with uncompressed_shards(*([wd.out] if output.endswith((".jsonl", ".parquet")) else [])):
            metrics = spec.run(cfg, inputs, wd)
        if read.get("quarantined"):  # bad input records are part of the output, not lost
            shutil.copyfile(work / "ingest" / "out" / "quarantine.jsonl", wd.out / "input_quarantine.jsonl")
        written = write_output(wd.out, output)
    return {"step": step, "input": read, "metrics": metrics, "written": written}
