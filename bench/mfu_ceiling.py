"""How much of the matmul peak can a model of this width reach on this CPU at all?

MFU counts model FLOPs (which are matmul FLOPs) against the rate of one large fp32 matmul. A
training step cannot beat the rate of its own matmuls at their own shapes, so the matmuls of one
step, replayed back to back with nothing else, bound the MFU any implementation of that step
can reach here: the ceiling. For each model:

  1. one training step (forward + backward) runs under a dispatch mode that records every
     aten matmul (mm, addmm, bmm, baddbmm) with its shapes;
  2. those matmuls are replayed alone, on fresh tensors of the same shapes, best of --repeats;
  3. the step itself is timed (plain PyTorch: forward, backward, AdamW).

Printed per model: matmul peak (2048^3, same threads), the step's MFU (matmul FLOPs of the
step / step time / peak), the ceiling (the same FLOPs / replay time / peak), the share of the
step the matmuls take, and the mean FLOPs per matmul. A ceiling under a target says the
target needs a wider model, not faster code.

    .venv/bin/python bench/mfu_ceiling.py [--threads 1] [--widths 32,64,128,256,512] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from machine import machine  # noqa: E402  (bench/machine.py: this script's directory is on sys.path)

aten = torch.ops.aten
MATMULS = {aten.mm.default: "mm", aten.addmm.default: "addmm", aten.bmm.default: "bmm",
           aten.baddbmm.default: "baddbmm"}


class RecordMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple[object, list[torch.Size]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            self.calls.append((func, [a.shape for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


def matmul_flops(func, shapes: list[torch.Size]) -> int:
    name = MATMULS[func]
    a, b = (shapes[1], shapes[2]) if name in ("addmm", "baddbmm") else (shapes[0], shapes[1])
    batch = a[0] if len(a) == 3 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


def replay_seconds(calls, repeats: int) -> float:
    tensors = [(func, [torch.randn(s) for s in shapes]) for func, shapes in calls]
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for func, args in tensors:
            func(*args)
        best = min(best, time.perf_counter() - t)
    return best


def peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def measure(name: str, cfg, batch: int, seq_len: int, steps: int, repeats: int, peak: float) -> dict:
    from model.info import param_counts
    from model.model import GLMModel

    torch.manual_seed(0)
    model = GLMModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(2, cfg.vocab_size, (batch, seq_len + 1))
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        model(x, labels=y).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()                                            # warm-up (allocations, lazy init)
    rec = RecordMatmuls()
    with rec:
        model(x, labels=y).loss.backward()
    opt.zero_grad(set_to_none=True)
    flops = sum(matmul_flops(f, s) for f, s in rec.calls)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    step_s = sorted(times)[len(times) // 2]
    replay_s = replay_seconds(rec.calls, repeats)
    return {"model": name, "hidden_size": cfg.hidden_size, "params": param_counts(cfg).total_with_mtp,
            "tokens_per_step": batch * seq_len, "matmuls_per_step": len(rec.calls),
            "mean_mflops_per_matmul": flops / len(rec.calls) / 1e6, "step_s": step_s,
            "mfu": flops / step_s / 1e9 / peak, "ceiling_mfu": flops / replay_s / 1e9 / peak,
            "matmul_share_of_step": replay_s / step_s}


def pipeline_model(name: str, vocab: int, **overrides):
    """The model a pipeline preset pretrains (configs/NAME.yaml: model_preset + model_overrides)."""
    from glmforge.config import load_config
    from model.config import preset

    pre = load_config(name).pretrain
    return preset(pre.model_preset, **{"vocab_size": vocab, **pre.model_overrides, **overrides})


def main() -> None:

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--widths", default="128,256,512", help="the small preset widened to these hidden sizes")
    ap.add_argument("--vocab", type=int, default=8192, help="the tokenizer's vocabulary (tiny and small train 8,192)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    peak = peak_gflops()
    models = [("tiny", pipeline_model("tiny", args.vocab)), ("small", pipeline_model("small", args.vocab))]
    for w in (int(v) for v in args.widths.split(",") if v):
        # the small preset's model widened: heads of 16 dims, latent ranks and expert widths with w
        models.append((f"small w{w}", pipeline_model("small", args.vocab, hidden_size=w, intermediate_size=3 * w,
                                                     num_heads=w // 16, q_lora_rank=w, kv_lora_rank=w,
                                                     moe_intermediate_size=w)))
    rows = [measure(n, c, args.batch, args.seq_len, args.steps, args.repeats, peak) for n, c in models]
    if args.json:
        print(json.dumps({"machine": machine(), "threads": args.threads, "matmul_peak_gflops": peak,
                          "tokens_per_step": args.batch * args.seq_len, "rows": rows}, indent=1))
        return
    print(machine())
    print(f"fp32 matmul peak {peak:.1f} GFLOP/s ({args.threads} thread(s)); {args.batch} x {args.seq_len} tokens per step")
    print(f"{'model':>12} {'width':>6} {'params':>10} {'matmuls':>8} {'MFLOP/mm':>9} {'MFU':>6} {'ceiling':>8} {'mm share':>9}")
    for r in rows:
        print(f"{r['model']:>12} {r['hidden_size']:>6} {r['params']:>10,} {r['matmuls_per_step']:>8} "
              f"{r['mean_mflops_per_matmul']:>9.2f} {r['mfu']:>6.1%} {r['ceiling_mfu']:>8.1%} {r['matmul_share_of_step']:>9.1%}")


if __name__ == "__main__":
    main()
