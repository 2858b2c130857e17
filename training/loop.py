"""The training loop one rank runs (started by training.launch under torchrun / deepspeed).

The RankSpec (training.rank_spec, a JSON file written by the stage) says everything: train
config, model config, objective, initial weights, packed data, checkpoint and output
directories, the checkpoint to resume.

    build model -> DeepSpeed engine -> resume (engine state, data position, RNG) or score the
    held-out split -> steps (lr from the schedule, grad_accum micro-batches, router-bias
    update) with a checkpoint every checkpoint_every steps -> held-out score -> export.

Expert parallelism (`expert_parallel` > 1, training.expert_parallel): experts sharded before
the engine is built, gradients reduced and clipped by the loop at ZeRO 0 and by DeepSpeed's
MoE-aware ZeRO optimizer at ZeRO 1/2, one expert-shard file per shard in each checkpoint,
experts gathered for the export.

Preemption: SIGTERM/SIGINT set a flag (runtime.shutdown.PreemptionGuard) that every rank
reduces with the step's metrics, so all ranks agree on the step to stop after; they write a
checkpoint (the usual format) and exit with EXIT_PREEMPTED. A second signal, or
`preempt_grace_s` passing first, ends the rank at once; the previous checkpoint stays valid.

Rank 0 prints two kinds of protocol lines the launching stage reacts to:
    GLMFORGE_METRIC {...}       one per step (also appended to metrics.jsonl)
    GLMFORGE_CHECKPOINT {...}   after a checkpoint is complete (the stage persists it)
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_processing.packing import PackedDataset
from runtime.shutdown import EXIT_PREEMPTED, PreemptionGuard
from model.hf import STATE_FILE, load_state, save_pretrained, save_state
from model.model import GLMModel, moe_layers
from model.moe import gathered_state_dict, update_router_bias
from training import checkpoint, expert_parallel, metrics
from training.data import PackedLoader, eval_batches
from training.engine import build_engine, set_lr
from training.expert_parallel import ExpertParallel
from training.objectives import Objective, build_objective
from training.rank_spec import RankSpec
from training.schedule import lr_factor

METRIC, CHECKPOINT = "GLMFORGE_METRIC", "GLMFORGE_CHECKPOINT"


def _dist():
    import deepspeed.comm as dist

    return dist


def _all_reduce_sum(values: list[float]) -> list[float]:
    # NCCL reduces device tensors only; gloo host tensors
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    if _dist().get_world_size() > 1:
        _dist().all_reduce(t)
    return t.tolist()


def _say(kind: str, payload: dict[str, Any]) -> None:
    print(f"{kind} {json.dumps(payload)}", flush=True)


def skip_shm_comm_op() -> None:
    """On CPU DeepSpeed JIT-compiles a shared-memory all-reduce (C++, ~30 s or minutes on a busy
    machine, and a compiler on every node) the first time; gloo's collectives do the job."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        # torch.use_deterministic_algorithms less its import of torch._inductor, made only to set
        # inductor's flag: 2 s of every rank's start-up (a third of a tiny rank's life). Nothing
        # here compiles but DeepSpeed's Muon, whose engine sets that flag (engine.build_engine).
        torch._C._set_deterministic_algorithms(True, warn_only=True)


@torch.no_grad()
def evaluate(model: GLMModel, dataset: PackedDataset, micro_batch_size: int, max_sequences: int,
             rank: int, world: int) -> dict[str, float]:
    """Held-out next-token loss (lm only, token-weighted) and perplexity, over all ranks."""
    was_training = model.training
    model.eval()
    nll, count, done = 0.0, 0, 0
    device = next(model.parameters()).device
    for b in eval_batches(dataset, micro_batch_size, max_sequences, rank, world):
        b = {k: v.to(device) for k, v in b.items()}
        out = model(b["input_ids"], labels=b["labels"], doc_ids=b["doc_ids"], compute_mtp=False)
        n = int((b["labels"] != -100).sum())
        nll += out.losses["lm"].item() * n
        count += n
        done += 1
    if any(m.ep_group is not None for m in moe_layers(model)):
        # each expert-parallel forward is a collective: a rank with fewer held-out sequences runs
        # unscored forwards until it has made as many as rank 0
        n_seq = min(len(dataset), max_sequences)
        pad = {k: v.to(device) for k, v in next(eval_batches(dataset, 1, 1)).items()}
        for _ in range(math.ceil(math.ceil(n_seq / world) / micro_batch_size) - done):
            model(pad["input_ids"], doc_ids=pad["doc_ids"], compute_mtp=False)
    model.train(was_training)
    nll, count = _all_reduce_sum([nll, float(count)])
    assert count > 0, "held-out split has no scored tokens"
    loss = nll / count
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}


