"""Shared pieces of the effect benchmarks (bench/effects_long_context.py, bench/effects_qat.py):
the small GLM-style model they train, the MQAR data spec, and a plain single-process training
loop (Muon Split + AdamW, aux-loss-free router-bias updates) over MQAR batches.

Not a pipeline stage: no DeepSpeed, no Prefect, no checkpoints; the model, optimizer, MQAR data
and DSA losses are the library's own (model/, training/optim.py, evals/mqar.py,
training/dsa_loss.py).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from evals.mqar import MQARSpec, copy_batch, fact_batch, fact_table, mqar_batch  # noqa: E402
from model.config import ModelConfig, preset  # noqa: E402
from model.model import GLMModel  # noqa: E402
from model.moe import update_router_bias  # noqa: E402
from training.optim import build_optimizer  # noqa: E402


def model_config(hidden: int = 64, layers: int = 2, heads: int = 4, vocab: int = 8192, topk: int = 64,
                 experts: int = 4, expert_width: int = 64, max_len: int = 4096, mtp: int = 0,
                 dense_width: int | None = None) -> ModelConfig:
    """The tiny preset's architecture (MLA + indexer + MoE after the first layer) at these widths.
    Pretrained dense (dense_attention=True, indexers present but unused), as GLM-5 does."""
    head_dim = hidden // heads
    return preset("tiny").replace(
        vocab_size=vocab, hidden_size=hidden, num_layers=layers, first_k_dense=1,
        intermediate_size=dense_width or 3 * hidden, num_heads=heads, q_lora_rank=hidden,
        kv_lora_rank=hidden, qk_nope_head_dim=head_dim, qk_rope_head_dim=16, v_head_dim=head_dim,
        index_n_heads=4, index_head_dim=32, index_topk=topk, n_routed_experts=experts,
        num_experts_per_tok=2, moe_intermediate_size=expert_width, mtp_depth=mtp,
        max_position_embeddings=max_len, dense_attention=True)


def mqar_spec(seq_len: int, pairs: int, vocab: int, key_range: int = 256, value_range: int = 256,
              filler_lo: int = 32, layout: str = "pairs_first") -> MQARSpec:
    """Keys and values from the top of the vocabulary (keys below values), random filler from
    [filler_lo, vocab - key_range - value_range)."""
    v_lo = vocab - value_range
    k_lo = v_lo - key_range
    return MQARSpec(seq_len=seq_len, n_pairs=pairs, key_ids=(k_lo, v_lo), value_ids=(v_lo, vocab),
                    filler_ids=(filler_lo, k_lo), layout=layout)


FACTS = {"n": 128, "values": 256, "seed": 1}


def facts_ids(vocab: int):
    """The fact-recall task's id layout: values at the vocabulary's top (256 ids), below them
    the second key token (128 ids), below that the first (128 ids): 16,384 facts."""
    n, nv = FACTS["n"], FACTS["values"]
    v0 = vocab - nv
    table = fact_table(n, n, (v0, vocab), FACTS["seed"])
    return v0 - 2 * n, v0 - n, table


def set_threads(n: int = 1) -> None:
    torch.set_num_threads(n)


def lr_at(step: int, steps: int, lr: float, warmup: int, decay_fraction: float) -> float:
    """Warm-up, constant, then linear decay to 0 over the last decay_fraction of the steps (WSD)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    start = int(steps * (1 - decay_fraction))
    if decay_fraction > 0 and step >= start:
        return lr * max(0.0, (steps - step) / max(1, steps - start))
    return lr


def train_mqar(model: GLMModel, phases: list[tuple[int, int, int]], *, pairs: int, vocab: int, lr: float,
               seed: int, warmup: int = 20, decay_fraction: float = 0.0, weight_decay: float = 0.1,
               log_every: int = 100, extra_loss=None, forward_kwargs=None,
               eval_fn=None, tag: str = "", layout: str = "pairs_first", optimizer=None,
               stop_fn=None, key_range: int = 256, value_range: int = 256, step_offset: int = 0,
               total_steps: int | None = None) -> dict:
    """Train `model` on phases [(seq_len, batch, steps)] or [("copy"|"mqar", seq_len, batch,
    steps)], one after another (a copy warm-up, then a length curriculum). Loss = LM loss on the answer positions (+ extra_loss(out) if given).
    Batches are seeded (seed, seq_len, global step): two arms with the same seed see the same
    data, also when one of them is split into two calls (step_offset; total_steps keeps the lr
    schedule of the whole run). A param group's "lr_mult" scales its lr.
    Returns {"steps", "wall_s", "curve": [(step, loss)], ...}."""
    opt = optimizer or build_optimizer(model, lr, weight_decay, num_heads=model.config.num_heads)
    total = total_steps or sum(p[-1] for p in phases)
    step, t0, curve = step_offset, time.perf_counter(), []
    model.train()
    fk = forward_kwargs or {}
    running = None
    for ph, phase in enumerate(phases):
        kind, (T, B, steps) = (phase[0], phase[1:]) if isinstance(phase[0], str) else ("mqar", phase)
        spec = mqar_spec(T, pairs, vocab, key_range, value_range, layout=layout) if kind != "facts" else None
        for i in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, lr, warmup, decay_fraction) * g.get("lr_mult", 1.0)
            if kind == "facts":     # two-token fact recall: see facts_ids
                fa, fb, table = facts_ids(vocab)
                b = fact_batch(T, B, fa, fb, table, f"train/{seed}/{T}/{step}")
            elif kind == "copy":    # induction warm-up over the key and value ids
                b = copy_batch(T, B, (spec.key_ids[0], spec.value_ids[1]), f"train/{seed}/{T}/{step}")
            else:
                b = mqar_batch(spec, B, f"train/{seed}/{T}/{step}")
            out = model(b["input_ids"], labels=b["labels"], **fk)
            loss = out.loss
            if extra_loss is not None:
                loss = loss + extra_loss(out)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            update_router_bias(model, model.config.bias_update_rate)
            step += 1
            lv = out.losses["lm"].item()
            running = lv if running is None else 0.95 * running + 0.05 * lv
            if step % log_every == 0 or step == total:
                curve.append((step, round(running, 4)))
                msg = f"{tag} step {step}/{total} T={T} lm {running:.3f} ({time.perf_counter() - t0:.0f}s)"
                if eval_fn is not None:
                    msg += " " + eval_fn(T)
                print(msg, flush=True)
                if stop_fn is not None and stop_fn(T, step):
                    break
        else:
            continue
        break
    return {"steps": total, "wall_s": time.perf_counter() - t0, "curve": curve, "optimizer": opt}


def mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd
