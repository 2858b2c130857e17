"""Shared tiny fixtures for the rl-general / distill / gates tests: a tokenizer with the chat
template's special tokens and small random models saved as stage artifacts."""
from __future__ import annotations

from pathlib import Path

from model.hf import save_state
from tests.rl.conftest import small_model

TEXTS = [" 1 2 + 3 4 = 6 4 0", " 9 9 + 9 9 = 8 9 1", "What is 3 plus 4? The answer is 7.",
         "def add(a, b):\n    return a + b\n", "45 is 40+5, so 45. #### 45"] * 40


def make_tokenizer(texts=TEXTS, vocab: int = 300):
    from data_processing.tokenizer import train_tokenizer

    return train_tokenizer(texts, vocab_size=vocab, min_frequency=2)


def artifacts(root: Path, tok, stages: dict[str, int]) -> dict[str, Path]:
    """tokenize/ plus one consolidated.safetensors per stage (name -> model seed)."""
    (root / "tokenize").mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenize" / "tokenizer.json"))
    out = {"tokenize": root / "tokenize"}
    for name, seed in stages.items():
        save_state(small_model(tok.get_vocab_size(), seed=seed), root / name / "consolidated.safetensors")
        out[name] = root / name
    return out
