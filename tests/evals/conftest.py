from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny ops on a shared 2-core machine: more threads only add contention.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def shakespeare() -> str:
    return (REPO / "samples/tinyshakespeare/input.txt").read_text()


@pytest.fixture(scope="session")
def tokenizer(shakespeare):
    """A small byte-level BPE trained on the haystack corpus, as the pipeline trains its own."""
    from data_processing.tokenizer import train_tokenizer

    return train_tokenizer([shakespeare[:300_000]], vocab_size=1024)
