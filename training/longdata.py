"""Long-context data for a context-extension phase, packed from the curated documents.

The mix favours what long contexts are for: repository-level code (a repository's files
concatenated, data_processing.packing.repo_documents), issue-PR threads and long documents.
Each document gets a sampling weight = its quality weight (from the quality stage, 1 if none)
x the weight of its `source` (mix.sources, else mix.default_weight) x mix.long_weight when it
has at least mix.long_chars characters. Under mix.max_chars the heaviest documents are kept,
the last one cut at a line end to fit (a repository-level document can be the whole corpus:
tiny's stdlib is one 10M-character repository, which took 20 s a phase to tokenize for a
phase that trains on a few hundred thousand tokens); data_processing.packing.pack then repeats each document min(weight, mix.max_repeats) times,
shuffles and packs seq_len windows (with a held-out split, never up-sampled).

`extra` documents (synthetic retrieval documents from evals.long_context, see pack_stage_data)
join the mix after the max_chars cap, once each, whatever the weights: they are
what the caller asked for, not a sample of the corpus.

The packed data lives in the stage's checkpoint directory with a PACKED marker written last,
so a retried stage reuses it instead of packing again.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, Sequence

from data_processing.common import iter_input_documents
from data_processing.document import Document
from data_processing.packing import WHOLE, PackConfig, pack, repo_documents
from data_processing.tokenizer import load_tokenizer
from evals import long_context
from runtime.stage import Workdir
from training import synthetic
from training.config import LongDataConfig, MixConfig

MARKER = "PACKED"


def mix_weight(doc: Document, mix: MixConfig) -> float:
    quality = float((doc.metadata.get("quality") or {}).get("weight", 1.0))
    w = quality * mix.sources.get(doc.source, mix.default_weight)
    return w * mix.long_weight if len(doc.text) >= mix.long_chars else w


def pack_long(docs_dir: Path, tokenizer_dir: Path, out: Path, seq_len: int, mix: MixConfig,
              val_fraction: float, seed: int, extra: Sequence[Document] = ()) -> dict[str, Any]:
    """Pack (once) into `out`; returns the packing meta plus the mix statistics."""
    out = Path(out)
    if (out / MARKER).exists():
        return json.loads((out / MARKER).read_text())
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    docs = list(iter_input_documents(Path(docs_dir)))
    if mix.repo_level:
        docs = repo_documents(docs)
    weighted = [(d, mix_weight(d, mix)) for d in docs if len(d.text) >= mix.min_chars]
    weighted = [(d, w) for d, w in weighted if w > 0]
    if mix.max_chars is not None:
        # A phase that trains on a few thousand sequences need not pack the whole corpus: fill
        # max_chars with the most favoured documents first (ties in a seeded random order). A
        # weighted random sample would let hundreds of mid-weight documents crowd out the few
        # heavy ones (repo-level code, issue-PR threads) the phase is for.
        rng = random.Random(seed)
        order = {id(d): rng.random() for d, _ in weighted}
        weighted.sort(key=lambda dw: (-dw[1], order[id(dw[0])]))
    kept: list[Document] = []
    by_source: dict[str, float] = {}
    chars = 0
    for d, w in weighted:
        text = d.text
        if mix.max_chars is not None:
            left = mix.max_chars - chars
            if left <= 0:
                break
            if len(text) > left:
                cut = text.rfind("\n", 0, left) + 1
                text, chars = text[: cut or left], mix.max_chars   # the budget is spent
        chars += len(text)
        repeats = min(w, mix.max_repeats)
        kept.append(Document(d.id, text, d.source, {**d.metadata, "quality": {"weight": repeats}}))
        by_source[d.source] = by_source.get(d.source, 0.0) + repeats * len(text)
    for d in extra:   # synthetic retrieval documents: whole, or the question loses its needle
        kept.append(Document(d.id, d.text, d.source, {**d.metadata, "quality": {"weight": 1.0}, WHOLE: True}))
        by_source[d.source] = by_source.get(d.source, 0.0) + len(d.text)
    if len(kept) < 2:
        raise ValueError(f"the long-context mix keeps {len(kept)} document(s) of {len(docs)}: "
                         "lower mix.min_chars or raise the source weights")
    total = sum(by_source.values())
    meta = pack(kept, load_tokenizer(Path(tokenizer_dir)),
                PackConfig(seq_len=seq_len, val_fraction=val_fraction, upsample=True, repo_level=False,
                           fim_rate=0.0, seed=seed), out)
    if meta["splits"]["val"]["sequences"] == 0:
        raise ValueError("the long-context mix has no held-out sequences: raise val_fraction")
    meta["mix_chars_share"] = {s: round(v / total, 4) for s, v in sorted(by_source.items())}
    meta["documents_in_mix"] = len(kept)
    meta["extra_documents"] = len(extra)
    (out / MARKER).write_text(json.dumps(meta))
    return meta


def pack_stage_data(cfg: LongDataConfig, inputs: dict[str, Path], workdir: Workdir) -> tuple[Path, dict[str, Any]]:
    """A long-data stage's mix + its retrieval documents, packed once into
    workdir.checkpoint/packed (persisted, so a retried stage does not pack again)."""
    data_dir = workdir.checkpoint / "packed"
    text_dir = workdir.checkpoint / "packed-text" if cfg.synthetic else data_dir
    if (data_dir / (synthetic.MARKER if cfg.synthetic else MARKER)).exists():   # a retry: reuse it
        return data_dir, json.loads((text_dir / MARKER).read_text())
    r = cfg.retrieval
    extra = long_context.key_value_documents(r.key_value_docs, r.seed)
    if r.docs_per_task:
        tok = load_tokenizer(Path(inputs["tokenize"]))
        extra += long_context.training_documents(tok, r.lengths, r.docs_per_task, r.seed,
                                                 long_context.default_filler_texts(), r.tasks)
    seed = workdir.seed + cfg.seed_offset
    meta = pack_long(inputs["decontaminate"], inputs["tokenize"], text_dir, cfg.seq_len, cfg.mix,
                     cfg.val_fraction, seed, extra=extra)
    if cfg.synthetic:
        base = load_tokenizer(Path(inputs["tokenize"])).get_vocab_size()
        synthetic.mix_into(text_dir, data_dir, cfg.synthetic, base, seed)
    workdir.persist_checkpoint()
    return data_dir, meta
