"""Typed config of the training stages: one frozen pydantic model per section.

`TrainConfig` holds what every training stage shares (batch, optimizer, schedule, DeepSpeed,
launch, checkpoints); `PretrainConfig` adds the model shape, `ContextConfig` the context length,
RoPE base and data mix of one mid-training phase.

Which DeepSpeed / ZeRO / optimizer combinations work (DeepSpeed 0.19.8, checked by hand and in
tests/training), and `TrainConfig._check` refuses the others with a message saying why:

    optimizer        ZeRO   precision             notes
    muon, muon_split 0      fp32, bf16 (autocast)  training.optim.MuonWithAdamW as a client optimizer:
                                                   the GLM-5 recipe (Moonlight scaling, Muon Split)
    deepspeed_muon   0,1,2  fp32, bf16             DeepSpeed's own "Muon" (MuonWithAuxAdam):
                                                   orthogonalises whole matrices inside ZeRO 1/2,
                                                   per-head for MLA q_b/kv_b (per_head_muon), but
                                                   Keller Jordan's scaling sqrt(max(1, A/B)), not
                                                   Moonlight's 0.2 sqrt(max(A, B))
    adamw            0,1,2  fp32, bf16             torch AdamW (no JIT-compiled op)

ZeRO 1/2 hand a client optimizer flat 1-D partitions, which Muon cannot orthogonalise;
DeepSpeed's bf16 mode wraps it in an optimizer that flattens on GPU; so the client Muon runs at
ZeRO 0 and gets bf16 through `torch_autocast` (fp32 master weights, bf16 matmuls). ZeRO 3 is
refused: DeepSpeed's Muon rejects it ("Muon and reduce scatter cannot be used together") and the
export here reads full parameters on rank 0. `expert_parallel` > 1 (training.expert_parallel)
runs with every combination above except bf16 at ZeRO 0 with a DeepSpeed-built optimizer (the
ZeRO-0 bf16 optimizer reduces its own buffers, which the loop's expert-parallel reduction does
not reach): ZeRO 0 with the loop reducing the gradients, ZeRO 1/2 with DeepSpeed's ZeRO
optimizer partitioning and reducing the experts over their expert-data-parallel group (tested in
fp32 on gloo; bf16 there is the same ZeRO optimizer with bf16 buffers, not run here).
"""
from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from evals import long_context
from training.synthetic import SyntheticConfig

Optimizer = Literal["muon", "muon_split", "deepspeed_muon", "adamw"]
CLIENT_MUON = ("muon", "muon_split")