@torch.no_grad()
def _grad_norm(model: torch.nn.Module) -> float | None:
    """Global L2 norm of the module's gradients; None where DeepSpeed keeps them elsewhere."""
    grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def _sync_router_load(model: GLMModel, ep: ExpertParallel | None = None) -> None:
    """Sum each MoE layer's expert load over ranks, so every rank makes the same bias update
    (the bias is a buffer: nothing else keeps it equal across ranks). Under expert parallelism
    the forward has summed it over the EP group already: add up one rank per EP group."""
    layers = moe_layers(model)
    if layers and _dist().get_world_size() > 1:
        flat = torch.cat([m.load_since_update for m in layers])
        _dist().all_reduce(flat, group=ep.edp_group if ep else None)
        for m, part in zip(layers, flat.split([m.load_since_update.numel() for m in layers])):
            m.load_since_update.copy_(part)


def train_step(engine, loader: PackedLoader, grad_accum: int, zero_stage: int, gamma: float,
               device, objective: Objective | None = None, ep: ExpertParallel | None = None,
               grad_clip: float = 0.0) -> tuple[dict[str, float], float | None, dict[str, float]]:
    """One optimizer step: grad_accum micro-batches through the engine (DeepSpeed steps the
    optimizer on the last), then the aux-loss-free router-bias update from the expert loads
    of all micro-batches and ranks. Returns this rank's metric sums (the objective's), the
    gradient norm and the balance statistics. With `ep` at ZeRO 0 the gradients are reduced and
    clipped (at grad_clip) here, before the last engine.step."""
    objective = objective or Objective()
    sums: dict[str, float] = {}
    grad_norm = None
    for micro in range(grad_accum):
        b = {k: v.to(device) for k, v in loader.next_batch().items()}
        loss, parts = objective.loss(engine, b)
        engine.backward(loss)
        if ep is not None and zero_stage == 0 and micro == grad_accum - 1:
            # (at ZeRO 1/2 DeepSpeed's MoE-aware ZeRO optimizer reduces and clips: expert_parallel)
            ep.reduce_gradients(engine)
            grad_norm = ep.clip_grad_norm(engine.module, grad_clip)
        elif zero_stage == 0 and micro == grad_accum - 1:
            # ZeRO-0 with a client optimizer does not report the norm; the gradients are
            # whole and already averaged over ranks here, so take it before clipping.
            grad_norm = _grad_norm(engine.module)
        engine.step()
        for k, v in parts.items():
            sums[k] = sums.get(k, 0.0) + v
    if grad_norm is None:
        # ZeRO 1/2: DeepSpeed's norm over the partitions (for deepspeed_muon, of the Muon
        # update it has written there, not of the raw gradient)
        grad_norm = engine.get_global_grad_norm()
    _sync_router_load(engine.module, ep)
    balance = update_router_bias(engine.module, gamma)
    return sums, None if grad_norm is None else float(grad_norm), balance


