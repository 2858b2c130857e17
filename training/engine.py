"""The DeepSpeed engine from a TrainConfig: config dict, optimizer, initialize.

Optimizers (see training.config for which ZeRO stages and precisions each supports):
  muon / muon_split  training.optim.build_optimizer (Muon or Muon Split + AdamW), handed to
                     DeepSpeed as a client optimizer; bf16 through torch_autocast so the
                     optimizer keeps seeing fp32 matrices of their real shapes.
  deepspeed_muon     DeepSpeed's "Muon" optimizer type (per_head_muon: per-head Newton-Schulz
                     for MLA q_b_proj / kv_b_proj), which runs Muon inside ZeRO 1/2.
  adamw              DeepSpeed's "AdamW" type with torch_adam (no JIT-compiled fused kernel).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from training import expert_parallel
from training.config import CLIENT_MUON, TrainConfig
from training.optim import build_optimizer


def ds_config(cfg: TrainConfig, cuda: bool, n_params: int) -> dict[str, Any]:
    if cfg.precision == "bf16" and not cuda:
        raise ValueError("precision bf16 needs a CUDA device; use precision fp32 on CPU")
    # ZeRO buckets of at most 5e7 elements (DeepSpeed's default is 5e8), and no larger than the
    # model: the buffers are filled every step, which cost seconds per step on a CPU.
    bucket = int(min(5e7, max(1e6, n_params)))
    conf: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        # expert parallelism at ZeRO 0 clips in training.expert_parallel (DeepSpeed's ZeRO-0 norm
        # would average the ranks' norms, each missing the other ranks' experts); at ZeRO 1/2
        # DeepSpeed's MoE-aware norm takes every expert once and clips
        "gradient_clipping": cfg.grad_clip if cfg.expert_parallel == 1 or cfg.zero_stage > 0 else 0.0,
        "zero_optimization": {"stage": cfg.zero_stage, "reduce_bucket_size": bucket,
                              "allgather_bucket_size": bucket, "overlap_comm": cuda},
        "steps_per_print": 2**31 - 1,  # we log ourselves
        "wall_clock_breakdown": False,
    }
    if cfg.precision == "bf16":
        if cfg.optimizer in CLIENT_MUON:
            conf["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
        else:
            conf["bf16"] = {"enabled": True}
    common = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "betas": list(cfg.betas), "eps": cfg.eps}
    if cfg.optimizer == "adamw":
        conf["optimizer"] = {"type": "AdamW", "params": {**common, "torch_adam": True}}
    elif cfg.optimizer == "deepspeed_muon":
        conf["optimizer"] = {"type": "Muon", "params": {**common, "momentum": cfg.momentum,
                                                        "per_head_muon": True, "torch_adam": True}}
    return conf


def _decay_groups(model: nn.Module, expert_groups: bool = False) -> list[dict[str, Any]]:
    """Weight decay on matrices only (norm gains, biases: none), as training.optim does.
    expert_groups: expert-parallel shards (marked by training.expert_parallel.setup) moved into
    groups of their own, marked as DeepSpeed marks its MoE experts' groups ("moe": True, named
    after the expert group), which ZeRO 1/2 partitions over the expert-data-parallel group."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    if not expert_groups:
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(
        [{"params": decay, "name": "decay"}, {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}])


def build_engine(model: nn.Module, cfg: TrainConfig, cuda: bool, load_universal: bool = False):
    """load_universal: the checkpoint to resume is DeepSpeed's universal format (written by
    another rank count and converted, training.checkpoint.to_universal). With expert_parallel > 1
    the model's experts must already be sharded (training.expert_parallel.setup)."""
    import deepspeed

    conf = ds_config(cfg, cuda, sum(p.numel() for p in model.parameters()))
    if load_universal:
        conf["checkpoint"] = {"load_universal": True}
    if cfg.optimizer in CLIENT_MUON:
        opt = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas, eps=cfg.eps,
                              muon_split=cfg.optimizer == "muon_split", momentum=cfg.momentum,
                              num_heads=model.config.num_heads)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
    else:
        if cfg.optimizer == "deepspeed_muon" and not cuda:
            # DeepSpeed's muon_update is torch.compile'd; on CPU inductor would JIT-compile C++
            # kernels (minutes on a small machine). Eager is exact and fast enough here.
            torch._dynamo.config.disable = True
        elif cfg.optimizer == "deepspeed_muon" and cfg.deterministic:
            # the one compiled path: inductor's own flag, which loop.seed_everything leaves unset
            import torch._inductor.config as inductor_config

            inductor_config.deterministic = True
        # ZeRO 1/2 under expert parallelism: DeepSpeed's MoE path partitions and reduces the
        # expert shards (none to train, e.g. the DSA warm-up's frozen trunk: the plain path)
        ep_zero = cfg.expert_parallel > 1 and cfg.zero_stage > 0 and any(
            p.requires_grad for p in expert_parallel.ExpertParallel.expert_params(model))
        with expert_parallel.moe_engine(ep_zero):
            engine, *_ = deepspeed.initialize(model=model, model_parameters=_decay_groups(model, ep_zero),
                                              config=conf)
    if cfg.expert_parallel > 1 and cfg.zero_stage == 0:
        # at ZeRO 0 the loop reduces gradients itself (training.expert_parallel.reduce_gradients):
        # DeepSpeed would average the expert shards over all ranks. At ZeRO 1/2 DeepSpeed's MoE
        # path reduces them (expert_parallel.moe_engine).
        engine.enable_backward_allreduce = False
    return engine


def set_lr(engine, lr: float) -> None:
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
