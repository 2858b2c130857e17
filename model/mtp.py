"""Multi-token prediction: ONE module applied for D steps with shared parameters (GLM-5),
sharing the embedding and output head with the main model.

Shape legend: B batch, T tokens, D hidden.

Step k (k = 1..D) at position t:
    h^k_t = Block( eh_proj([enorm(Emb(x_{t+k})) ; hnorm(h^{k-1}_t)]) )
    logits^k_t = lm_head(shared_head.norm(h^k_t))      predicts x_{t+k+1}
h^0 is the main model's last hidden state BEFORE its final norm. Concatenation order is
[embedding ; hidden], as DeepSeek-V3's and Megatron's MTP implementations do.
L_MTP = weight / D * sum_k CE_k.
"""

from __future__ import annotations

import torch
from torch import nn

from model.attention import AttnContext
from model.block import Block
from model.cache import KVCache
from model.config import ModelConfig
from model.mla import Want
from model.norms import RMSNorm


class SharedHead(nn.Module):
    # Only the norm is owned; the head itself is the main lm_head (named like DeepSeek's weights).
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        # layer_idx = num_layers: an MoE, DSA block, stored as HF layer L like DeepSeek's layer 61.
        self.block = Block(cfg, cfg.num_layers)
        self.shared_head = SharedHead(cfg)

    def forward(self, h_prev: torch.Tensor, emb: torch.Tensor, ctx: AttnContext, cache: KVCache | None,
                want: Want, token_mask: torch.Tensor | None):
        """h_prev, emb [B,T,D] -> (h [B,T,D] pre-norm, indexer output, attn probs, MoE stats).
        The logits are lm_head(self.shared_head.norm(h))."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h_prev)], dim=-1))
        return self.block(x, ctx, cache, 0, want, token_mask)