def train(spec: RankSpec, guard: PreemptionGuard | None = None, objective: Objective | None = None) -> None:
    """Raises SystemExit(EXIT_PREEMPTED) after the preemption checkpoint when `guard` fired.
    `objective` replaces the spec's (for in-process tests of objectives outside the table)."""
    cfg, model_cfg = spec.train, spec.model
    ckpt_dir, out_dir = spec.checkpoint_dir, spec.out_dir
    total = spec.total_steps
    cuda = torch.cuda.is_available()

    import deepspeed

    backend = cfg.launch.backend if cfg.launch.backend != "auto" else ("nccl" if cuda else "gloo")
    if not cuda:
        skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend=backend)
    dist = _dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    seed_everything(spec.seed, cfg.deterministic)

    model = GLMModel(model_cfg)
    if spec.init_weights:
        # Continue from the previous stage: same shapes, new config (RoPE base, max positions);
        # inv_freq is not in the state dict, so the new rope_theta takes effect.
        model.load_state_dict(load_state(spec.init_weights).state_dict(), strict=True)
    # experts sharded after loading the full weights, before the objective changes modules
    ep = expert_parallel.setup(model, cfg.expert_parallel) if cfg.expert_parallel > 1 else None
    objective = objective or build_objective(spec.objective)
    objective.prepare(model)
    resume_meta = json.loads((ckpt_dir / spec.resume / checkpoint.META).read_text()) if spec.resume else None
    # ZeRO 1/2 written by another rank count: DeepSpeed re-partitions only its universal format
    train_json = cfg.model_dump(mode="json")
    universal = bool(resume_meta and resume_meta["world_size"] != world and cfg.zero_stage > 0)
    if universal:
        checkpoint.reshard(resume_meta, train_json, world)   # refuse before converting anything
        if rank == 0:
            checkpoint.to_universal(ckpt_dir, spec.resume)
        dist.barrier()
    engine = build_engine(model, cfg, cuda, load_universal=universal)
    device = engine.device

    train_ds = PackedDataset(spec.data_dir, "train")
    val_ds = PackedDataset(spec.data_dir, "val")
    loader = PackedLoader(train_ds, cfg.micro_batch_size, rank, world, seed=spec.seed)
    seq_len = loader.seq_len
    log_path = ckpt_dir / "metrics.jsonl"

    step, tokens = 0, 0
    if spec.resume:
        tag = spec.resume
        meta = resume_meta
        # another rank count: loader position and RNGs re-dealt (or a ValueError saying why not)
        loader_state, rngs = checkpoint.reshard(meta, train_json, world)
        engine.load_checkpoint(str(ckpt_dir / checkpoint.UNIVERSAL if universal else ckpt_dir), tag=tag,
                               load_optimizer_states=True, load_lr_scheduler_states=False)
        if ep is not None:
            ep.load_shard(engine, ckpt_dir / tag)
        loader.load_state_dict(loader_state)
        checkpoint.set_rng_state(rngs[rank])
        if rank == 0 and meta["world_size"] != world:
            print(f"resharded {tag}: written by {meta['world_size']} rank(s), resumed on {world}", flush=True)
        step, tokens, eval_before = meta["step"], meta["tokens"], meta["eval_before"]
        if rank == 0:
            print(f"resumed from {tag}: step {step}, {tokens} tokens", flush=True)
    else:
        eval_before = evaluate(engine.module, val_ds, cfg.micro_batch_size, cfg.eval_sequences, rank, world)
        if rank == 0:
            print(f"held-out before training: loss {eval_before['loss']:.4f} ppl {eval_before['ppl']:.2f}", flush=True)

    gamma = model_cfg.bias_update_rate
    tokens_per_step = cfg.micro_batch_size * cfg.grad_accum * world * seq_len
    engine.train()
    end = total if spec.stop_at is None else min(spec.stop_at, total)
    while step < end:
        lr = cfg.lr * lr_factor(step, total, cfg.schedule, cfg.warmup_steps, cfg.min_lr_ratio, cfg.decay_fraction)
        set_lr(engine, lr)
        objective.begin_step(engine.module, step)
        t0 = time.perf_counter()
        sums, grad_norm, balance = train_step(engine, loader, cfg.grad_accum, cfg.zero_stage, gamma, device,
                                              objective, ep, cfg.grad_clip)
        # the stop flag rides on the metrics' all-reduce: no extra collective per step
        *reduced, stops = _all_reduce_sum([*sums.values(), float(guard is not None and guard.requested())])
        step += 1
        tokens += tokens_per_step
        dt = time.perf_counter() - t0
        if rank == 0:
            n = cfg.grad_accum * world
            rec = {"step": step, "tokens": tokens, **{k: v / n for k, v in zip(sums, reduced)}, "lr": lr,
                   "grad_norm": grad_norm,
                   "tokens_per_s": tokens_per_step / dt,
                   "expert_load_max_mean": 1.0 + balance["max_violation"]}
            metrics.append(log_path, rec)
            _say(METRIC, {**rec, "total_steps": total})
        if step % cfg.checkpoint_every == 0 or step == end or stops > 0:
            save(engine, ckpt_dir, step, tokens, loader, eval_before, spec, cfg.keep_last, rank, world, ep)
        if stops > 0 and step < end:
            if rank == 0:
                print(f"preempted: checkpoint at step {step} of {total} written; exiting {EXIT_PREEMPTED}", flush=True)
            raise SystemExit(EXIT_PREEMPTED)
    if end < total:     # a prefix: its checkpoint is the result
        return

    eval_after = evaluate(engine.module, val_ds, cfg.micro_batch_size, cfg.eval_sequences, rank, world)
    full = gathered_state_dict(engine.module) if ep is not None else None   # a collective: all ranks
    if rank == 0:
        print(f"held-out after training: loss {eval_after['loss']:.4f} ppl {eval_after['ppl']:.2f}", flush=True)
        export(engine.module, out_dir, spec.tokenizer_dir,
               {"val_loss_before": eval_before["loss"], "val_ppl_before": eval_before["ppl"],
                "val_loss_after": eval_after["loss"], "val_ppl_after": eval_after["ppl"]}, state=full)
    dist.barrier()


