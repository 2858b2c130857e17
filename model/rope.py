"""Rotary position embedding, in the interleaved-pair convention transformers uses for GLM-5.

Shape legend: B batch, T tokens, H heads, R rope dims (= qk_rope_head_dim, even).

Pairs (x0,x1), (x2,x3), ... are rotated by one frequency each. Like transformers we write
the result de-interleaved ([rotated evens | rotated odds]); q and k get the same
permutation, so every q.k dot product equals the interleaved rotation's. Our latent cache
stores keys in this layout, which is also what an HF checkpoint's numerics assume.
"""

import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, rope_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [R/2]

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> (cos, sin), each [B, T, R/2] fp32."""
        freqs = position_ids[..., None].float() * self.inv_freq
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, R] (or [B, T, R] with 3-D cos/sin broadcast) -> same shape, rotated."""
    if x.dim() == 4:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
