"""Multi-head Latent Attention (MLA) with decoupled RoPE, and DSA sparse selection.

Shape legend: B batch, T new tokens, S keys (past + T), H heads, N qk_nope_head_dim,
R qk_rope_head_dim, V v_head_dim, C kv_lora_rank, Cq q_lora_rank, K index_topk, D hidden.

    c_Q  = RMSNorm(q_a_proj(x))                      [B,T,Cq]  (also feeds the indexer)
    q    = q_b_proj(c_Q) -> [q_nope (N) | q_rope (R)] per head
    c_KV, k_rope = kv_a_proj_with_mqa(x)             [B,T,C], [B,T,R] (one rope key for all heads)
    c_KV = RMSNorm(c_KV)
    k_nope, v = kv_b_proj(c_KV) per head             [B,S,H,N], [B,S,H,V]
    logit = (q_nope.k_nope + q_rope.k_rope) / sqrt(N + R)

Two numerically equivalent paths:
- explicit (dense prefill / training): materialise per-head k and v;
- absorbed (decode): fold W_UK into the query and W_UV into the output, so attention runs over
  the cached latents [c_KV | k_rope] (C + R values per token), one shared "key head" for all H
  query heads (MQA), as GLM-5 runs DSA.

DSA layers ("dsa" kind, dense mode off) attend to the indexer's top-K keys in either form, chosen
per phase by `MLA.sparse_form`:
- decode / any forward with a cache prefix (past > 0): always absorbed (the explicit form would
  up-project every cached latent each step);
- training / prefill (past == 0): "absorbed" (kernels.sparse_attention_mqa over the latents) or
  "explicit" (kernels.sparse_attention over per-head k, v). "auto" (the default) picks absorbed:
  measured on CPU at GLM-5 widths / 4 (bench/attention.py --form mqa vs --form explicit, 2K
  tokens, top-k 2048), one gathered latent row serving all H heads is ~16x faster forward +
  backward than gathering per-head rows, although the explicit form does ~2.1x fewer FLOPs per
  (query, key) pair; the Triton (CUDA) kernels have no measurement yet, so auto keeps absorbed
  there too. Both give the same outputs and gradients (tests/model/test_attention.py).
The selection itself is computed chunk by chunk over the queries (Indexer.select) unless the
caller asked for the indexer scores, so no [B,T,S] score matrix is built.

Layer kinds: "dsa" attends to the indexer's top-K keys unless dense mode is on; "full" is dense
MLA; "swa" is dense MLA within a sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.sparse_attention import sparse_attention, sparse_attention_mqa
from kernels.topk import deterministic_topk
from model.attention import AttnContext, dense_attention, head_summed_probs
from model.cache import KVCache
from model.config import ModelConfig
from model.indexer import Indexer, transformers_topk
from model.norms import RMSNorm
from model.rope import apply_rope


@dataclass
class Want:
    """What the caller asked a forward to expose (and run-time overrides)."""
    indexer: bool = False       # per-layer indexer scores (with grad for the indexer) + indices
    attn_probs: bool = False    # per-layer detached head-summed attention probabilities
    dense: bool = False         # DSA layers attend densely (indexer off for selection)


@dataclass
class IndexerOut:
    scores: torch.Tensor        # [B,T,S] fp32 indexer logits I, -inf where not allowed; grads
                                # reach only the indexer's own parameters (inputs detached)
    indices: torch.Tensor       # [B,T,K] long, ascending, -1 = empty slot (deterministic top-k)


SPARSE_FORMS = ("auto", "absorbed", "explicit")


class MLA(nn.Module):
    # DSA attention form for training / prefill (see the module docstring); decode is absorbed.
    sparse_form: str = "auto"

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.kind = layer_idx, cfg.kind(layer_idx)
        self.H, self.N, self.R, self.V, self.C = (
            cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
        self.topk = cfg.index_topk
        self.select = deterministic_topk if cfg.index_topk_method == "deterministic" else transformers_topk
        self.scale = cfg.qk_head_dim ** -0.5
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.C + self.R, bias=False)
        self.kv_a_layernorm = RMSNorm(self.C, cfg.latent_norm_eps)
        self.kv_b_proj = nn.Linear(self.C, self.H * (self.N + self.V), bias=False)
        self.o_proj = nn.Linear(self.H * self.V, cfg.hidden_size, bias=False)
        self.indexer = Indexer(cfg) if self.kind == "dsa" else None

    def forward(self, x: torch.Tensor, ctx: AttnContext, cache: KVCache | None, cache_layer: int,
                want: Want) -> tuple[torch.Tensor, IndexerOut | None, torch.Tensor | None]:
        """x [B,T,D] -> (out [B,T,D], indexer output or None, head-summed probs [B,T,S] or None)."""
        B, T, _ = x.shape
        H, N, R, C = self.H, self.N, self.R, self.C
        q_lat = self.q_a_layernorm(self.q_a_proj(x))                           # [B,T,Cq]
        q_nope, q_rope = self.q_b_proj(q_lat).view(B, T, H, N + R).split([N, R], -1)
        q_rope = apply_rope(q_rope, ctx.cos, ctx.sin)                          # [B,T,H,R]
        c, k_rope = self.kv_a_proj_with_mqa(x).split([C, R], -1)
        c = self.kv_a_layernorm(c)                                             # [B,T,C]
        k_rope = apply_rope(k_rope, ctx.cos, ctx.sin)                          # [B,T,R]

        # ---- indexer keys (cached like the latents) and selection ----
        ik = None
        sparse = self.kind == "dsa" and not want.dense
        if self.indexer is not None and (sparse or want.indexer):
            # Detached inputs: the indexer learns only from its own loss, the trunk only from LM.
            with torch.set_grad_enabled(want.indexer and torch.is_grad_enabled()):
                ik = self.indexer.keys(x.detach(), ctx.cos, ctx.sin)           # [B,T,Di]
        if cache is not None:
            c, k_rope, ik = cache.update(cache_layer, c, k_rope, ik)           # now [B,S,*]
        allowed = ctx.mask(self.kind)                                          # [B,T,S]
        idx_out, indices = None, None
        if self.indexer is not None and want.indexer:
            scores = self.indexer.scores(x.detach(), q_lat.detach(), ik, ctx.cos, ctx.sin, allowed, ctx.past)
            indices = self.select(scores.detach(), self.topk)                  # [B,T,K]
            idx_out = IndexerOut(scores, indices)
        elif sparse:                                   # selection only: chunked, no [B,T,S] scores
            indices = self.indexer.select(x.detach(), q_lat.detach(), ik, ctx.cos, ctx.sin, allowed,
                                          ctx.past, self.topk, self.select)    # [B,T,K]
        if not sparse:
            indices = None

        # ---- attention ----
        # Dense prefill/training: explicit per-head keys. Decode: the absorbed MQA form over the
        # latent cache. DSA prefill/training: the form sparse_form picks (module docstring).
        if ctx.past == 0 and (indices is None or self._sparse_form() == "explicit"):
            out, probs = self._explicit(q_nope, q_rope, c, k_rope, allowed, indices, want.attn_probs)
        else:
            out, probs = self._absorbed(q_nope, q_rope, c, k_rope, allowed, indices, want.attn_probs)
        return self.o_proj(out.reshape(B, T, H * self.V)), idx_out, probs

    def _sparse_form(self) -> str:
        if self.sparse_form not in SPARSE_FORMS:
            raise ValueError(f"sparse_form must be one of {SPARSE_FORMS}, got {self.sparse_form!r}")
        return "absorbed" if self.sparse_form == "auto" else self.sparse_form

    def _restrict(self, allowed: torch.Tensor, indices: torch.Tensor | None) -> torch.Tensor:
        """allowed [B,T,S] AND selected-by-indexer, for the (optional) probability readout."""
        if indices is None:
            return allowed
        B, T, S = allowed.shape
        sel = allowed.new_zeros(B, T, S + 1)           # slot S soaks up the -1 (empty) entries
        sel.scatter_(-1, torch.where(indices < 0, S, indices), True)
        return allowed & sel[..., :S]

    def _explicit(self, q_nope, q_rope, c, k_rope, allowed, indices, want_probs):
        B, S, _ = c.shape
        k_nope, v = self.kv_b_proj(c).view(B, S, self.H, self.N + self.V).split([self.N, self.V], -1)
        q = torch.cat([q_nope, q_rope], -1)                                    # [B,T,H,N+R]
        k = torch.cat([k_nope, k_rope[:, :, None, :].expand(B, S, self.H, self.R)], -1)  # [B,S,H,N+R]
        if indices is not None:                                                # DSA, per-head keys
            out = sparse_attention(q, k, v.contiguous(), indices, self.scale)  # [B,T,H,V]
        else:
            out = dense_attention(q, k, v, allowed, self.scale)                # [B,T,H,V]
        probs = head_summed_probs(q, k, self._restrict(allowed, indices), self.scale) if want_probs else None
        return out, probs

    def _absorbed(self, q_nope, q_rope, c, k_rope, allowed, indices, want_probs):
        B, S, _ = c.shape
        w = self.kv_b_proj.weight.view(self.H, self.N + self.V, self.C)
        w_uk, w_uv = w[:, : self.N], w[:, self.N:]                             # [H,N,C], [H,V,C]
        q = torch.cat([torch.einsum("bthn,hnc->bthc", q_nope, w_uk), q_rope], -1)  # [B,T,H,C+R]
        kv = torch.cat([c, k_rope], -1)                                        # [B,S,C+R] the cache
        if indices is not None:
            o_lat = sparse_attention_mqa(q, kv, indices, self.scale, self.C)   # [B,T,H,C]
        else:
            kv_h = kv[:, :, None, :].expand(B, S, self.H, self.C + self.R)     # one key head for all
            o_lat = dense_attention(q, kv_h, kv_h[..., : self.C], allowed, self.scale)
        probs = None
        if want_probs:
            kv_h = kv[:, :, None, :].expand(B, S, self.H, self.C + self.R)
            probs = head_summed_probs(q, kv_h, self._restrict(allowed, indices), self.scale)
        return torch.einsum("bthc,hvc->bthv", o_lat, w_uv), probs
