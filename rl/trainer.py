"""The RL trainer: what every post-training stage after SFT does alike, around its own step.

Every RL-side stage (rl-reasoning, rl-agentic, reward-model, rl-general, distill) is the same
run around a different step (generate -> score -> train for rl-reasoning; poll the rollout
workers, then train for rl-agentic; a preference batch for the reward model):

    load_policy       the parent stage's weights, the DSA indexer frozen (GLM-5 keeps it fixed
                      during RL), the seed and torch threads set
    build_optimizer   AdamW from the stage's `optim:` section (OptimConfig, one type for all)
    measure_gates     the evaluation gates before training (rl.gates) ...
    run_steps         ... the step loop (below) ...
    publish           ... and after: metrics.jsonl, TensorBoard, the stage's plot, the gate (a
                      broken one raises and nothing is exported), the model export

A stage supplies its rollout source (rl.rollout's in-process engine, or rl.orchestrator's
worker pool) and its algorithm by name (rl.algorithms), and `step(k) -> record`. The loop:

    resume     load_latest() restores the newest good checkpoint (model, optimizer, rollout RNG,
               the stage's own text files and its JSON meta) and cuts metrics.jsonl back to its step,
               so a resumed stage gives the same records as an uninterrupted one;
    metrics    one record per step appended to metrics.jsonl, progress reported to the workdir;
    checkpoint every `checkpoint_every` steps and at the last (training.checkpoint.save_torch:
               atomic, verified, the last `keep_last` kept), mirrored to the store;
    preemption SIGTERM/SIGINT (runtime.shutdown) finish the step in flight, write a checkpoint
               and raise Preempted (`glmforge run` then stops with 128+signal, the run record
               "interrupted"; `glmforge resume STAGE` continues); a second signal interrupts at once.
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from runtime import shutdown
from model.hf import artifact_weights, load_state
from model.model import GLMModel, indexer_parameters
from rl import gates
from rl.gates import GateConfig
from rl.ranks import SINGLE, Ranks, build_engine, engine_step, is_engine
from training import checkpoint, metrics
from training.loop import export

CHECKPOINTS = "ckpt"   # a stage's trainer checkpoints, under its checkpoint folder

log = logging.getLogger("glmforge")
STATE = "state.pt"
RANK_RNG = "rng_rank{:05d}.pt"     # on ranks: each rank's own sampling RNG


class OptimConfig(BaseModel):
    """The `optim:` section of every RL-side stage: AdamW (GLM-5's RL scripts: Adam, lr 1e-6,
    beta2 0.98, no weight decay) and the gradient-norm clip."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float = Field(1e-6, ge=0, description="0: the control run (rollouts and rewards without learning)")
    betas: tuple[float, float] = Field((0.9, 0.98), description="AdamW's beta1, beta2")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    grad_clip: float = Field(1.0, gt=0, description="the gradients' global norm is clipped to this before each step")


def build_optimizer(module: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    trainable = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def clip_and_step(module: torch.nn.Module, optimizer: Any, loss: torch.Tensor, grad_clip: float,
                  ranks: Ranks = SINGLE) -> float:
    """One optimizer step on `loss`; returns the gradient norm before clipping. `optimizer`: a
    torch optimizer, or on ranks a DeepSpeed engine (rl.ranks.engine_step: its reduction, clip
    and step)."""
    if is_engine(optimizer):
        return engine_step(optimizer, loss, ranks, grad_clip)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], grad_clip)
    optimizer.step()
    return float(gnorm)


def load_policy(parent_dir: Path, parent: str, tokenizer, seed: int, threads: Optional[int] = None) -> GLMModel:
    """The parent stage's model, ready to train: vocabulary checked against the tokenizer, the DSA
    indexer frozen, torch seeded (and its threads set when `threads`)."""
    model = load_state(artifact_weights(parent_dir, parent))
    if model.config.vocab_size < tokenizer.get_vocab_size():
        raise ValueError(f"{parent}'s model has vocab_size {model.config.vocab_size}, fewer than the tokenizer's "
                         f"{tokenizer.get_vocab_size()} tokens")
    for p in indexer_parameters(model):
        p.requires_grad_(False)
    torch.manual_seed(seed)
    if threads:
        torch.set_num_threads(threads)
    return model


def measure_gates(model: GLMModel, tokenizer, cfg: GateConfig, seed: int,
                  loaded_from: Optional[tuple[Optional[Path], str]] = None) -> dict[str, float]:
    """The gate evals of `model`. loaded_from=(artifact, stage): the model is that stage's published
    output, whose gates.json records its own evals; taken from there when measured the same way
    (the same weights give the same greedy evals), else measured."""
    if loaded_from is not None:
        known = gates.recorded(gates.read_chain(loaded_from[0]), loaded_from[1], gates.spec(cfg.evals, seed))
        if known is not None:
            log.info("gates: %s's evals taken from its artifact (measured there the same way)", loaded_from[1])
            return known
    return gates.measure(model, tokenizer, cfg.evals, seed)


