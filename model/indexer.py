"""DSA lightning indexer: a cheap scorer that picks, per query, the index_topk keys the main
attention will look at.

Shape legend: B batch, T queries, S keys, Hi index heads, Di index head dim, R rope dims,
Cq q_lora_rank, D hidden.

    q_I = wq_b(c_Q)                  c_Q: the MLA query latent (after q_a_layernorm)
    k_I = LayerNorm(wk(x))           one key per token, shared by all index heads
    w   = weights_proj(x) * Hi^-0.5 * Di^-0.5
    I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s])     (fp32; kernels.indexer)

RoPE as transformers does for GLM-5: interleaved pairs on the FIRST R dims of each head
([rope | pass]; the main MLA head is [nope | rope]).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.indexer import indexer_scores, indexer_scores_reference
from model.config import ModelConfig
from model.rope import apply_rope


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rope_dim
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B,T,D] -> rotated index keys [B,T,Di] (what the cache stores)."""
        return self._rope(self.k_norm(self.wk(x)), cos, sin)

    def _queries(self, x, q_lat, cos, sin):
        B, T, _ = x.shape
        q = self._rope(self.wq_b(q_lat).view(B, T, self.n_heads, self.head_dim), cos, sin)
        # Both scale factors are positive, so folding them into w equals scaling inside the ReLU.
        w = self.weights_proj(x).float() * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        return q, w

    def scores(self, x: torch.Tensor, q_lat: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, allowed: torch.Tensor, past: int) -> torch.Tensor:
        """x [B,T,D], q_lat [B,T,Cq], keys [B,S,Di], allowed [B,T,S] -> I [B,T,S] fp32, -inf where not allowed."""
        q, w = self._queries(x, q_lat, cos, sin)
        # The fused kernel has no backward; the torch reference does (indexer training needs it).
        fn = indexer_scores_reference if torch.is_grad_enabled() and w.requires_grad else indexer_scores
        return fn(q, keys, w, causal_offset=past).masked_fill(~allowed, float("-inf"))

    @torch.no_grad()
    def select(self, x: torch.Tensor, q_lat: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, allowed: torch.Tensor, past: int, k: int, topk_fn,
               chunk: int = 256) -> torch.Tensor:
        """select(scores(...), k) without the [B,T,S] scores: `chunk` queries at a time, each
        against the keys up to its last position only (the later ones are causally masked), then
        top-k per chunk. -> [B,T,k] long. Row for row the same scores (the kernel scores each
        query independently, fp32) and so the same selection as topk_fn(scores(...), k)."""
        q, w = self._queries(x, q_lat, cos, sin)
        B, T = q.shape[:2]
        S = keys.shape[1]
        out = torch.empty(B, T, k, dtype=torch.long, device=q.device)
        for t0 in range(0, T, chunk):
            t1 = min(t0 + chunk, T)
            s1 = min(S, past + t1)                             # keys visible to the chunk
            sc = indexer_scores(q[:, t0:t1], keys[:, :s1], w[:, t0:t1], causal_offset=past + t0)
            out[:, t0:t1] = topk_fn(sc.masked_fill_(~allowed[:, t0:t1, :s1], float("-inf")), k)
        return out


def transformers_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """What transformers' GlmMoeDsaIndexer selects: torch.topk over scores whose masked entries
    are finfo.min (its additive mask), not -inf. Same output format as kernels.topk:
    [..., k] ascending positions, -1 for masked/empty slots. Tie order is torch.topk's."""
    S = scores.shape[-1]
    valid = scores != float("-inf")
    idx = torch.where(valid, scores, torch.finfo(scores.dtype).min).topk(min(k, S), dim=-1).indices
    idx = torch.where(valid.gather(-1, idx), idx, S).sort(-1).values
    idx = torch.where(idx == S, -1, idx)
    if idx.shape[-1] < k:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], k - idx.shape[-1]), -1)], -1)
    return idx
