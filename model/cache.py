"""The latent KV cache: per token and layer, the normalised kv latent c (kv_lora_rank), the
rotated shared rope key (qk_rope_head_dim) and, on DSA layers, the indexer key (index_head_dim).

Nothing per head is cached: decode absorbs kv_b_proj into the query and output instead.

Shapes: B batch, S cached tokens, C kv_lora_rank, R qk_rope_head_dim, I index_head_dim.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int):
        self.c: list[torch.Tensor | None] = [None] * num_layers       # [B, S, C]
        self.kr: list[torch.Tensor | None] = [None] * num_layers      # [B, S, R]
        self.ik: list[torch.Tensor | None] = [None] * num_layers      # [B, S, I] (DSA layers)
        self.key_valid: torch.Tensor | None = None                    # [B, S] bool, False = padding
        self.doc: torch.Tensor | None = None                          # [B, S] document id
        self.pos: torch.Tensor | None = None                          # [B, S] rope position

    @property
    def length(self) -> int:
        return 0 if self.key_valid is None else self.key_valid.shape[1]

    def append_meta(self, key_valid: torch.Tensor, doc: torch.Tensor, pos: torch.Tensor) -> None:
        """Called once per forward, before the layers, with the new tokens' [B, T] metadata."""
        if self.key_valid is None:
            self.key_valid, self.doc, self.pos = key_valid, doc, pos
        else:
            self.key_valid = torch.cat([self.key_valid, key_valid], 1)
            self.doc = torch.cat([self.doc, doc], 1)
            self.pos = torch.cat([self.pos, pos], 1)

    def update(self, layer: int, c: torch.Tensor, kr: torch.Tensor, ik: torch.Tensor | None):
        """Append this layer's new entries; return the full (c, kr, ik) for the layer."""
        def cat(old, new):
            return new if old is None else torch.cat([old, new], 1)
        self.c[layer], self.kr[layer] = cat(self.c[layer], c), cat(self.kr[layer], kr)
        if ik is not None:
            self.ik[layer] = cat(self.ik[layer], ik)
        return self.c[layer], self.kr[layer], self.ik[layer]

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (speculative decoding drops rejected drafts this way)."""
        cut = lambda t: None if t is None else t[:, :n]  # noqa: E731
        self.c = [cut(t) for t in self.c]
        self.kr = [cut(t) for t in self.kr]
        self.ik = [cut(t) for t in self.ik]
        self.key_valid, self.doc, self.pos = cut(self.key_valid), cut(self.doc), cut(self.pos)

    def select(self, rows: torch.Tensor) -> "KVCache":
        """A cache whose row b is this one's row rows[b]: a prefix computed once, continued by
        several rows (the samples of a group). Differentiable: gradients of the copies sum
        into the shared rows."""
        pick = lambda t: None if t is None else t.index_select(0, rows)  # noqa: E731
        out = KVCache(len(self.c))
        out.c, out.kr, out.ik = [pick(t) for t in self.c], [pick(t) for t in self.kr], [pick(t) for t in self.ik]
        out.key_valid, out.doc, out.pos = pick(self.key_valid), pick(self.doc), pick(self.pos)
        return out

    def bytes(self) -> int:
        tensors = [t for t in self.c + self.kr + self.ik if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)
