"""Expert parallelism inside the DeepSpeed training loop (TrainConfig.expert_parallel = R > 1).

Groups are DeepSpeed's own expert groups (deepspeed.utils.groups, the layout its MoE layer
creates, named "ep_size_R"): ranks [0, R), [R, 2R), ... are expert-parallel (EP) groups, each
holding every expert once, E/R per rank; rank r holds shard r % R, and the W/R ranks holding the
same shard form its expert-data-parallel (EDP) group {r' : r' % R == r % R}.

Parameters: `model.moe.shard_experts` over the EP group before the engine is built, and every
expert parameter marked as DeepSpeed marks its MoE experts (`allreduce = False`, `group_name`),
so the engine's start-up broadcast sends each shard within its EDP group instead of rank 0's
shard to every rank.

Gradients. After backward an expert's gradient already holds the sum over every token its EP
group routed to it (the all-to-all's backward brings them home), so the gradient of the
single-rank model on the global batch (the mean of the W ranks' mean losses) is: replicated
weights averaged over all W ranks, experts summed over the EDP group and divided by W. That is
what DeepSpeed's MoE paths compute, and `sync_ep_gradients` is the W = R case. DeepSpeed takes
them only when the engine holds MoE layers (engine.has_moe_layers, set in
_configure_distributed_model from isinstance(deepspeed.moe.layer.MoE)); who reduces depends on
the ZeRO stage, and each gradient is reduced exactly once:

  ZeRO 0: the engine's backward all-reduce is off (enable_backward_allreduce = False) and
    `reduce_gradients` runs the reduction of engine._reduce_expert_gradients (allreduce_no_retain
    over all ranks / the EDP group, dp_world_size = W). has_moe_layers stays off there: it would
    switch the checkpoint to DeepSpeed's per-expert format, which finds experts by its module names.
  ZeRO 1/2: `moe_engine` sets has_moe_layers while deepspeed.initialize builds the engine, and
    the optimizer's parameter groups put the experts in groups of their own marked as DeepSpeed
    marks its MoE groups ("moe": True, "name": the expert group; training.engine._decay_groups
    with DeepSpeed's split_params_into_different_moe_groups_for_optimizer). DeepSpeed's ZeRO
    optimizer then partitions those groups over the EDP group (_configure_moe_settings:
    real_dp_process_group) and reduce-scatters their gradients there, divided by W
    (average_tensor); the loop leaves the engine's reduction on and reduces nothing itself.

Clipping: DeepSpeed's ZeRO-0 clip averages each rank's own gradient norm, which under EP leaves
out the other ranks' experts. At ZeRO 0 `clip_grad_norm` takes the norm of the whole gradient
(replicated weights once, experts summed over the EP group) and scales like DeepSpeed
(max_norm / (norm + 1e-6), at most 1); the engine's gradient_clipping is 0 there
(training.engine.ds_config). At ZeRO 1/2 DeepSpeed's norm is already the whole gradient's (each
rank's partitions summed over all ranks: every expert shard once) and DeepSpeed clips.

Checkpoints: at ZeRO 0 rank 0 alone writes the module and optimizer (its own shard). Ranks
0..R-1 (EDP rank 0) add `expert_shard_{k:03d}.pt`: shard k's parameters and, at ZeRO 0, their
optimizer state; a resume loads the engine checkpoint and then puts each rank's shard back. At
ZeRO 1/2 every rank writes its optimizer partitions (the experts' over the EDP group, fp32 master
and Adam state) as DeepSpeed does anyway and loads its own back; with has_moe_layers on, DeepSpeed
looks for its own MoE modules' per-expert files, finds none here and writes or reads none, and
the module file still holds rank 0's shard, so the shard file puts each rank's expert weights
back. The export all-gathers the experts (`model.moe.gathered_state_dict`), so the published
model is the full one.

Supported: ZeRO 0 with any optimizer in fp32, and with muon / muon_split in bf16 (autocast);
ZeRO 1/2 with the DeepSpeed-built optimizers (adamw, deepspeed_muon; fp32 tested on gloo, bf16
not run here); training.config refuses the rest. A checkpoint resumes only with the same expert_parallel, ZeRO stage and rank count
(training.checkpoint.reshard says so).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model.moe import MoE, shard_experts

SHARD_FILE = "expert_shard_{:03d}.pt"
BUCKET = 500_000_000   # DeepSpeed's allreduce_gradients default (MEMORY_OPT_ALLREDUCE_SIZE)


def group_name(size: int) -> str:
    return f"ep_size_{size}"


@dataclass
class ExpertParallel:
    size: int        # R: ranks per EP group
    rank: int        # this rank's place in its EP group = the expert shard it holds
    world: int       # W
    ep_group: Any    # torch process groups
    edp_group: Any
    edp_rank: int

    @staticmethod
    def expert_params(model: nn.Module) -> list[nn.Parameter]:
        return [p for m in model.modules() if isinstance(m, MoE) and m.ep_group is not None
                for p in m.experts.parameters()]

    # ------------------------------------------------------------------ gradients
    @torch.no_grad()
    def reduce_gradients(self, engine) -> None:
        """At the accumulation boundary, after the last backward: replicated grads averaged over
        all ranks, expert grads summed over the EDP group, both divided by W (DeepSpeed's
        allreduce_no_retain, as in its buffered_allreduce_fallback for MoE models)."""
        from deepspeed.utils import groups

        experts = {id(p) for p in self.expert_params(engine.module)}
        dense, expert = [], []
        for p in engine.module.parameters():
            if not p.requires_grad or p.numel() == 0:
                continue
            if p.grad is None:   # as DeepSpeed does: every rank reduces the same tensors
                p.grad = torch.zeros_like(p)
            (expert if id(p) in experts else dense).append(p.grad.data)
        for grads, group in ((dense, groups._get_data_parallel_group()), (expert, self.edp_group)):
            for dtype in dict.fromkeys(g.dtype for g in grads):
                engine.allreduce_no_retain([g for g in grads if g.dtype == dtype], dp_group=group,
                                           numel_per_bucket=BUCKET, dp_world_size=self.world)

    @torch.no_grad()
    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """The L2 norm of the whole (reduced) gradient: replicated weights once, every expert of
        the EP group once. Scales the gradients to max_norm when above it (max_norm > 0) with
        DeepSpeed's coefficient. Returns the norm before clipping."""
        import torch.distributed as dist

        experts = {id(p) for p in self.expert_params(model)}
        grads = [p for p in model.parameters() if p.grad is not None]
        zero = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
        sq = lambda ps: sum((torch.linalg.vector_norm(p.grad.float()).double() ** 2 for p in ps), zero)
        local_experts = sq(p for p in grads if id(p) in experts)
        dist.all_reduce(local_experts, group=self.ep_group)
        norm = torch.sqrt(sq(p for p in grads if id(p) not in experts) + local_experts).float()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in grads:
                p.grad.mul_(coef.to(p.grad.dtype))
        return float(norm)

    # ------------------------------------------------------------------ checkpoints
    def save_shard(self, engine, tag_dir: Path) -> None:
        """Ranks 0..R-1 write their shard's parameters into the checkpoint, and at ZeRO 0 their
        optimizer state (at ZeRO 1/2 it is in every rank's own ZeRO partition file)."""
        if self.edp_rank != 0:
            return
        names = {id(p): n for n, p in engine.module.named_parameters()}
        zero = engine.zero_optimization_stage() > 0
        shard = {"ep_rank": self.rank, "ep_size": self.size, "params": {}}
        if not zero:
            shard["optimizer"] = {}
        for p in self.expert_params(engine.module):
            n = names[id(p)]
            shard["params"][n] = p.detach().clone()
            if not zero:
                shard["optimizer"][n] = {k: v.detach().clone() if torch.is_tensor(v) else v
                                         for k, v in engine.optimizer.state.get(p, {}).items()}
        torch.save(shard, Path(tag_dir) / SHARD_FILE.format(self.rank))

    @torch.no_grad()
    def load_shard(self, engine, tag_dir: Path) -> None:
        """After engine.load_checkpoint (which gave every rank rank 0's shard): this rank's own."""
        path = Path(tag_dir) / SHARD_FILE.format(self.rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: checkpoint {Path(tag_dir).name} holds no expert shard "
                                    f"{self.rank} (was it written with expert_parallel {self.size}?)")
        shard = torch.load(path, map_location="cpu", weights_only=True)
        if (shard["ep_rank"], shard["ep_size"]) != (self.rank, self.size):
            raise ValueError(f"{path} is shard {shard['ep_rank']} of {shard['ep_size']}, "
                             f"this rank needs shard {self.rank} of {self.size}")
        params = dict(engine.module.named_parameters())
        if engine.zero_optimization_stage() > 0:
            # the ZeRO partitions (fp32 master, optimizer state) came back with the engine
            # checkpoint, each rank's own; the module file held rank 0's experts
            for n, value in shard["params"].items():
                params[n].copy_(value)     # at ZeRO 1/2 a view into the optimizer's flat buffer
            return
        state = engine.optimizer.state
        for n, value in shard["params"].items():
            p = params[n]
            p.copy_(value)
            cur = state[p]
            for k, v in shard["optimizer"][n].items():
                if torch.is_tensor(v) and torch.is_tensor(cur.get(k)):
                    cur[k].copy_(v)        # keeps the device and dtype the optimizer expects
                else:
                    cur[k] = v.to(p.device) if torch.is_tensor(v) else v


