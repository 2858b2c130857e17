import pytest
import torch

from model.config import tiny
from model.model import GLMModel


class Killed(Exception):
    """A stage stopped by its progress callback: a kill at a chosen point of its loop."""


def kill_at(done_at: int):
    """A workdir progress callback that raises Killed when the stage reports `done_at` done."""
    def progress(done: int, total: int, desc: str) -> None:
        if done == done_at:
            raise Killed
    return progress


def small_model(seed: int = 0, **overrides) -> GLMModel:
    """tiny() cut to 2 layers (one dense, one MoE) + MTP depth 1, vocab 512: every module kind
    QAT touches, in well under a second per forward."""
    torch.manual_seed(seed)
    return GLMModel(tiny().replace(**{"vocab_size": 512, "num_layers": 2, "mtp_depth": 1, **overrides}))


@pytest.fixture(scope="session")
def tokenizer():
    from data_processing.tokenizer import train_tokenizer

    texts = ["What is the weather in Paris today? It is sunny and 20 degrees.",
             "def add(a, b):\n    return a + b\n", "Let me think step by step about the problem.",
             '{"city": "Paris", "days": 3, "unit": "celsius"}', "Thanks! You're welcome."] * 20
    return train_tokenizer(texts, vocab_size=400, min_frequency=2)
