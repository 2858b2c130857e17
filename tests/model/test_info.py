"""Analytic parameter counts, FLOPs and KV bytes."""

import pytest
import torch

from model.config import preset
from model.info import flops_per_token, kv_cache_bytes_per_token, param_counts, summary
from model.model import GLMModel


def test_glm5_published_figures():
    s = summary(preset("glm5"))
    assert round(s["total_params"] / 1e9, 2) == 743.91           # no MTP, with input embedding
    assert round(s["active_params"] / 1e9, 2) == 40.83           # no MTP, no input embedding
    assert s["total_params_without_embedding"] == s["total_params"] - 154880 * 6144
    assert s["total_params_with_mtp"] > s["total_params"]
    # 78 layers x (512 latent + 64 rope + 128 index key) x 2 bytes
    assert s["kv_cache_bytes_per_token"] == 78 * (512 + 64 + 128) * 2


@pytest.mark.parametrize("overrides", [
    {},
    {"attention_pattern": ("full", "swa", "dsa", "swa"), "tie_word_embeddings": True, "mtp_depth": 0},
    {"n_shared_experts": 2, "first_k_dense": 2},
])
def test_analytic_count_equals_instantiated_model(overrides):
    cfg = preset("tiny", **overrides)
    m = GLMModel(cfg)
    real = sum(p.numel() for p in m.parameters())  # shared (tied) tensors are counted once
    assert param_counts(cfg).total_with_mtp == real
    no_mtp = real - (sum(p.numel() for p in m.mtp.parameters()) if m.mtp is not None else 0)
    assert param_counts(cfg).total_with_embedding == no_mtp


def test_active_counts_only_topk_experts():
    cfg = preset("tiny")
    p = param_counts(cfg)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    moe_layers = cfg.num_layers - cfg.first_k_dense
    assert p.total - p.active == moe_layers * (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert


def test_flops_dsa_below_dense_at_long_context_and_kv_bytes():
    cfg = preset("glm5")
    assert flops_per_token(cfg, 2048, sparse=True) == flops_per_token(cfg, 2048, sparse=False) + \
        cfg.num_layers * 2 * cfg.index_n_heads * cfg.index_head_dim * 2048
    assert flops_per_token(cfg, 131072, sparse=True) < 0.3 * flops_per_token(cfg, 131072, sparse=False)
    tiny = preset("tiny")
    m = GLMModel(tiny).eval()
    cache = m.new_cache()
    with torch.no_grad():
        m(torch.randint(0, 8192, (1, 10)), cache=cache)
    assert cache.bytes() == 10 * kv_cache_bytes_per_token(tiny, bytes_per_value=4)  # fp32 here
