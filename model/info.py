"""Analytic model statistics from a ModelConfig alone (glm5 is far too big to instantiate):
parameter counts (total / activated, with and without the MTP layer and the input embedding),
forward matmul FLOPs per token, and KV-cache bytes per token.

Counts are of nn.Parameters (the router's e_score_correction_bias is a buffer, as in
transformers). "Activated" = parameters a token's forward touches: everything except the
routed experts it is not sent to (top-k of them) -- so it includes every router.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig


def _attention(cfg: ModelConfig, kind: str) -> int:
    D, H, Cq, C = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    n = (D * Cq + Cq + Cq * H * cfg.qk_head_dim + D * (C + cfg.qk_rope_head_dim) + C
         + C * H * (cfg.qk_nope_head_dim + cfg.v_head_dim) + H * cfg.v_head_dim * D)
    if kind == "dsa":
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        n += Cq * Hi * Di + D * Di + 2 * Di + D * Hi
    return n


def _mlp(cfg: ModelConfig, layer: int, active: bool) -> int:
    D = cfg.hidden_size
    if not cfg.is_moe(layer):
        return 3 * D * cfg.intermediate_size
    expert = 3 * D * cfg.moe_intermediate_size
    n_routed = cfg.num_experts_per_tok if active else cfg.n_routed_experts
    return cfg.n_routed_experts * D + n_routed * expert + cfg.n_shared_experts * expert


def _block(cfg: ModelConfig, layer: int, active: bool) -> int:
    return 2 * cfg.hidden_size + _attention(cfg, cfg.kind(layer)) + _mlp(cfg, layer, active)


def _mtp(cfg: ModelConfig, active: bool) -> int:
    D = cfg.hidden_size
    if cfg.mtp_depth == 0:
        return 0
    # enorm, hnorm, eh_proj, shared_head.norm + one block; embedding and head are shared.
    return 3 * D + 2 * D * D + _block(cfg, cfg.num_layers, active)


@dataclass
class ParamCounts:
    total: int                      # without MTP, without input embedding
    active: int                     # without MTP, without input embedding
    total_with_embedding: int       # without MTP
    active_with_embedding: int      # without MTP
    total_with_mtp: int             # with MTP, with embedding: = sum(p.numel()) of GLMModel
    active_with_mtp: int            # with MTP (one step), with embedding
    embedding: int


def param_counts(cfg: ModelConfig) -> ParamCounts:
    D, V = cfg.hidden_size, cfg.vocab_size
    emb = V * D
    head = 0 if cfg.tie_word_embeddings else V * D
    trunk = {a: sum(_block(cfg, i, a) for i in range(cfg.num_layers)) + D + head for a in (False, True)}
    return ParamCounts(
        total=trunk[False], active=trunk[True],
        total_with_embedding=trunk[False] + emb, active_with_embedding=trunk[True] + emb,
        total_with_mtp=trunk[False] + emb + _mtp(cfg, False),
        active_with_mtp=trunk[True] + emb + _mtp(cfg, True), embedding=emb,
    )


def flops_per_token(cfg: ModelConfig, context: int, sparse: bool) -> int:
    """Forward FLOPs of one token that attends to `context` keys (no MTP): 2 x activated matmul
    weights (embedding lookup and norms excluded) + attention in explicit (prefill) form,
    QK: 2*H*(N+R) and AV: 2*H*V per attended key. DSA attends to min(index_topk, context)
    keys and adds the indexer's 2*Hi*Di per key scored (all `context` keys)."""
    D, H = cfg.hidden_size, cfg.num_heads
    matmul = param_counts(cfg).active - (2 * D * cfg.num_layers + D)       # minus block/final norms
    for i in range(cfg.num_layers):  # latent norms and the indexer's k_norm are vectors, not matmuls
        matmul -= cfg.q_lora_rank + cfg.kv_lora_rank + (2 * cfg.index_head_dim if cfg.kind(i) == "dsa" else 0)
    flops = 2 * matmul
    for i in range(cfg.num_layers):
        kind = cfg.kind(i)
        keys = context
        if kind == "swa":
            keys = min(context, cfg.sliding_window)
        if kind == "dsa" and sparse:
            keys = min(context, cfg.index_topk)
            flops += 2 * cfg.index_n_heads * cfg.index_head_dim * context
        flops += keys * 2 * H * (cfg.qk_head_dim + cfg.v_head_dim)
    return flops


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_value: int = 2) -> int:
    """Latent cache (kv_lora_rank + qk_rope_head_dim) + indexer key (index_head_dim, DSA layers),
    summed over the main layers, at `bytes_per_value` (2 = bf16)."""
    per = sum(cfg.kv_lora_rank + cfg.qk_rope_head_dim + (cfg.index_head_dim if cfg.kind(i) == "dsa" else 0)
              for i in range(cfg.num_layers))
    return per * bytes_per_value


def summary(cfg: ModelConfig, context: int = 4096, bytes_per_value: int = 2) -> dict:
    p = param_counts(cfg)
    return {
        # The published GLM-5 convention: total WITH the input embedding, activated WITHOUT it;
        # neither counts the MTP layer.
        "total_params": p.total_with_embedding, "active_params": p.active,
        "params_note": "no MTP in either; total_params includes the input embedding, active_params excludes it "
                       "(published convention: 743.9B / 40.8B for glm5)",
        "total_params_without_embedding": p.total,
        "active_params_with_embedding": p.active_with_embedding,
        "total_params_with_mtp": p.total_with_mtp, "active_params_with_mtp": p.active_with_mtp,
        "embedding_params": p.embedding,
        "context": context,
        "flops_per_token": flops_per_token(cfg, context, sparse=not cfg.dense_attention),
        "flops_per_token_dense": flops_per_token(cfg, context, sparse=False),
        "flops_per_token_dsa": flops_per_token(cfg, context, sparse=True),
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg, bytes_per_value),
        "kv_cache_bytes_per_value": bytes_per_value,
    }