@contextmanager
def moe_engine(enabled: bool = True):
    """While deepspeed.initialize runs inside: the engine counts the model as holding MoE layers
    (has_moe_layers, which DeepSpeed sets only for its own deepspeed.moe.layer.MoE), so its ZeRO
    1/2 optimizer takes the expert groups (expert_parallel_group, expert_data_parallel_group) and
    partitions and reduces the "moe" parameter groups over them. Set right after
    _configure_distributed_model, where DeepSpeed sets it, before the optimizer is configured.
    Off (`enabled` False): nothing changes."""
    if not enabled:
        yield
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._configure_distributed_model

    def configure(self, model):
        original(self, model)
        self.has_moe_layers = True

    DeepSpeedEngine._configure_distributed_model = configure
    try:
        yield
    finally:
        DeepSpeedEngine._configure_distributed_model = original


def setup(model: nn.Module, size: int) -> ExpertParallel:
    """DeepSpeed's expert groups of `size` ranks, the model's experts sharded over them and
    marked as DeepSpeed MoE parameters. Call on every rank with the full model loaded, before
    the engine is built (its optimizer must see the shards)."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    world = dist.get_world_size()
    if world % size:
        raise ValueError(f"expert_parallel={size} does not divide the world size {world}")
    name = group_name(size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(size)
    ep_group = groups._get_expert_parallel_group(name)
    edp_group = groups._get_expert_data_parallel_group(name)
    shard_experts(model, ep_group)
    params = ExpertParallel.expert_params(model)
    if not params:
        raise ValueError(f"expert_parallel={size}: the model has no MoE layer to shard")
    for p in params:
        p.allreduce, p.group_name = False, name   # deepspeed.moe.utils.is_moe_param
    return ExpertParallel(size=size, rank=dist.get_rank(ep_group), world=world, ep_group=ep_group,
                          edp_group=edp_group, edp_rank=dist.get_rank(edp_group))
