"""Who may attend to whom, computed once per forward and shared by all layers; plus the dense
attention used by "full"/"swa" layers and by DSA layers in dense mode.

Shape legend: B batch, T new (query) tokens, S all keys (= past + T), H heads, D head dims.

The mask combines causality, document boundaries (packed sequences: block-diagonal), key
padding and, for "swa" layers, the sliding window. Every token may always attend to itself,
so padded query rows stay finite (their outputs are never used as keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnContext:
    past: int                      # tokens already in the cache before this forward
    allowed: torch.Tensor          # [B, T, S] bool
    cos: torch.Tensor              # [B, T, R/2] fp32
    sin: torch.Tensor              # [B, T, R/2] fp32
    window: int | None = None
    _swa: torch.Tensor | None = None

    def mask(self, kind: str) -> torch.Tensor:
        if kind != "swa":
            return self.allowed
        if self._swa is None:
            T, S = self.allowed.shape[1:]
            t = torch.arange(T, device=self.allowed.device)[:, None] + self.past
            s = torch.arange(S, device=self.allowed.device)[None, :]
            self._swa = self.allowed & (t - s < self.window)
        return self._swa


def build_allowed(key_valid: torch.Tensor, doc_keys: torch.Tensor, doc_queries: torch.Tensor,
                  past: int) -> torch.Tensor:
    """key_valid, doc_keys [B, S]; doc_queries [B, T] -> allowed [B, T, S] bool."""
    B, S = key_valid.shape
    T = doc_queries.shape[1]
    t = torch.arange(T, device=key_valid.device)[:, None] + past
    s = torch.arange(S, device=key_valid.device)[None, :]
    allowed = (s <= t)[None] & (doc_keys[:, None, :] == doc_queries[:, :, None]) & key_valid[:, None, :]
    return allowed | (s == t)[None]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [B,T,H,D], k [B,S,H,D] (may be an expanded view), v [B,S,H,Dv], allowed [B,T,S] -> [B,T,H,Dv]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None], scale=scale
    )
    return out.transpose(1, 2)


@torch.no_grad()
def head_summed_probs(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Detached sum over heads of softmax_s(q.k * scale) restricted to `allowed`: [B, T, S] fp32.

    Each row sums to H; divide by H (or L1-normalise) for the DSA indexer's KL target.
    """
    logits = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    return logits.softmax(-1).sum(1)
