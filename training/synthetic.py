"""Synthetic token tasks mixed into a training stage's packed text, on ids reserved above the
tokenizer's vocabulary.

Why: a model of a few hundred thousand parameters trained for minutes learns too little from
text alone to show what attention variants or INT4 do to it. Tasks a small model learns fast
make the effects measurable (Zoology, Arora et al. 2023):
  copy   induction warm-up: a random run repeated at a random offset (evals.mqar.copy_batch);
         a repeat at a fixed offset would be solved positionally and teach nothing that MQAR uses
  mqar   multi-query associative recall (evals.mqar): key/value pairs, queried later, the answer
         in the context; what the long-context comparison scores at every length

  facts  two-token fact recall "a b v" from one fixed table (evals.mqar.fact_batch): the
         answer is stored in the weights, not the context, which is what INT4 can damage; the
         task the QAT-vs-PTQ comparison scores (sft)

Reserved ids: the tokenizer's vocabulary ends at `base`; the model's vocabulary is
base + RESERVED_IDS. MQAR keys are [base, base + 64), values [base + 64, base + 128) (copy runs
draw from those 128); facts take the next 64 first-key, 64 second-key and 128 value ids (4,096
facts). Text never contains them, so a task token is never confused with a word, and the filler
between MQAR pairs is drawn from the text ids [FIRST_FILLER_ID, base).

Each document carries a loss mask: copy trains the copyable tokens, MQAR the queries' values,
facts the values. data_processing.packing.with_samples
appends them to the stage's packed text (whose tokens all stay targets).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from data_processing.packing import META, with_samples
from evals.mqar import IGNORE, MQARSpec, copy_batch, fact_batch, fact_table, mqar_samples

KEYS = 64
MQAR_IDS = 128              # 64 keys + 64 values; copy runs draw from them too
FACT_KEYS, FACT_VALUES = 64, 128
RESERVED_IDS = MQAR_IDS + 2 * FACT_KEYS + FACT_VALUES
FACTS_SEED = "glmforge"     # one table for every stage and evaluation
FIRST_FILLER_ID = 32        # above the special tokens


class SyntheticDocs(BaseModel):
    """`count` documents of one task, `length` tokens each; several share a packed sequence when
    they fit (attention and positions restart per document)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task: Literal["copy", "mqar", "facts"] = Field(description=(
        "copy (induction warm-up), mqar (multi-query associative recall, answer in the context) or facts "
        "(two-token fact recall from one fixed table, answer in the weights)"))
    length: int = Field(ge=16, description="tokens per document")
    count: int = Field(ge=1, description="documents of this task added to the training split")


