"""The training stages for the pipeline registry:

    pack, tokenize ----------------------------------> pretrain
    pretrain,  decontaminate, tokenize --------------> context-1
    context-1, decontaminate, tokenize --------------> context-2
    context-2, decontaminate, tokenize --------------> context-3

`pretrain` trains a model of `model_preset` (+ model_overrides, vocab from the tokenizer) on the
pack stage's sequences. Each `context-k` is one context-extension phase (GLM-5: 32K, 128K,
200K): it starts from the previous stage's weights with its own seq_len and RoPE base, on a
long-context mix it packs from the curated documents. Phases are separate stages with fixed
names (not named after their lengths, which differ per preset): each is cached and resumed on
its own, and the stage list does not depend on the config.

Every stage runs its ranks through training.launch (torchrun / DeepSpeed launcher), resumes from
the newest intact checkpoint in workdir.checkpoint, and publishes under workdir.out:
    consolidated.safetensors   our state dict + ModelConfig (the next phase loads it)
    hf/                        HF export (config.json, model.safetensors, tokenizer.json)
    metrics.jsonl, tensorboard/, loss.png, eval.json
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from data_processing.packing import PackedDataset
from data_processing.tokenizer import load_tokenizer
from runtime.stage import Workdir
from model.config import ModelConfig, preset
from model.hf import artifact_weights, state_config
from model.info import param_counts
from training import checkpoint, metrics, synthetic
from training.config import ContextConfig, PretrainConfig, TrainConfig
from training.launch import run_ranks
from training.longdata import pack_stage_data
from training.loop import CHECKPOINT, METRIC
from training.objectives import LMSpec, ObjectiveSpec
from training.rank_spec import RankSpec

log = logging.getLogger("glmforge")
CONTEXT_STAGES = ("context-1", "context-2", "context-3")


def model_config_for(cfg: PretrainConfig, tokenizer_vocab: int) -> ModelConfig:
    """The preset + overrides, with the tokenizer's vocabulary plus the synthetic tasks' reserved
    ids when the config has them (a larger explicit vocab_size is kept, e.g. padded to a multiple
    of 64; a smaller one cannot embed every token)."""
    tokenizer_vocab += synthetic.RESERVED_IDS if cfg.synthetic else 0
    over = dict(cfg.model_overrides)
    vocab = over.pop("vocab_size", tokenizer_vocab)
    if vocab < tokenizer_vocab:
        raise ValueError(f"model_overrides.vocab_size={vocab} is smaller than the tokenizer's "
                         f"{tokenizer_vocab} tokens")
    return preset(cfg.model_preset, **over, vocab_size=vocab)


def rank_spec(cfg: TrainConfig, model_cfg: ModelConfig, workdir: Workdir, total_steps: int, data_dir: Path,
              tokenizer_dir: Path, init_weights: Path | None, resume: str | None,
              objective: ObjectiveSpec, stop_at: int | None = None) -> RankSpec:
    return RankSpec(
        # the ranks need the shared training fields only (not the model/data sections)
        train=TrainConfig(**{k: getattr(cfg, k) for k in TrainConfig.model_fields}),
        model=model_cfg, seed=workdir.seed + cfg.seed_offset, total_steps=total_steps,
        data_dir=data_dir, tokenizer_dir=tokenizer_dir, checkpoint_dir=workdir.checkpoint, out_dir=workdir.out,
        init_weights=init_weights, resume=resume, objective=objective, stop_at=stop_at)


def train_stage(name: str, cfg: TrainConfig, model_cfg: ModelConfig, data_dir: Path, tokenizer_dir: Path,
                workdir: Workdir, init_weights: Path | None = None,
                objective: ObjectiveSpec | None = None, stop_at: int | None = None) -> dict[str, Any]:
    """Launch (or resume) the ranks, then turn their outputs into the stage artifact + metrics.
    `objective` is what the ranks optimise (training.objectives; default: the LM loss).
    `stop_at`: train only the first steps of the run (its lr schedule unchanged) and stop with
    their checkpoint, nothing published (returns {})."""
    train_ds = PackedDataset(data_dir, "train")
    seq_len = train_ds.seq_len
    if seq_len > model_cfg.max_position_embeddings:
        raise ValueError(f"{name}: sequences of {seq_len} tokens exceed the model's "
                         f"max_position_embeddings={model_cfg.max_position_embeddings}")
    vocab = load_tokenizer(tokenizer_dir).get_vocab_size()
    if vocab > model_cfg.vocab_size:
        raise ValueError(f"{name}: tokenizer has {vocab} tokens, the model's vocab_size is {model_cfg.vocab_size}")
    if "synthetic" in train_ds.meta:
        synthetic.check_vocab(model_cfg.vocab_size, train_ds.meta["synthetic"]["base"], name)
    if model_cfg.n_routed_experts % cfg.expert_parallel:   # a later phase's model comes from its parent
        raise ValueError(f"{name}: expert_parallel={cfg.expert_parallel} must divide the model's "
                         f"n_routed_experts={model_cfg.n_routed_experts}")
    total = cfg.steps_for(seq_len)
    per_rank = len(train_ds) // cfg.launch.world_size
    if per_rank < cfg.micro_batch_size:
        raise ValueError(f"{name}: {len(train_ds)} training sequences are too few for "
                         f"{cfg.launch.world_size} rank(s) x micro_batch_size {cfg.micro_batch_size}")

    ckpt = workdir.checkpoint
    log_path = ckpt / "metrics.jsonl"
    resume = checkpoint.select_resume(ckpt)
    if resume is None:
        log_path.unlink(missing_ok=True)  # steps logged before a crash without a checkpoint rerun
    else:
        metrics.truncate(log_path, resume[1]["step"])
        log.info("%s: resuming from checkpoint %s (step %d of %d)", name, resume[0], resume[1]["step"], total)

    spec = rank_spec(cfg, model_cfg, workdir, total, data_dir, tokenizer_dir, init_weights,
                     resume[0] if resume else None, objective or LMSpec(), stop_at)

    def on_line(line: str) -> None:
        if line.startswith(METRIC + " "):
            rec = json.loads(line[len(METRIC) + 1:])
            workdir.progress(rec["step"], rec["total_steps"], name)
            log.info("%s: step %d/%d loss %.4f (lm %.4f mtp %.4f) lr %.2e grad-norm %s %.0f tok/s load max/mean %.2f",
                     name, rec["step"], rec["total_steps"], rec["loss"], rec["lm"], rec["mtp"], rec["lr"],
                     "n/a" if rec["grad_norm"] is None else f"{rec['grad_norm']:.3f}", rec["tokens_per_s"],
                     rec["expert_load_max_mean"])
        elif line.startswith(CHECKPOINT + " "):
            workdir.persist_checkpoint()
            log.info("%s: checkpoint %s complete", name, json.loads(line[len(CHECKPOINT) + 1:])["tag"])
        elif line.strip():
            log.info("%s: %s", name, line)

    run_ranks(spec, cfg.launch, ckpt / "launch.json", on_line)
    if stop_at is not None and stop_at < total:
        return {}
    return publish(name, workdir, model_cfg, cfg, seq_len, resume)


def publish(name: str, workdir: Workdir, model_cfg: ModelConfig, cfg: TrainConfig, seq_len: int,
            resume: tuple[str, dict] | None) -> dict[str, Any]:
    out = workdir.out
    records = metrics.read(workdir.checkpoint / "metrics.jsonl")
    evals = json.loads((out / "eval.json").read_text())
    shutil.copy(workdir.checkpoint / "metrics.jsonl", out / "metrics.jsonl")
    metrics.write_tensorboard(records, out / "tensorboard", evals)
    metrics.plot_loss(records, out / "loss.png", f"{name}: {model_cfg.num_layers} layers, seq {seq_len}", evals)
    return {
        **metrics.summarize(records),
        **evals,
        "params": param_counts(model_cfg).total_with_mtp,
        "params_active": param_counts(model_cfg).active_with_mtp,
        "seq_len": seq_len,
        "rope_theta": model_cfg.rope_theta,
        "world_size": cfg.launch.world_size,
        "zero_stage": cfg.zero_stage,
        "expert_parallel": cfg.expert_parallel,
        "optimizer": cfg.optimizer,
        "precision": cfg.precision,
        "resumed_from_step": resume[1]["step"] if resume else 0,
    }


# ---------------------------------------------------------------- stage functions
def run_pretrain(cfg: PretrainConfig, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]:
    tok_dir = inputs["tokenize"]
    base = load_tokenizer(tok_dir).get_vocab_size()
    model_cfg = model_config_for(cfg, base)
    data_dir = inputs["pack"]
    if cfg.synthetic:
        data_dir = workdir.checkpoint / "packed"
        meta = synthetic.mix_into(inputs["pack"], data_dir, cfg.synthetic, base, workdir.seed + cfg.seed_offset)
        workdir.persist_checkpoint()
    result = train_stage("pretrain", cfg, model_cfg, data_dir, tok_dir, workdir)
    return {**result, **({"synthetic": meta["synthetic"]} if cfg.synthetic else {})}


def _context_run(name: str, previous: str):
    def run(cfg: ContextConfig, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]:
        init = artifact_weights(inputs[previous], previous)
        base = state_config(init)
        model_cfg = base.replace(rope_theta=cfg.rope_theta,
                                 max_position_embeddings=max(base.max_position_embeddings, cfg.seq_len))
        data_dir, packed = pack_stage_data(cfg, inputs, workdir)
        result = train_stage(name, cfg, model_cfg, data_dir, inputs["tokenize"], workdir, init)
        return {**result, "mix_chars_share": packed["mix_chars_share"],
                "retrieval_documents": packed["extra_documents"], "train_sequences": packed["splits"]["train"]["sequences"]}

    return run


run_context_1 = _context_run("context-1", "pretrain")
run_context_2 = _context_run("context-2", "context-1")
run_context_3 = _context_run("context-3", "context-2")