class LaunchConfig(BaseModel):
    """How the ranks are started. One node: torchrun's environment (training.spawn starts the
    ranks, or a single rank alone). Several: a hostfile (DeepSpeed launcher, pdsh/ssh) or torchrun
    on every node with the same master address and port."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    launcher: Literal["torchrun", "deepspeed"] = Field("torchrun", description=(
        "torchrun (torchrun's environment; on one node training.spawn starts the ranks) or deepspeed (the "
        "DeepSpeed launcher over a hostfile)"))
    nproc_per_node: int = Field(1, ge=1, description="ranks per node (GPUs per node on a cluster)")
    nnodes: int = Field(1, ge=1, description="nodes the ranks run on")
    node_rank: int = Field(0, ge=0, description="torchrun multi-node: this node's rank")
    hostfile: str | None = Field(None, description="DeepSpeed launcher: 'host slots=N' per line")
    master_addr: str | None = Field(None, description="None: 127.0.0.1 (torchrun, one node) or the "
                                    "hostfile's first host (DeepSpeed launcher)")
    master_port: int | None = Field(None, ge=1, le=65535, description="None: pick a free port")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto: nccl on CUDA, gloo on CPU")

    @model_validator(mode="after")
    def _check(self) -> "LaunchConfig":
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be < nnodes={self.nnodes}")
        if self.hostfile and self.launcher != "deepspeed":
            raise ValueError("a hostfile needs launcher: deepspeed (torchrun takes nnodes/node_rank/master_addr)")
        if self.nnodes > 1 and self.launcher == "torchrun" and self.master_addr in (None, "127.0.0.1", "localhost"):
            raise ValueError("torchrun with nnodes > 1 needs master_addr set to node 0's reachable address")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("nnodes > 1 needs an explicit master_port (every node must use the same one)")
        return self

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class TrainConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # ---- batch: global batch = micro_batch_size * grad_accum * world_size sequences
    micro_batch_size: int = Field(4, ge=1, description=(
        "sequences per rank per forward/backward pass (global batch = micro_batch_size x grad_accum x world "
        "size)"))
    grad_accum: int = Field(1, ge=1, description="micro-batches whose gradients are summed into one optimizer step")
    # ---- length: at most max_steps, and at most token_budget tokens when one is given
    max_steps: int = Field(1000, ge=1, description="optimizer steps to run (fewer when token_budget runs out first)")
    token_budget: int | None = Field(None, ge=1, description="tokens to train on (all ranks)")

    # ---- optimizer
    optimizer: Optimizer = Field("muon_split", description=(
        "muon / muon_split (training.optim: Muon, or GLM-5's Muon Split per attention head, with AdamW for "
        "the rest; ZeRO 0), deepspeed_muon (DeepSpeed's Muon, ZeRO 0-2) or adamw"))
    lr: float = Field(3e-3, gt=0, description=(
        "peak learning rate (Muon reuses AdamW's: its update is scaled to AdamW's RMS)"))
    weight_decay: float = Field(0.1, ge=0, description="decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's beta1, beta2 (the parameters AdamW updates)")
    eps: float = Field(1e-8, gt=0, description="AdamW's epsilon")
    momentum: float = Field(0.95, ge=0, lt=1, description="Muon's (Nesterov) momentum")
    grad_clip: float = Field(1.0, ge=0, description="global-norm clipping; 0 = off")

    # ---- LR schedule: linear warm-up, then cosine to min_lr_ratio*lr, or WSD (stable, then a
    # linear decay over the last decay_fraction of the steps)
    schedule: Literal["cosine", "wsd", "constant"] = Field("cosine", description=(
        "cosine: linear warm-up then cosine to min_lr_ratio x lr; wsd: warm-up, stable, then linear decay "
        "over the last decay_fraction of the steps; constant"))
    warmup_steps: int = Field(0, ge=0, description="steps of linear learning-rate warm-up")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description=(
        "the learning rate at the end of the decay, as a fraction of lr"))
    decay_fraction: float = Field(0.2, gt=0, le=1, description=(
        "schedule wsd: the last fraction of the steps over which the learning rate decays"))

    # ---- DeepSpeed
    zero_stage: Literal[0, 1, 2] = Field(0, description=(
        "DeepSpeed ZeRO stage (0 for the client Muon optimizers; 3 is refused)"))
    precision: Literal["fp32", "bf16"] = Field("fp32", description="fp32 on CPU, bf16 on GPU")
    launch: LaunchConfig = Field(LaunchConfig(), description="how the ranks are started (one node or several)")
    # Part of the stage key, not OPERATIONAL: the losses match expert_parallel 1 only within float
    # tolerance (all-to-all dispatch sums in another order), and checkpoints hold one file per
    # expert shard, so a run resumes only with the value it was written with.
    expert_parallel: int = Field(1, ge=1, description="ranks that split each MoE layer's routed experts "
                                 "(contiguous groups of this many ranks, tokens dispatched by all-to-all; "
                                 "training.expert_parallel); 1 = every rank holds every expert")

    # ---- checkpoints, evaluation, logging
    checkpoint_every: int = Field(50, ge=1, description="steps between checkpoints (and at the end)")
    keep_last: int = Field(2, ge=1, description="complete checkpoints kept")
    eval_sequences: int = Field(64, ge=1, description="held-out sequences scored before and after")
    deterministic: bool = Field(True, description="torch deterministic algorithms (bit-exact resume on CPU)")
    seed_offset: int = Field(0, ge=0, description="added to the run seed (model init, data order)")
    # A pod eviction gives terminationGracePeriodSeconds (30 s by default) between SIGTERM and
    # SIGKILL: finishing the step, writing the checkpoint and mirroring it to S3 must fit, so
    # this stays below the pod's grace period (deployments/k8s sets that from this value).
    preempt_grace_s: float = Field(25.0, gt=0, description="seconds from SIGTERM to finish the current step and "
                                   "write a checkpoint; past it (or on a second signal) the ranks exit at once")

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.optimizer in CLIENT_MUON and self.zero_stage != 0:
            raise ValueError(
                f"optimizer {self.optimizer!r} (training.optim Muon) needs zero_stage 0: ZeRO "
                f"{self.zero_stage} hands the optimizer flattened 1-D partitions, which Muon cannot "
                "orthogonalise. Use optimizer 'deepspeed_muon' (DeepSpeed's Muon, ZeRO 1/2) or 'adamw'."
            )
        if self.optimizer == "deepspeed_muon" and self.zero_stage > 0 and self.grad_clip > 0:
            raise ValueError(
                "optimizer 'deepspeed_muon' at ZeRO 1/2 writes the Muon update into the gradient "
                "partitions before DeepSpeed takes the global norm, so grad_clip would clip the "
                "orthogonalised update, not the gradient: set grad_clip 0"
            )
        ep, world = self.expert_parallel, self.launch.world_size
        if ep > 1 and world % ep:
            raise ValueError(f"expert_parallel={ep} must divide the world size (launch.world_size = "
                             f"nproc_per_node x nnodes = {world}): ranks form groups of expert_parallel")
        if ep > 1 and self.zero_stage == 0 and self.precision == "bf16" and self.optimizer not in CLIENT_MUON:
            raise ValueError(
                f"expert_parallel={ep} with precision bf16 and zero_stage 0 needs optimizer muon or muon_split "
                f"(bf16 by autocast): DeepSpeed's ZeRO-0 bf16 optimizer for {self.optimizer!r} reduces its own fp32 "
                "gradient buffers, which the loop's expert-parallel reduction does not reach; use zero_stage 1 "
                "or 2 (DeepSpeed's ZeRO optimizer partitions and reduces the experts over their "
                "expert-data-parallel group)")
        return self

    def steps_for(self, seq_len: int) -> int:
        """Optimizer steps to run for sequences of seq_len tokens."""
        per_step = self.micro_batch_size * self.grad_accum * self.launch.world_size * seq_len
        if self.token_budget is None:
            return self.max_steps
        return min(self.max_steps, max(1, self.token_budget // per_step))


class PretrainConfig(TrainConfig):
    """Pretraining on the `pack` stage's sequences. vocab_size comes from the tokenizer: the
    model gets exactly the tokenizer's vocabulary unless model_overrides sets a larger one
    (padding to a multiple of 64 is a common choice); a smaller one is an error."""

    model_preset: Literal["tiny", "small", "glm5"] = Field("tiny", description=(
        "the model shape (model.config presets); vocab_size comes from the tokenizer"))
    model_overrides: dict[str, Any] = Field(default_factory=dict, description=(
        "ModelConfig fields changed from the preset, e.g. {num_layers: 4}"))
    synthetic: SyntheticConfig | None = Field(None, description="synthetic token tasks added to the "
                                              "packed text (training.synthetic); reserves ids above the tokenizer's")

    @model_validator(mode="after")
    def _check_model(self) -> "PretrainConfig":
        from model.config import preset
        from model.hf import to_hf_config

        try:
            model = preset(self.model_preset, **self.model_overrides)
        except Exception as e:  # pydantic's ValidationError or the preset's own ValueError
            raise ValueError(f"model_overrides do not give a valid {self.model_preset} model: {e}") from None
        # The stage publishes a Hugging Face export; find out now, not after training. (Its
        # warnings, e.g. about dense_attention, belong to the export, not to loading a config.)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            to_hf_config(model)
        if model.n_routed_experts % self.expert_parallel:
            raise ValueError(f"expert_parallel={self.expert_parallel} must divide the model's "
                             f"n_routed_experts={model.n_routed_experts}: each rank of a group holds an equal share")
        return self


class MixConfig(BaseModel):
    """Sampling weights of the long-context mix: weight = quality weight x source weight
    (default_weight when its source is not listed) x long_weight when the document has at least
    long_chars characters. Under max_chars the heaviest documents are kept first (the last one cut
at a line end to fit); each kept
    document is repeated min(weight, max_repeats) times (floor, plus one more with probability
    frac)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sources: dict[str, float] = Field(default_factory=lambda: {"issue-pr": 3.0, "code": 2.0, "stdlib": 2.0}, description=(
        "weight of a document by its source (times its quality weight)"))
    default_weight: float = Field(1.0, ge=0, description="weight of a document whose source is not in sources")
    long_chars: int = Field(8000, ge=1, description="documents with at least this many characters count as long")
    long_weight: float = Field(2.0, ge=0, description="extra weight factor of a long document")
    min_chars: int = Field(0, ge=0, description="documents shorter than this are left out")
    max_chars: int | None = Field(None, ge=1, description="cap on the characters packed (the "
                                  "heaviest documents first, before repetition); None = all")
    max_repeats: float = Field(4.0, ge=1, description="a document is repeated at most this many times")
    repo_level: bool = Field(True, description="concatenate a repository's files into one document")

    @model_validator(mode="after")
    def _check(self) -> "MixConfig":
        bad = {k: v for k, v in self.sources.items() if v < 0}
        if bad:
            raise ValueError(f"source weights must be >= 0, got {bad}")
        return self