class SyntheticConfig(BaseModel):
    """Synthetic documents added to a stage's training split (counts, not shares: the loader
    samples sequences uniformly, so a task's share is its sequences over all sequences)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    docs: tuple[SyntheticDocs, ...] = Field(min_length=1, description=(
        "the synthetic documents, one entry per task and length (at least one)"))
    mqar_pairs: int = Field(16, ge=1, le=KEYS, description="key-value pairs per MQAR document")
    seed: int = Field(0, description="the evaluation draws its documents from another stream")

    @model_validator(mode="after")
    def _check(self) -> "SyntheticConfig":
        for i, d in enumerate(self.docs):
            if d.task == "mqar":
                try:
                    mqar_spec(FIRST_FILLER_ID + 1, d.length, self.mqar_pairs)
                except ValueError as e:
                    raise ValueError(f"synthetic.docs[{i}]: {e}") from None
        return self


def mqar_spec(base: int, seq_len: int, n_pairs: int) -> MQARSpec:
    """The pipeline's MQAR layout for a tokenizer of `base` ids: pairs first, queries spread over
    the rest of the sequence (so query-to-key distances span the whole length)."""
    if base <= FIRST_FILLER_ID:
        raise ValueError(f"a vocabulary of {base} ids leaves no text ids for MQAR filler")
    return MQARSpec(seq_len=seq_len, n_pairs=n_pairs, key_ids=(base, base + KEYS),
                    value_ids=(base + KEYS, base + MQAR_IDS), filler_ids=(FIRST_FILLER_ID, base),
                    layout="pairs_first")


def copy_samples(base: int, seq_len: int, n: int, seed: int | str) -> list[tuple[list[int], list[int]]]:
    """n copy documents as (ids, loss mask); the mask is 1 on a token that a target predicts."""
    if n == 0:
        return []
    return _with_masks(copy_batch(seq_len, n, (base, base + MQAR_IDS), f"{seed}"))


def facts(base: int) -> tuple[int, int, torch.Tensor]:
    """(first key id, second key id, table [64, 64] of value ids): the fixed fact table."""
    first = base + MQAR_IDS
    values = (first + 2 * FACT_KEYS, first + 2 * FACT_KEYS + FACT_VALUES)
    return first, first + FACT_KEYS, fact_table(FACT_KEYS, FACT_KEYS, values, FACTS_SEED)


def facts_batch(base: int, seq_len: int, n: int, seed: int | str) -> dict[str, torch.Tensor]:
    first, second, table = facts(base)
    return fact_batch(seq_len, n, first, second, table, seed)


def facts_samples(base: int, seq_len: int, n: int, seed: int | str) -> list[tuple[list[int], list[int]]]:
    return _with_masks(facts_batch(base, seq_len, n, seed)) if n else []


@torch.no_grad()
def facts_scores(model: torch.nn.Module, base: int, n_docs: int, seed: int | str, seq_len: int = 66,
                 batch_size: int = 16) -> dict[str, float]:
    """Teacher-forced fact recall on n_docs held-out documents (their own seed stream): greedy
    accuracy and answer perplexity (exp of the mean NLL of the right value) over every fact."""
    was_training = model.training
    model.eval()
    hits, nll, n = 0, 0.0, 0
    try:
        for s in range(0, n_docs, batch_size):
            b = facts_batch(base, seq_len, min(batch_size, n_docs - s), f"eval/{seed}/{s}")
            logits = model(b["input_ids"]).logits.float()
            mask = b["labels"] != IGNORE
            hits += int((logits.argmax(-1)[mask] == b["labels"][mask]).sum())
            nll += float(torch.nn.functional.cross_entropy(logits[mask], b["labels"][mask], reduction="sum"))
            n += int(mask.sum())
    finally:
        model.train(was_training)
    return {"acc": hits / n, "ppl": math.exp(nll / n), "n": n}


def _with_masks(b: dict[str, torch.Tensor]) -> list[tuple[list[int], list[int]]]:
    ids, labels = b["input_ids"], b["labels"]
    mask = torch.zeros_like(ids)
    mask[:, 1:] = (labels[:, :-1] != IGNORE).long()     # labels[t] predicts token t + 1
    return list(zip(ids.tolist(), mask.tolist()))


def samples(cfg: SyntheticConfig, base: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """The stage's synthetic training samples, deterministic in (cfg, base, seed)."""
    out = []
    for i, d in enumerate(cfg.docs):
        stream = f"train/{cfg.seed}/{seed}/{i}"
        if d.task == "copy":
            out += copy_samples(base, d.length, d.count, stream)
        elif d.task == "facts":
            out += facts_samples(base, d.length, d.count, stream)
        else:
            out += mqar_samples(mqar_spec(base, d.length, cfg.mqar_pairs), d.count, stream)
    return out


def check_vocab(model_vocab: int, base: int, where: str) -> None:
    if model_vocab < base + RESERVED_IDS:
        raise ValueError(f"{where}: synthetic tasks need vocab_size >= tokenizer's {base} + {RESERVED_IDS} "
                         f"reserved ids, the model has {model_vocab} (pretrain without synthetic data?)")


MARKER = "MIXED"


def mix_into(src: Path, out: Path, cfg: SyntheticConfig, base: int, seed: int) -> dict:
    """Pack (once) the text sequences at `src` plus this config's synthetic training samples into
    `out`; meta["synthetic"] records the id layout so a stage can check its model's vocabulary.
    A MARKER written last makes a retried stage reuse the result."""
    out = Path(out)
    if (out / MARKER).exists():
        return json.loads((out / META).read_text())
    shutil.rmtree(out, ignore_errors=True)
    seq_len = int(json.loads((Path(src) / META).read_text())["seq_len"])
    too_long = [d.length for d in cfg.docs if d.length > seq_len]
    if too_long:
        raise ValueError(f"synthetic.docs lengths {too_long} exceed the stage's seq_len {seq_len}")
    meta = with_samples(src, out, {"train": samples(cfg, base, seed)})
    meta["synthetic"] = {"base": base, "reserved": RESERVED_IDS, "mqar_pairs": cfg.mqar_pairs,
                         "docs": [d.model_dump() for d in cfg.docs]}
    (out / META).write_text(json.dumps(meta, indent=2))
    (out / MARKER).write_text("")
    return meta
