"""The RL trainer's update on data-parallel ranks: DeepSpeed ZeRO 0/1/2 and expert parallelism.

Every rank holds the same scored rollout batch (the rollout side hands the whole batch to every
rank) and walks it in the same minibatch order (rl.update shuffles with a generator seeded alike
on every rank); each rank trains on its contiguous share of each minibatch. Group baselines are
computed before any sharding, on the whole batch, so a group split across ranks keeps its
one-rank advantages.

Normalisation. A policy loss is the mean over its batch's samples (rl.algorithms), so a rank
scales its share's loss by n_local * world / n_minibatch: DeepSpeed averages gradients over the
ranks, and that average is then the gradient of the one-rank loss on the whole minibatch, however
unevenly the minibatch divides. (A per-rank mean, unscaled, would weight a sample on a rank with
fewer samples more.)

Lock-step. Collectives (DeepSpeed's gradient all-reduce, expert parallelism's all-to-all in every
MoE forward) need every rank: a rank whose share of a minibatch is empty trains on one sample
with weight 0, and the recomputation of pi_old runs the same number of forward chunks on every
rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Sequence, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from training.config import LaunchConfig
from training.expert_parallel import ExpertParallel

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """Where this process sits among the trainer's data-parallel ranks. One rank (the default)
    needs no torch.distributed at all."""

    rank: int = 0
    world: int = 1
    ep: ExpertParallel | None = None     # expert parallelism's groups, when experts are sharded

    @classmethod
    def current(cls, ep: ExpertParallel | None = None) -> "Ranks":
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls(ep=ep)
        return cls(dist.get_rank(), dist.get_world_size(), ep)

    def with_experts_sharded(self, model: nn.Module, size: int) -> "Ranks":
        """These ranks with `model`'s experts sharded over groups of `size` ranks
        (training.expert_parallel.setup: call on every rank before the engine is built); the same
        ranks for size 1 or a single rank."""
        if size == 1 or self.world == 1:
            return self
        from training import expert_parallel

        return Ranks(self.rank, self.world, expert_parallel.setup(model, size))

    def bounds(self, n: int) -> tuple[int, int]:
        """[lo, hi) of this rank's contiguous share of n items (sizes differ by at most 1)."""
        base, extra = divmod(n, self.world)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (self.rank < extra)

    def share(self, items: Sequence[T]) -> tuple[list[T], float]:
        """This rank's share of a minibatch and the factor on its per-sample-mean loss (module
        doc); an empty share is one sample of the minibatch at factor 0."""
        lo, hi = self.bounds(len(items))
        mine = list(items[lo:hi])
        if not mine:
            return [items[0]], 0.0
        return mine, len(mine) * self.world / len(items)

    def chunks(self, n: int, chunk: int) -> int:
        """Forward chunks each rank runs over its share of n items: the most any rank needs."""
        return max(1, math.ceil(math.ceil(n / self.world) / chunk))

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the ranks (float64)."""
        if self.world == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(t)
        return t.tolist()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (picklable objects; the others pass anything)."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (picklable objects)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


SINGLE = Ranks()


class ParallelConfig(BaseModel):
    """The `parallel:` section of an RL stage: where its trainer runs. One rank (the default)
    trains in the stage's process with a torch AdamW; more start under the launcher pretraining
    uses (rl.launch) and train through a DeepSpeed engine at `zero_stage`. With
    `expert_parallel` > 1 the experts are sharded over the trainer's ranks (training.expert_parallel)
    and every forward is a collective, so the ranks only train: rollouts come from servers
    (rollout.backend=served, rl.served) and the stage evaluates through them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    launch: LaunchConfig = Field(LaunchConfig(), description=(
        "how the trainer's ranks are started (one rank: in the stage's process)"))
    zero_stage: Literal[0, 1, 2] = Field(0, description=(
        "DeepSpeed ZeRO stage of the trainer's engine (more than one rank)"))
    expert_parallel: int = Field(1, ge=1, description="ranks each MoE layer's experts are sharded over (divides "
                                 "the rank count and the model's n_routed_experts)")

    @model_validator(mode="after")
    def _ep_divides(self) -> "ParallelConfig":
        if self.launch.world_size % self.expert_parallel:
            raise ValueError(f"parallel.expert_parallel={self.expert_parallel} must divide the trainer's rank count "
                             f"(parallel.launch: {self.launch.world_size})")
        return self


def check_placement(stage: str, parallel: ParallelConfig, backend: str | None) -> None:
    """Refuse, before anything starts, expert parallelism on ranks that would have to generate:
    with the experts sharded the stage's rollouts (and judges, teachers) must be served.
    backend None: the stage generates nothing (the reward model), so its ranks only train anyway."""
    if parallel.expert_parallel > 1 and backend not in ("served", None):
        raise ValueError(f"{stage}: parallel.expert_parallel={parallel.expert_parallel} needs "
                         f"rollout.backend=served: with the experts sharded no trainer rank holds a whole "
                         f"model to generate with")


def is_engine(optimizer: Any) -> bool:
    """A DeepSpeed engine (which owns backward, the gradient reduction and the step) rather than
    a torch optimizer."""
    return not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "backward")


def engine_step(engine, loss: torch.Tensor, ranks: Ranks, grad_clip: float) -> float:
    """One optimizer step through a DeepSpeed engine on every rank; returns the gradient norm
    before clipping (of the whole gradient, every expert counted once)."""
    engine.backward(loss)
    zero = engine.zero_optimization_stage()
    norm = None
    if ranks.ep is not None and zero == 0:
        # DeepSpeed's ZeRO-0 reduction would average expert shards over all ranks
        # (training.expert_parallel): reduce and clip here, before the step
        ranks.ep.reduce_gradients(engine)
        norm = ranks.ep.clip_grad_norm(engine.module, grad_clip)
    elif zero == 0:
        # the gradients are whole and averaged over ranks; DeepSpeed clips in step()
        norm = _grad_norm(engine.module)
    engine.step()
    if norm is None:
        norm = engine.get_global_grad_norm()
    return float(norm or 0.0)


@torch.no_grad()
def _grad_norm(module: nn.Module) -> float:
    grads = [p.grad.float() for p in module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def build_engine(model: nn.Module, optim, zero_stage: int = 0, expert_parallel: int = 1):
    """A DeepSpeed engine over `model` (already expert-sharded when expert_parallel > 1) with the
    RL stage's optimizer (rl.trainer.OptimConfig: AdamW, fp32 on CPU) at `zero_stage`, through
    the builder pretraining uses (training.engine). DeepSpeed leaves norm gains and biases out
    of weight decay; RL's default decay is 0, where the two are the same."""
    from training.config import LaunchConfig, TrainConfig
    from training.engine import build_engine as ds_engine
    from training.engine import set_lr

    world = Ranks.current().world
    cfg = TrainConfig(optimizer="adamw", lr=optim.lr or 1.0, betas=optim.betas, weight_decay=optim.weight_decay,
                      grad_clip=optim.grad_clip, zero_stage=zero_stage, expert_parallel=expert_parallel,
                      micro_batch_size=1, grad_accum=1, precision="bf16" if torch.cuda.is_available() else "fp32",
                      launch=LaunchConfig(nproc_per_node=world))
    engine = ds_engine(model, cfg, torch.cuda.is_available())
    set_lr(engine, optim.lr)        # 0 (the control run) is a valid RL learning rate
    return engine
