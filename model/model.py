"""GLMModel: the GLM-5 architecture (MLA + DSA + MoE + shared-parameter MTP), single device.

Shape legend: B batch, T new tokens, S keys (cached + new), D hidden, V vocab, E experts,
K index_topk, L num_layers.

forward(input_ids) returns GLMOutput with the logits; forward(input_ids, labels) the loss pieces
instead (the head runs on the labeled positions only, no [B,T,V] logits). `labels` are
ALREADY SHIFTED: labels[b, t] is the token that should follow input_ids[b, t]; -100 is ignored.
Packed sequences: pass doc_ids [B,T] (one id per document); attention becomes block-diagonal
causal and positions restart at 0 in every document (unless position_ids are given).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import AttnContext, build_allowed
from model.block import Block
from model.cache import KVCache
from model.config import ModelConfig
from model.mla import IndexerOut, Want
from model.moe import Experts, MoE, Router
from model.mtp import MTP
from model.norms import RMSNorm
from model.rope import Rotary

IGNORE = -100


@dataclass
class GLMOutput:
    logits: torch.Tensor | None                            # [B,T,V]; None when labels are given
    loss: torch.Tensor | None = None                       # lm + mtp + balance (labels given)
    losses: dict[str, torch.Tensor] = field(default_factory=dict)   # "lm", "mtp", "balance", "mtp_1".."mtp_D"
    indexer: list[IndexerOut | None] | None = None         # per main layer (return_indexer)
    mtp_indexer: list[IndexerOut | None] | None = None     # per MTP step (return_indexer)
    attn_probs: list[torch.Tensor | None] | None = None    # per main layer [B,T,S], detached, rows sum to H
    expert_load: list[torch.Tensor] = field(default_factory=list)   # per MoE layer [E] tokens routed
    hidden: torch.Tensor | None = None                     # [B,T,D] last hidden before the final norm


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [B,T] -> positions that restart at 0 where the document id changes."""
    B, T = doc_ids.shape
    t = torch.arange(T, device=doc_ids.device).expand(B, T)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(start, t, torch.zeros_like(t)).cummax(1).values
    return t - first


class GLMModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.mtp = MTP(config) if config.mtp_depth > 0 else None
        self.rotary = Rotary(config.qk_rope_head_dim, config.rope_theta)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding, Router)):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, Experts):
                nn.init.normal_(m.gate_up_proj, std=std)
                nn.init.normal_(m.down_proj, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            if isinstance(m, Router):
                m.e_score_correction_bias.zero_()

    # ------------------------------------------------------------------ helpers
    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_layers)

    def context(self, B: int, T: int, device, attention_mask=None, doc_ids=None, position_ids=None,
                cache: KVCache | None = None) -> tuple[AttnContext, torch.Tensor]:
        """Masks and RoPE angles for T new tokens (after `cache.length` cached ones).
        Returns (ctx, token_mask [B,T] bool)."""
        past = cache.length if cache is not None else 0
        valid = torch.ones(B, T, dtype=torch.bool, device=device) if attention_mask is None \
            else attention_mask.to(device=device, dtype=torch.bool)
        if doc_ids is None:
            doc = cache.doc[:, -1:].expand(B, T) if past else torch.zeros(B, T, dtype=torch.long, device=device)
        else:
            doc = doc_ids
        if position_ids is None:
            if past:
                position_ids = cache.pos[:, -1:] + 1 + (valid.long().cumsum(1) - 1).clamp(min=0)
            elif doc_ids is not None:
                position_ids = document_positions(doc_ids)
            elif attention_mask is not None:
                position_ids = (valid.long().cumsum(1) - 1).clamp(min=0)   # left padding
            else:
                position_ids = torch.arange(T, device=device).expand(B, T)
        if cache is not None:
            cache.append_meta(valid, doc, position_ids)
            allowed = build_allowed(cache.key_valid, cache.doc, doc, past)
        else:
            allowed = build_allowed(valid, doc, doc, 0)
        cos, sin = self.rotary(position_ids)
        return AttnContext(past, allowed, cos, sin, self.config.sliding_window), valid

    def logits_from_hidden(self, h: torch.Tensor, final_norm: nn.Module) -> torch.Tensor:
        return self.lm_head(final_norm(h))

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                attention_mask: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                return_indexer: bool = False, return_attn_probs: bool = False,
                dense_attention: bool | None = None, compute_mtp: bool | None = None,
                return_hidden: bool = False, logits_at: torch.Tensor | None = None) -> GLMOutput:
        """input_ids [B,T] (+ labels [B,T], already shifted) -> GLMOutput.

        attention_mask [B,T]: 1 = real token, 0 = padding.   doc_ids [B,T]: packed documents.
        cache: a KVCache to read and extend (generation).   dense_attention: override the config.
        compute_mtp: run the MTP loss (default: when labels are given and mtp_depth > 0).
        logits_at [B,T] bool: logits only at these positions, [N,V] (RL scores responses only: the
        vocabulary projection of every prompt position would be most of a small model's step).
        """
        cfg = self.config
        B, T = input_ids.shape
        want = Want(return_indexer, return_attn_probs,
                    cfg.dense_attention if dense_attention is None else dense_attention)
        ctx, token_mask = self.context(B, T, input_ids.device, attention_mask, doc_ids, position_ids, cache)

        x = self.embed_tokens(input_ids)
        idx_outs, probs_all, stats_all = [], [], []
        for i, layer in enumerate(self.layers):
            x, idx_out, probs, stats = layer(x, ctx, cache, i, want, token_mask)
            idx_outs.append(idx_out)
            probs_all.append(probs)
            if stats is not None:
                stats_all.append(stats)
        h0 = x
        out = GLMOutput(logits=None if labels is not None else
                        self.lm_head(self.norm(x if logits_at is None else x[logits_at])),
                        expert_load=[s["load"] for s in stats_all],
                        indexer=idx_outs if return_indexer else None,
                        attn_probs=probs_all if return_attn_probs else None,
                        hidden=h0 if return_hidden else None)
        if labels is None:
            return out

        lm = self._head_loss(x, self.norm, labels)
        terms = [s["balance"] for s in stats_all if s["balance"] is not None]
        balance = cfg.seq_balance_alpha * sum(terms) if terms else x.new_zeros(())
        losses = {"lm": lm, "balance": balance}
        run_mtp = (self.mtp is not None) if compute_mtp is None else (compute_mtp and self.mtp is not None)
        if run_mtp:
            losses.update(self._mtp_losses(input_ids, labels, h0, ctx, doc_ids, token_mask, want, out))
        out.losses = losses
        out.loss = sum(v for k, v in losses.items() if k in ("lm", "mtp", "balance"))
        return out

    def _mtp_losses(self, input_ids, labels, h0, ctx, doc_ids, token_mask, want, out) -> dict:
        """D shared-parameter steps. Step k at position t reads token x_{t+k} and predicts
        labels[t+k] (= x_{t+k+1}); positions whose window crosses the sequence end or a document
        boundary are ignored. Causal attention keeps the padded tail from leaking backwards."""
        cfg = self.config
        h, losses, mtp_idx = h0, {}, []
        for k in range(1, cfg.mtp_depth + 1):
            ids_k = F.pad(input_ids[:, k:], (0, k), value=0)                     # x_{t+k}
            tgt = F.pad(labels[:, k:], (0, k), value=IGNORE)                     # x_{t+k+1}
            if doc_ids is not None:
                same = F.pad(doc_ids[:, k:], (0, k), value=-1) == doc_ids
                tgt = tgt.masked_fill(~same, IGNORE)
            h, idx_out, _, stats = self.mtp(h, self.embed_tokens(ids_k), ctx, None, want, token_mask)
            mtp_idx.append(idx_out)
            if stats is not None:
                out.expert_load.append(stats["load"])
            losses[f"mtp_{k}"] = self._head_loss(h, self.mtp.shared_head.norm, tgt)
        losses["mtp"] = cfg.mtp_loss_weight / cfg.mtp_depth * sum(losses[f"mtp_{k}"] for k in range(1, cfg.mtp_depth + 1))
        if want.indexer:
            out.mtp_indexer = mtp_idx
        return losses

    def _head_loss(self, h: torch.Tensor, norm: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        """Mean CE over the positions with a label (0 if there are none). The norm, vocabulary
        projection and softmax run on those rows only: in a small model they are most of a
        step, and SFT, fact and MQAR data label a third to a half of their positions."""
        flat = labels.reshape(-1)
        keep = flat != IGNORE
        logits = self.lm_head(norm(h.reshape(-1, h.shape[-1])[keep]))
        return F.cross_entropy(logits.float(), flat[keep], reduction="sum") / keep.sum().clamp(min=1)

    # ------------------------------------------------------------------ MTP at inference
    def mtp_step(self, h_prev: torch.Tensor, next_ids: torch.Tensor, cache: KVCache,
                 position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP step over new positions with its own one-layer cache.
        h_prev [B,T,D], next_ids [B,T] (x_{t+k}), position_ids [B,T] -> (h [B,T,D], logits [B,T,V])."""
        B, T = next_ids.shape
        ctx, mask = self.context(B, T, next_ids.device, position_ids=position_ids, cache=cache)
        h, _, _, _ = self.mtp(h_prev, self.embed_tokens(next_ids), ctx, cache, Want(dense=self.config.dense_attention), mask)
        return h, self.lm_head(self.mtp.shared_head.norm(h))




# ---------------------------------------------------------------- training helpers
def indexer_parameters(model: GLMModel) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".indexer." in n]


def freeze_all_but_indexer(model: GLMModel) -> list[nn.Parameter]:
    """DSA warm-up: only the lightning indexers train. Returns the trainable parameters."""
    for n, p in model.named_parameters():
        p.requires_grad_(".indexer." in n)
    return indexer_parameters(model)


def unfreeze_all(model: GLMModel) -> None:
    for p in model.parameters():
        p.requires_grad_(True)


def moe_layers(model: GLMModel) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