class RetrievalDocsConfig(BaseModel):
    """Synthetic retrieval documents (evals.long_context.training_documents: the evaluation's
    formats with training keys only) mixed into a long-context phase's data."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lengths: tuple[int, ...] = Field((256, 512), description=(
        "prompt lengths (tokens) of the synthetic retrieval documents; each must stay below seq_len"))
    docs_per_task: int = Field(50, ge=0, description="per length and task; 0 = none")
    tasks: tuple[str, ...] = Field(long_context.TASKS, description=(
        "retrieval tasks the documents are drawn from (evals.long_context.TASKS)"))
    key_value_docs: int = Field(0, ge=0, description="dense key-value recall documents "
                                "(evals.long_context.key_value_documents)")
    seed: int = Field(1, description="the evaluation suite has its own seed; keys never overlap")

    @model_validator(mode="after")
    def _check(self) -> "RetrievalDocsConfig":
        long_context.check_lengths_and_tasks(self.lengths, self.tasks, "retrieval.")
        return self


class LongDataConfig(TrainConfig):
    """A phase trained on long sequences packed here from the curated documents (the long-context
    mix), plus synthetic retrieval documents."""

    seq_len: int = Field(1024, ge=16, description="tokens per packed sequence of this phase")
    mix: MixConfig = Field(MixConfig(), description=(
        "sampling weights of the long-context mix packed from the curated documents"))
    val_fraction: float = Field(0.05, gt=0, lt=1, description="share of the packed documents kept for validation")
    retrieval: RetrievalDocsConfig = Field(RetrievalDocsConfig(docs_per_task=0), description=(
        "synthetic retrieval documents mixed into the phase's data (none by default)"))
    synthetic: SyntheticConfig | None = Field(None, description="synthetic token tasks at this phase's "
                                              "seq_len; the model must have been pretrained with them")

    @model_validator(mode="after")
    def _check_retrieval(self) -> "LongDataConfig":
        # A retrieval document is its prompt (at most `length` tokens) + answer + end-of-text:
        # it must fit in one packed sequence, or no copy of it would ever be seen whole.
        if self.retrieval.docs_per_task and max(self.retrieval.lengths) >= self.seq_len:
            raise ValueError(f"retrieval.lengths {self.retrieval.lengths} must stay below seq_len "
                             f"{self.seq_len} (the document adds its answer and <|endoftext|>)")
        return self


class ContextConfig(LongDataConfig):
    """One context-extension phase: continue from the previous stage's weights on longer
    sequences with a larger RoPE base."""

    rope_theta: float = Field(50000.0, gt=0, description=(
        "the RoPE base of this phase (a larger base for longer sequences)"))
