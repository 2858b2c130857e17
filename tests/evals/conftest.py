from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def shakespeare() -> str:
    return (REPO / "samples/tinyshakespeare/input.txt").read_text()


@pytest.fixture(scope="session")
def tokenizer(shakespeare):
    """A small byte-level BPE trained on the haystack corpus, as the pipeline trains its own."""
    from data_processing.tokenizer import train_tokenizer

    return train_tokenizer([shakespeare[:300_000]], vocab_size=1024)