def save(engine, ckpt_dir: Path, step: int, tokens: int, loader: PackedLoader, eval_before: dict, spec: RankSpec,
         keep_last: int, rank: int, world: int, ep: ExpertParallel | None = None) -> None:
    dist = _dist()
    tag = checkpoint.tag_for(step)
    rngs: list[Any] = [None] * world
    dist.all_gather_object(rngs, checkpoint.rng_state())  # every rank's RNG goes into rank 0's meta
    # universal_checkpoint_info: what ds_to_universal requires of the client (no TP/PP patterns here)
    # (not with DeepSpeed's MoE path on, expert parallelism at ZeRO 1/2: its checkpoint reserves that
    # key, and an expert-parallel checkpoint is never converted, training.checkpoint.reshard)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False,
                           client_state={} if engine.has_moe_layers else {"universal_checkpoint_info": {}})
    if ep is not None:
        ep.save_shard(engine, ckpt_dir / tag)   # rank 0 wrote its own shard only
    dist.barrier()  # every rank's shards are on disk before rank 0 declares the checkpoint complete
    if rank == 0:
        meta = {"step": step, "tokens": tokens, "loader": loader.state_dict(), "rng": rngs, "world_size": world,
                "eval_before": eval_before, "train": spec.train.model_dump(mode="json"),
                "model": spec.model.model_dump(mode="json"), "seed": spec.seed}
        checkpoint.finalize(ckpt_dir, tag, meta, keep_last)
        _say(CHECKPOINT, {"step": step, "tag": tag})
    dist.barrier()


def export(model: GLMModel, out_dir: Path, tokenizer_dir: Path | None, evals: dict[str, float],
           state: dict[str, torch.Tensor] | None = None) -> None:
    """The stage artifact: our consolidated safetensors (the next stage starts from it) and the
    Hugging Face export with tokenizer.json (for `glmforge eval perplexity --model out/hf`).
    `state`: the full state dict when `model` holds only its expert shard (gathered_state_dict)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # Under ZeRO 1/2 the parameters are views into one flat buffer, which safetensors refuses
    # to save (shared storage): export a copy with tensors of their own.
    state = {k: v.detach().float().clone() for k, v in (model.state_dict() if state is None else state).items()}
    model = GLMModel(model.config)
    model.load_state_dict(state, strict=True)
    model.eval()
    save_state(model, out_dir / STATE_FILE)
    if all(kind == "dsa" for kind in model.config.layer_kinds):
        save_pretrained(model, out_dir / "hf", tokenizer_dir=tokenizer_dir)
    else:
        # transformers' GlmMoeDsa has DSA layers only (model.hf.to_hf_config refuses others): an
        # attention-variant model (the SWA baseline of dsa-adapt) is published in our format only.
        print(f"no HF export: attention pattern {model.config.layer_kinds} is not all DSA", flush=True)
    (out_dir / "eval.json").write_text(json.dumps(evals, indent=1))
