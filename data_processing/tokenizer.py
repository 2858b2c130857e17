"""Byte-level BPE tokenizer trained on the curated corpus (HF `tokenizers`).

Byte-level: every UTF-8 byte maps to one of 256 base symbols, no normaliser, no prefix space,
so decode(encode(text)) == text for any string (emoji, CJK, control characters included).
The special tokens later stages need are added tokens with fixed ids 0..len-1; a document that
literally contains one of them (e.g. the text "<think>") is encoded to that special id - it
still decodes to the same text.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Iterable, Iterator

from pydantic import Field

from data_processing.common import StepConfig, iter_input_documents
from runtime.stage import Workdir

SPECIAL_TOKENS: list[str] = [
    "<|endoftext|>",
    "<|pad|>",
    # chat roles; <|observation|> carries tool results (GLM style)
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    # reasoning and tool calls
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
    # fill-in-the-middle
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    # repository-level code
    "<|repo_name|>",
    "<|file_sep|>",
]
EOS, PAD = "<|endoftext|>", "<|pad|>"
TOKENIZER_FILE = "tokenizer.json"


class TokenizeConfig(StepConfig):
    vocab_size: int = Field(default=8192, ge=len(SPECIAL_TOKENS) + 256 + 1, description=(
        "BPE vocabulary size, special tokens and the 256 bytes included"))
    min_frequency: int = Field(default=2, ge=1, description="pairs seen fewer times than this are not merged")
    max_training_chars: int = Field(default=50_000_000, ge=1000, description="train on at most this much text (a seeded sample)")
    seed: int = Field(0, description="seed of the training sample (max_training_chars)")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    p = Path(path)
    return Tokenizer.from_file(str(p / TOKENIZER_FILE if p.is_dir() else p))


def special_ids(tok) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def _sample_texts(parent: Path, max_chars: int, seed: int) -> Iterator[str]:
    """A seeded Bernoulli sample of the corpus of about max_chars characters (every document
    when the corpus is smaller)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from data_processing.document import shard_paths

    total = sum(pc.sum(pc.utf8_length(pq.read_table(p, columns=["text"])["text"])).as_py() or 0 for p in shard_paths(parent))
    keep = min(1.0, max_chars / max(1, total))
    rng = random.Random(seed)
    for doc in iter_input_documents(parent):
        if rng.random() < keep:
            yield doc.text


def run(cfg: TokenizeConfig, inputs: dict[str, Path], workdir: Workdir) -> dict:
    parents = list(inputs.values())
    workdir.progress(0, 1, "training tokenizer")
    texts = (t for p in parents for t in _sample_texts(p, cfg.max_training_chars, cfg.seed))
    tok = train_tokenizer(texts, cfg.vocab_size, cfg.min_frequency)
    tok.save(str(workdir.out / TOKENIZER_FILE))
    workdir.progress(1, 1, "training tokenizer")
    # bytes per token on (up to) 200 documents: a quick compression figure
    sample = [d.text for p in parents for _, d in zip(range(200), iter_input_documents(p))]
    n_bytes = sum(len(t.encode()) for t in sample)
    n_tok = sum(len(e.ids) for e in tok.encode_batch(sample)) if sample else 0
    return {
        "vocab_size": tok.get_vocab_size(),
        "special_tokens": len(SPECIAL_TOKENS),
        "bytes_per_token": n_bytes / n_tok if n_tok else 0.0,
    }
