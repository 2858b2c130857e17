import pytest
import torch

from model.config import tiny
from model.model import GLMModel


def small_model(vocab: int, seed: int = 0) -> GLMModel:
    torch.manual_seed(seed)
    return GLMModel(tiny().replace(vocab_size=vocab, num_layers=2, mtp_depth=0, hidden_size=32, num_heads=2,
                                   q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                   v_head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                                   n_routed_experts=4, num_experts_per_tok=2))


@pytest.fixture(scope="session")
def tokenizer():
    from data_processing.tokenizer import train_tokenizer

    texts = [" 1 2 + 3 4 = 6 4 0", " 9 9 + 9 9 = 8 9 1", "What is 3 plus 4? The answer is 7.",
             "def add(a, b):\n    return a + b\n", "45 is 40+5, so 45."] * 30
    return train_tokenizer(texts, vocab_size=300, min_frequency=2)
