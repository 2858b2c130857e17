"""One transformer block: pre-norm MLA then pre-norm MLP (dense for the first layers, MoE after).

Shape legend: B batch, T tokens, D hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from model.attention import AttnContext
from model.cache import KVCache
from model.config import ModelConfig
from model.mla import MLA, IndexerOut, Want
from model.moe import MLP, MoE
from model.norms import RMSNorm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, ctx: AttnContext, cache: KVCache | None, cache_layer: int,
                want: Want, token_mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, IndexerOut | None, torch.Tensor | None, dict | None]:
        """x [B,T,D] -> (x [B,T,D], indexer output, head-summed attn probs, MoE stats or None)."""
        a, idx_out, probs = self.self_attn(self.input_layernorm(x), ctx, cache, cache_layer, want)
        x = x + a
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            m, stats = self.mlp(h, token_mask)
        else:
            m, stats = self.mlp(h), None
        return x + m, idx_out, probs, stats