@dataclass(frozen=True)
class GateCheck:
    """A stage's gate: its evals before and after (measured with `seed`), against its parent's chain
    (rl.gates.finish)."""

    cfg: GateConfig
    before: dict[str, float]
    after: dict[str, float]
    parent_name: str
    parent_chain: Optional[dict[str, Any]]
    seed: int


def publish(stage: str, out: Path, records: list[dict[str, Any]], *, model: Optional[GLMModel] = None,
            tokenizer_dir: Optional[Path] = None, export_info: Optional[dict[str, Any]] = None,
            gate: Optional[GateCheck] = None,
            plot: Optional[Callable[[list[dict[str, Any]], Path], None]] = None) -> Optional[dict[str, Any]]:
    """The end of a stage, in this order: metrics.jsonl, TensorBoard of every numeric key and the
    stage's plot (written even when the gate then fails: they show why); the gate (rl.gates.GateError
    when broken: nothing is exported); the model export (with `model`: consolidated weights + HF
    layout, training.loop.export). Returns the gate chain's results (None without a gate)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    keys = sorted({k for r in records for k, v in r.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"})
    metrics.write_tensorboard(records, out / "tensorboard", keys=keys)
    if plot is not None and records:
        plot(records, out)
    gated = None
    if gate is not None:
        gated = gates.finish(stage, out, gate.parent_chain, gate.parent_name, gate.before, gate.after,
                             gate.cfg.tolerances, gates.counts(gate.cfg.evals), gates.spec(gate.cfg.evals, gate.seed))
    if model is not None:
        export(model, out, str(tokenizer_dir) if tokenizer_dir else None, export_info or {})
    return gated


@dataclass
class Policy:
    """What a checkpoint holds: the trained module, its optimizer (a torch optimizer, or on ranks
    the DeepSpeed engine, rl.ranks), the rollout RNG (None for a stage that samples nothing; on
    ranks the one every rank shares, for the minibatch order), this rank's own sampling RNG (on
    ranks), and the stage's own text files (rl-agentic's sample buffer)."""

    model: torch.nn.Module
    optimizer: Any
    rng: torch.Generator | None = None
    texts: Callable[[], dict[str, str]] = field(default=lambda: {})
    ranks: Ranks = SINGLE
    rank_rng: torch.Generator | None = None


def sampling_rng(gen: torch.Generator, seed: int, ranks: Ranks) -> torch.Generator:
    """The generator rollouts sample from: in one process the stage's one generator, which also
    orders the minibatches (as it always has); on ranks each rank's own, `gen` (the same on every
    rank) ordering the minibatches."""
    return gen if ranks.world == 1 else torch.Generator().manual_seed(seed * 1_000_003 + ranks.rank + 1)


def policy_for(model: torch.nn.Module, optim: OptimConfig, rng: torch.Generator | None, ranks: Ranks = SINGLE,
               zero_stage: int = 0, rank_rng: torch.Generator | None = None,
               texts: Callable[[], dict[str, str]] = lambda: {}) -> "Policy":
    """The trained module with its optimizer: a torch AdamW in one process, a DeepSpeed engine at
    `zero_stage` on ranks (rl.ranks.build_engine; expert-parallel when `ranks.ep`, the model's
    experts already sharded by training.expert_parallel.setup)."""
    if ranks.world == 1:
        return Policy(model, build_optimizer(model, optim), rng, texts)
    ep = ranks.ep.size if ranks.ep is not None else 1
    return Policy(model, build_engine(model, optim, zero_stage, ep), rng, texts, ranks=ranks, rank_rng=rank_rng)


def whole_model(model: torch.nn.Module, ranks: Ranks = SINGLE,
                build: Optional[Callable[[], torch.nn.Module]] = None) -> torch.nn.Module | None:
    """The whole model for what needs every expert in one place (greedy gates, the export): the
    model itself without expert parallelism; with it, the experts gathered (a collective over the
    ranks) into a fresh module on rank 0 (`build()`, by default a GLMModel of the model's config),
    None on the others."""
    if ranks.ep is None:
        return model
    from model.moe import gathered_state_dict

    state = gathered_state_dict(model)
    if ranks.rank != 0:
        return None
    whole = build() if build is not None else GLMModel(model.config)
    whole.load_state_dict(state)
    for p in whole.parameters():
        p.requires_grad_(False)
    return whole


def save(root: Path, step: int, policy: Policy, meta: dict[str, Any], keep_last: int) -> None:
    if is_engine(policy.optimizer):
        _save_on_ranks(root, step, policy, meta, keep_last)
        return
    state = {"model": policy.model.state_dict(), "optimizer": policy.optimizer.state_dict()}
    if policy.rng is not None:
        state["rollout_rng"] = policy.rng.get_state()
    checkpoint.save_torch(root, step, state, meta, keep_last, policy.texts(), name=STATE)


def _save_on_ranks(root: Path, step: int, policy: Policy, meta: dict[str, Any], keep_last: int) -> None:
    """A collective: DeepSpeed's checkpoint (module, optimizer, each rank's ZeRO partitions), each
    rank's sampling RNG, and from rank 0 the shared RNG, the texts and the meta that completes it."""
    ranks, tag = policy.ranks, checkpoint.tag_for(step)
    if ranks.rank == 0:
        shutil.rmtree(root / tag, ignore_errors=True)     # the leftover of an interrupted save
    ranks.barrier()
    policy.optimizer.save_checkpoint(str(root), tag=tag, save_latest=False)
    if ranks.ep is not None:
        ranks.ep.save_shard(policy.optimizer, root / tag)     # rank 0's module file holds its own experts only
    if policy.rank_rng is not None:
        torch.save({"rng": policy.rank_rng.get_state()}, root / tag / RANK_RNG.format(ranks.rank))
    ranks.barrier()
    if ranks.rank == 0:
        torch.save({"rollout_rng": policy.rng.get_state()} if policy.rng is not None else {}, root / tag / STATE)
        for file, text in policy.texts().items():
            (root / tag / file).write_text(text)
        ep = ranks.ep.size if ranks.ep is not None else 1
        checkpoint.finalize(root, tag, {"step": step, "world_size": ranks.world, "expert_parallel": ep, **meta},
                            keep_last)
    ranks.barrier()


