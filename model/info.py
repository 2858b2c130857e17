"""Analytic model statistics from a ModelConfig alone (glm5 is far too big to instantiate):
parameter counts (total / activated, with and without the MTP layer and the input embedding),
forward matmul FLOPs per token, and KV-cache bytes per token.

Counts are of nn.Parameters (the router's e_score_correction_bias is a buffer, as in
transformers). "Activated" = parameters a token's forward touches: everything except the
routed experts it is not sent to (top-k of them) -- so it includes every router.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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




# ---------------------------------------------------------------- memory per GPU for a cluster plan
GB = 10**9            # GPU sizes are sold in GB (80 GB A100/H100, 141 GB H200)


def expert_params(cfg: ModelConfig) -> int:
    """Routed-expert weights (gate_up_proj + down_proj of every MoE layer, the MTP block's
    included): the part expert parallelism shards."""
    moe = sum(cfg.is_moe(i) for i in range(cfg.num_layers)) + (cfg.mtp_depth > 0 and cfg.is_moe(cfg.num_layers))
    return moe * cfg.n_routed_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def _block_vectors(cfg: ModelConfig, layer: int) -> int:
    # two RMSNorm gains, the q/kv latent norms, the DSA indexer's k LayerNorm (weight + bias)
    return 2 * cfg.hidden_size + cfg.q_lora_rank + cfg.kv_lora_rank + (2 * cfg.index_head_dim if cfg.kind(layer) == "dsa" else 0)


def adam_params(cfg: ModelConfig) -> int:
    """Parameters Muon leaves to AdamW (training.optim, DeepSpeed's Muon alike): the input
    embedding, the output head and every 1-D parameter (norm gains, biases)."""
    D = cfg.hidden_size
    n = cfg.vocab_size * D * (1 if cfg.tie_word_embeddings else 2) + D
    n += sum(_block_vectors(cfg, i) for i in range(cfg.num_layers))
    if cfg.mtp_depth:
        n += 3 * D + _block_vectors(cfg, cfg.num_layers)
    return n


def activation_values_per_token(cfg: ModelConfig, layer: int) -> int:
    """Values one token keeps for the backward pass in one block (no recomputation), counted
    tensor by tensor with flash-style attention (no T x T scores kept):
      attention  norm in/out 2D, q latent + its norm 2Cq, q H(N+R), kv latent C+R + its norm C,
                 k/v up-projection H(N+V), k with RoPE H(N+R), attention output H*V;
                 + DSA indexer (sparse only) q Hi*Di, k Di, head weights Hi
      dense MLP  norm D, gate + up 2I, activation I
      MoE        norm D, router logits 2E (fp32 = two bf16 slots), per chosen expert (K) its
                 dispatched input D + gate + up + activation 3I, gates K, shared experts 3I each,
                 combined output D
      residual   D"""
    D, H, Cq, C, R = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    N, V = cfg.qk_nope_head_dim, cfg.v_head_dim
    a = 2 * D + 2 * Cq + H * (N + R) + (C + R) + C + H * (N + V) + H * (N + R) + H * V
    if cfg.kind(layer) == "dsa" and not cfg.dense_attention:
        a += cfg.index_n_heads * cfg.index_head_dim + cfg.index_head_dim + cfg.index_n_heads
    if cfg.is_moe(layer):
        E, K, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        m = D + 2 * E + K * (D + 3 * I) + K + cfg.n_shared_experts * 3 * I + D
    else:
        m = D + 3 * cfg.intermediate_size
    return a + m + D


@dataclass(frozen=True)
class Plan:
    """A training layout: nodes x gpus_per_node data-parallel ranks, routed experts sharded
    over groups of `ep` ranks (each expert replicated world/ep times), ZeRO over the data-parallel
    group of each parameter (all ranks for dense weights, the world/ep replicas for experts)."""
    nodes: int
    gpus_per_node: int
    zero_stage: int = 2
    ep: int = 1
    micro_batch_size: int = 1
    seq_len: int = 4096
    activation_checkpointing: bool = True
    optimizer: str = "muon"              # muon (Muon + AdamW for embeddings/head/vectors) | adamw
    gpu_mem_gb: int = 80
    rollout_tokens: int = 0              # KV-cache tokens a GPU holds during RL rollouts
    sync_gb_per_s: float = 50.0          # a GPU's link for the RL weight sync (400 Gb/s InfiniBand)
    reserve_gb: float = 6.0              # CUDA context, NCCL buffers, allocator fragmentation

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def check_plan(cfg: ModelConfig, plan: Plan) -> None:
    """ValueError naming the field when the layout itself is impossible."""
    if plan.nodes < 1 or plan.gpus_per_node < 1:
        raise ValueError(f"plan {plan.nodes}x{plan.gpus_per_node}: nodes and GPUs per node must be >= 1")
    if plan.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage {plan.zero_stage}: choose 0, 1, 2 or 3")
    if plan.ep < 1 or plan.world % plan.ep:
        raise ValueError(f"ep {plan.ep} must divide the {plan.world} GPUs of the plan")
    if cfg.n_routed_experts % plan.ep:
        raise ValueError(f"ep {plan.ep} must divide the model's {cfg.n_routed_experts} routed experts")
    if plan.optimizer not in ("muon", "adamw"):
        raise ValueError(f"optimizer {plan.optimizer!r}: choose muon or adamw")
    if plan.micro_batch_size < 1 or plan.seq_len < 1 or plan.rollout_tokens < 0:
        raise ValueError("micro_batch_size and seq_len must be >= 1, rollout_tokens >= 0")


def memory_plan(cfg: ModelConfig, plan: Plan) -> dict:
    """Bytes per GPU for training under `plan` (bf16 weights and gradients, fp32 master weights
    and optimizer states: Muon keeps one fp32 momentum per matrix element, AdamW two moments),
    activations by activation_values_per_token (2 bytes each) plus the logits (bf16 + the fp32
    softmax, once for the main head and once per MTP step), and the rollout phase (bf16 weights
    + the latent KV cache of `rollout_tokens`). ZeRO 1 partitions master weights and optimizer
    states over the data-parallel group, ZeRO 2 also gradients, ZeRO 3 also the bf16 weights."""
    check_plan(cfg, plan)
    total = param_counts(cfg).total_with_mtp
    experts = expert_params(cfg)
    dense = total - experts
    adam = adam_params(cfg)                     # all dense (embeddings, head, vectors)
    dp_dense, dp_expert = plan.world, plan.world // plan.ep
    local_experts = experts // plan.ep

    def split(n_dense: float, n_expert: float, stage: int) -> float:
        """Elements per GPU: dense over all ranks, experts over their replicas, from `stage` on."""
        if plan.zero_stage >= stage:
            return n_dense / dp_dense + n_expert / dp_expert
        return n_dense + n_expert

    params = 2 * split(dense, local_experts, 3)
    grads = 2 * split(dense, local_experts, 2)
    master = 4 * split(dense, local_experts, 1)
    if plan.optimizer == "muon":
        states = 4 * split(dense - adam, local_experts, 1) + 8 * split(adam, 0, 1)
    else:
        states = 8 * split(dense, local_experts, 1)
    layers = [activation_values_per_token(cfg, i) for i in range(cfg.num_layers)]
    mtp_layer = activation_values_per_token(cfg, cfg.num_layers) + 3 * cfg.hidden_size if cfg.mtp_depth else 0
    if plan.activation_checkpointing:
        # each block keeps its input; one block (the largest) is live again while recomputed
        per_token = cfg.num_layers * cfg.hidden_size + max(layers) + cfg.mtp_depth * (cfg.hidden_size + mtp_layer)
    else:
        per_token = sum(layers) + cfg.mtp_depth * mtp_layer
    logits = 6 * cfg.vocab_size * (1 + cfg.mtp_depth)          # bf16 logits + fp32 softmax, main + MTP
    tokens = plan.micro_batch_size * plan.seq_len
    activations = tokens * (2 * per_token + logits)
    reserve = plan.reserve_gb * GB
    train = params + grads + master + states + activations + reserve
    kv = kv_cache_bytes_per_token(cfg) * plan.rollout_tokens
    rollout = 2 * (dense + local_experts) + kv + reserve
    # the RL trainer: AdamW (GLM-5's RL scripts), two fp32 moments for every element
    rl_train = params + grads + master + 8 * split(dense, local_experts, 1) + activations + reserve
    # one policy version in bf16: the trainer ranks each send an even share of it (rl.weight_sync
    # deals replicated tensors out by size), a rollout GPU receives the weights it serves
    version = 2 * total
    send, receive = version / plan.world, 2 * (dense + local_experts)
    sync_s = max(send, receive) / (plan.sync_gb_per_s * 1e9)
    cap = plan.gpu_mem_gb * GB
    return {
        "plan": f"{plan.nodes}x{plan.gpus_per_node}", "world": plan.world, "zero_stage": plan.zero_stage,
        "ep": plan.ep, "dp_dense": dp_dense, "dp_expert": dp_expert, "optimizer": plan.optimizer,
        "micro_batch_size": plan.micro_batch_size, "seq_len": plan.seq_len,
        "activation_checkpointing": plan.activation_checkpointing, "gpu_mem_gb": plan.gpu_mem_gb,
        "params_total": total, "params_expert": experts, "params_dense": dense, "params_adam": adam,
        "params_per_gpu": dense + local_experts,
        "bytes": {"parameters": params, "gradients": grads, "master_weights": master, "optimizer_states": states,
                  "activations": activations, "reserve": reserve, "training_total": train,
                  "rl_training_total": rl_train, "rollout_kv_cache": kv, "rollout_total": rollout},
        "weight_sync": {"version_bytes": version, "send_bytes_per_trainer_gpu": send,
                        "receive_bytes_per_rollout_gpu": receive, "gb_per_s": plan.sync_gb_per_s, "seconds": sync_s},
        "activation_values_per_token": per_token, "logit_bytes_per_token": logits,
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg), "rollout_tokens": plan.rollout_tokens,
        "fits_training": train <= cap, "fits_rollout": rollout <= cap, "fits_rl_training": rl_train <= cap,
    }


@dataclass(frozen=True)
class ServerPool:
    """An inference server pool as rl_pools sizes it (rl.served.ServerPoolConfig's layout)."""
    replicas: int
    gpus_per_replica: int = 1
    data_parallel: int = 1              # attention data parallel inside a replica; tensor parallel = gpus / dp
    expert_parallel: int = 1            # the replica's GPUs the routed experts are sharded over
    weight_bytes: float = 2.0           # bf16 2, fp8 1
    external: bool = False              # run by the cluster and given as URLs, not started by the stage


def server_pool_memory(cfg: ModelConfig, plan: Plan, pool: ServerPool) -> dict:
    """Bytes per GPU of one server replica: tensor parallelism splits the dense weights (and the
    experts when they are not expert-parallel), expert parallelism the routed experts; the latent
    KV cache of `plan.rollout_tokens` per GPU (MLA's latent is not split over heads, so tensor
    parallel GPUs each hold their sequences' whole latent); and the reserve. `receive`: the bf16
    bytes a GPU of it reads per full weight sync (the dense weights whole, its experts' shards)."""
    experts = expert_params(cfg)
    dense = param_counts(cfg).total_with_mtp - experts
    tp = pool.gpus_per_replica // pool.data_parallel
    expert_split = pool.expert_parallel if pool.expert_parallel > 1 else tp
    weights = pool.weight_bytes * (dense / tp + experts / expert_split)
    kv = kv_cache_bytes_per_token(cfg) * plan.rollout_tokens
    reserve = plan.reserve_gb * GB
    total = weights + kv + reserve
    return {"replicas": pool.replicas, "gpus_per_replica": pool.gpus_per_replica, "data_parallel": pool.data_parallel,
            "external": pool.external,
            "expert_parallel": pool.expert_parallel, "gpus": pool.replicas * pool.gpus_per_replica,
            "bytes": {"weights": weights, "kv_cache": kv, "reserve": reserve}, "bytes_per_gpu": total,
            "receive_bytes_per_gpu": 2 * (dense + experts / max(pool.expert_parallel, 1)),
            "fits": total <= plan.gpu_mem_gb * GB}


def rl_pools(cfg: ModelConfig, plan: Plan, trainer_gpus: int, zero_stage: int, ep: int,
             servers: dict[str, ServerPool], generates: bool, models_in_ranks: int = 0) -> dict:
    """An RL stage's pools under `plan`'s per-GPU settings (sequence length, micro-batch, GPU size,
    rollout KV tokens, link speed): the trainer's `trainer_gpus` ranks (AdamW at `zero_stage`, the
    experts sharded over `ep`) and each server pool (server_pool_memory). generates: the ranks roll
    out themselves, each with a whole bf16 copy of the model and the KV cache beside its training
    state; models_in_ranks: more whole models every rank holds (judges, teachers not served).
    weight_sync: one bf16 version, each trainer GPU sending its share, each server GPU receiving
    what it serves, at plan.sync_gb_per_s per GPU."""
    from dataclasses import replace

    r = memory_plan(cfg, replace(plan, nodes=1, gpus_per_node=trainer_gpus, zero_stage=zero_stage, ep=ep,
                                 optimizer="adamw"))
    total = param_counts(cfg).total_with_mtp
    kv = kv_cache_bytes_per_token(cfg) * plan.rollout_tokens
    cap = plan.gpu_mem_gb * GB
    b = r["bytes"]
    in_ranks = (2 * total + kv if generates else 0) + 2 * total * models_in_ranks   # engine copy, judges, teachers
    parts = {"weights": b["parameters"], "gradients": b["gradients"],
             "optimizer": b["master_weights"] + b["optimizer_states"], "activations": b["activations"],
             "reserve": b["reserve"], "whole_models": in_ranks}
    trainer = sum(parts.values())
    out = {"trainer": {"gpus": trainer_gpus, "zero_stage": zero_stage, "ep": ep, "bytes": parts,
                       "bytes_per_gpu": trainer, "generates": generates, "fits": trainer <= cap},
           "servers": {name: server_pool_memory(cfg, plan, pool) for name, pool in servers.items()}}
    version = 2 * total
    send = version / trainer_gpus
    receive = max((sv["receive_bytes_per_gpu"] for sv in out["servers"].values()), default=0.0)
    out["weight_sync"] = {"version_bytes": version, "send_bytes_per_trainer_gpu": send,
                          "receive_bytes_per_server_gpu": receive, "gb_per_s": plan.sync_gb_per_s,
                          "seconds": max(send, receive) / (plan.sync_gb_per_s * 1e9)}
    out["gpus"] = trainer_gpus + sum(sv["gpus"] for sv in out["servers"].values())
    out["fits"] = out["trainer"]["fits"] and all(v["fits"] for v in out["servers"].values())
    return out


def plan_fixes(cfg: ModelConfig, plan: Plan) -> list[str]:
    """Single changes that make a plan that does not fit fit (each one checked with memory_plan),
    in the order a user would try them: cheaper first."""
    from dataclasses import replace

    def fits(p: Plan) -> bool:
        try:
            r = memory_plan(cfg, p)
        except ValueError:
            return False
        return r["fits_training"] and r["fits_rollout"]

    fixes = []
    eps = [e for e in range(plan.ep + 1, cfg.n_routed_experts + 1)
           if cfg.n_routed_experts % e == 0 and plan.world % e == 0]
    ep = next((e for e in eps if fits(replace(plan, ep=e))), None)
    if ep:
        fixes.append(f"raise --ep to {ep}")
    if not plan.activation_checkpointing and fits(replace(plan, activation_checkpointing=True)):
        fixes.append("turn on activation checkpointing (--checkpointing)")
    for z in range(plan.zero_stage + 1, 4):
        if fits(replace(plan, zero_stage=z)):
            fixes.append(f"ZeRO-{z} (--zero {z})" + (" (not supported by the trainer yet)" if z == 3 else ""))
            break
    if plan.micro_batch_size > 1:
        mb = next((m for m in range(plan.micro_batch_size - 1, 0, -1) if fits(replace(plan, micro_batch_size=m))), None)
        if mb:
            fixes.append(f"lower --micro-batch to {mb}")
    if plan.gpu_mem_gb < 141 and fits(replace(plan, gpu_mem_gb=141)):
        fixes.append("use 141 GB GPUs (--gpu-mem 141)")
    for nodes in (plan.nodes * 2, plan.nodes * 4):
        if fits(replace(plan, nodes=nodes)):
            fixes.append(f"use {nodes} nodes (--plan {nodes}x{plan.gpus_per_node})")
            break
    return fixes


def parse_plan(text: str) -> tuple[int, int]:
    """'128x8' or '128×8' -> (nodes, gpus_per_node)."""
    parts = text.lower().replace("×", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--plan {text!r}: give NODESxGPUS, e.g. 128x8")
    return int(parts[0]), int(parts[1])


class PlanConfig(BaseModel):
    """The `plan:` section of a pipeline config: the cluster layout the training stages are sized
    for (`glmforge model info --preset NAME --plan ...` starts from it). Validated on load: a
    plan whose memory per GPU does not fit is refused, naming what to change."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_preset: Literal["tiny", "small", "glm5"] = Field("glm5", description=(
        "the model the plan sizes (model.config presets)"))
    model_overrides: dict = Field(default_factory=dict, description=(
        "ModelConfig fields changed from the preset, e.g. {dense_attention: true}"))
    nodes: int = Field(1, ge=1, description="nodes in the cluster")
    gpus_per_node: int = Field(8, ge=1, description="GPUs on each node (ranks per node)")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description=(
        "DeepSpeed ZeRO stage the memory plan assumes (optimizer state, gradients, parameters sharded)"))
    ep: int = Field(1, ge=1, description="expert-parallel group size (routed experts sharded over it)")
    micro_batch_size: int = Field(1, ge=1, description="sequences per rank per step")
    seq_len: int = Field(4096, ge=1, description="tokens per training sequence")
    activation_checkpointing: bool = Field(True, description=(
        "recompute activations in the backward pass (the plan keeps one layer's activations instead of "
        "every layer's)"))
    optimizer: Literal["muon", "adamw"] = Field("muon", description=(
        "muon (Muon, with AdamW for embeddings, head and vectors) or adamw: the optimizer state the plan "
        "holds"))
    gpu_mem_gb: Literal[80, 141] = Field(80, description="memory of one GPU in GB: 80 (H100) or 141 (H200)")
    rollout_tokens: int = Field(0, ge=0, description="latent KV-cache tokens per GPU during RL rollouts")
    sync_gb_per_s: float = Field(50.0, gt=0, description="GB/s of a GPU's link for the RL weight sync")

    def model(self) -> ModelConfig:
        from model.config import preset
        return preset(self.model_preset, **self.model_overrides)

    def plan(self) -> Plan:
        return Plan(**{k: getattr(self, k) for k in Plan.__dataclass_fields__ if k != "reserve_gb"})

    @model_validator(mode="after")
    def _fits(self) -> "PlanConfig":
        cfg, plan = self.model(), self.plan()
        r = memory_plan(cfg, plan)
        if not (r["fits_training"] and r["fits_rollout"]):
            raise ValueError(not_fitting_message(cfg, plan, r))
        return self


def not_fitting_message(cfg: ModelConfig, plan: Plan, r: dict) -> str:
    b = r["bytes"]
    what = []
    if not r["fits_training"]:
        what.append(f"training needs {b['training_total'] / GB:.1f} GB per GPU")
    if not r["fits_rollout"]:
        what.append(f"rollouts need {b['rollout_total'] / GB:.1f} GB per GPU")
    fixes = plan_fixes(cfg, plan)
    return (f"plan {r['plan']} (ZeRO-{plan.zero_stage}, ep {plan.ep}) does not fit a {plan.gpu_mem_gb} GB GPU: "
            + " and ".join(what) + "; "
            + ("change one of: " + "; ".join(fixes) if fixes else "no single change fits; combine them"))