def refuse_other_world(root: Path, world: int, stage: str, tag: str | None = None,
                       meta: dict[str, Any] | None = None, expert_parallel: int | None = None) -> None:
    """A ValueError when the checkpoint to resume (`tag`, `meta`; by default the newest complete
    one, from its meta alone: the ranks verify its files) was written by another number of
    trainer ranks (or another expert_parallel, when given). The stage's process asks before it
    starts any rank."""
    if tag is None:
        done = [t for t in checkpoint.tags(root) if (root / t / checkpoint.MARKER).exists()]
        if not done:
            return
        tag = done[-1]
        meta = json.loads((root / tag / checkpoint.META).read_text())
    if meta.get("world_size", 1) != world:
        raise ValueError(f"{stage}: checkpoint {tag} in {root} was written by {meta.get('world_size', 1)} "
                         f"trainer rank(s); resume it on as many (the stage's parallel.launch), or delete it to "
                         f"start over")
    if expert_parallel is not None and meta.get("expert_parallel", 1) != expert_parallel:
        raise ValueError(f"{stage}: checkpoint {tag} in {root} was written with expert_parallel "
                         f"{meta.get('expert_parallel', 1)}; resume it with the same parallel.expert_parallel, or "
                         f"delete it to start over")


def load_latest(root: Path, policy: Policy, log_path: Path, stage: str) -> tuple[int, dict[str, Any], Path] | None:
    """(step, meta, folder) of the newest good checkpoint, with the model, optimizer and RNG
    restored and metrics.jsonl cut back to that step; None (and no metrics file) for a fresh
    start. The stage reads its own text files from the folder. On ranks every rank calls it."""
    found = checkpoint.select_resume(root)
    lead = policy.ranks.rank == 0
    if found is None:
        if lead:
            log_path.unlink(missing_ok=True)
        return None
    tag, meta = found
    refuse_other_world(root, policy.ranks.world, stage, tag, meta,
                       policy.ranks.ep.size if policy.ranks.ep is not None else 1)
    if is_engine(policy.optimizer):
        policy.optimizer.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                         load_lr_scheduler_states=False)
        if policy.ranks.ep is not None:
            policy.ranks.ep.load_shard(policy.optimizer, root / tag)
        state = torch.load(root / tag / STATE, weights_only=True)
        if policy.rank_rng is not None:
            policy.rank_rng.set_state(
                torch.load(root / tag / RANK_RNG.format(policy.ranks.rank), weights_only=True)["rng"])
    else:
        state = torch.load(root / tag / STATE, weights_only=True)
        policy.model.load_state_dict(state["model"])
        policy.optimizer.load_state_dict(state["optimizer"])
    if policy.rng is not None:
        policy.rng.set_state(state["rollout_rng"])
    if lead:
        metrics.truncate(log_path, meta["step"])
        log.info("%s: resuming after step %d", stage, meta["step"])
    return meta["step"], meta, root / tag


def run_steps(stage: str, policy: Policy, step: Callable[[int], dict[str, Any]], *, start: int, steps: int,
              root: Path, log_path: Path, workdir: Any, checkpoint_every: int, keep_last: int,
              meta: Callable[[], dict[str, Any]], describe: Callable[[dict[str, Any]], str]) -> None:
    """Steps start+1 .. steps. `meta()` is the JSON saved with each checkpoint; `describe(record)`
    the progress line. On ranks every rank runs it; rank 0 writes the metrics, and a stop signal
    to any rank stops all of them after the same step (the flag is summed over the ranks)."""
    ranks = policy.ranks
    with shutdown.deferred() as stop_requested:
        for k in range(start + 1, steps + 1):
            record = step(k)
            if ranks.rank == 0:
                metrics.append(log_path, record)
                workdir.progress(k, steps, f"{stage} {describe(record)}")
            stop = ranks.sum([float(stop_requested())])[0] > 0 and k < steps
            if k % checkpoint_every == 0 or k == steps or stop:
                save(root, k, policy, meta(), keep_last)
                workdir.persist_checkpoint()
            if stop:
                raise shutdown.Preempted(f"{stage} stopped by a signal: checkpoint at step {k} of {steps} written")
