"""DSA vs dense attention inside a whole tiny GLMModel, at long-context lengths, on CPU.

Where bench/attention.py times the attention kernels alone, this times what the long-context
evaluation and training actually run: one GLMModel forward + backward of the LM loss at each
length, with the same weights in two modes:
- dense: dense_attention=True, every DSA layer attends to all causal keys (indexer off);
- DSA:   dense_attention=False, the lightning indexer scores every key, deterministic top-k
         picks index_topk of them, and sparse attention reads only those.
Also the forward alone (what greedy evaluation's prefill costs).

Each (mode, length) runs in a fresh subprocess. Memory is that process's resident-set
high-water mark (getrusage ru_maxrss) minus its resident set just before the measured passes,
after the model and inputs exist: "extra memory the pass needs".

Measured (shared 2-core VM, 1 thread, load average ~3):

    length  dense fwd  DSA fwd  fwd x  dense train  DSA train  train x  dense MB  DSA MB  mem x
      1024       0.21     0.13  1.59x         0.45       0.33    1.37x       301     223  0.74x
      2048       0.99     0.34  2.94x         1.80       0.73    2.47x       690     422  0.61x
      4096       3.76     1.84  2.04x         7.38       1.88    3.93x      1994     825  0.41x
      8192      14.81     3.00  4.94x        30.56       4.51    6.77x      7020    1596  0.23x

Before (c5dc8f7, the selection took top-k over the whole [B,T,S] indexer score matrix; same
session, right after): DSA train 3.44 s at 4K (2.34x) and 10.00 s at 8K (2.80x), forward 2.33 /
7.60 s. The DSA layers now score and select chunk by chunk over the queries, each chunk against
the keys up to its last position only (model/indexer.py Indexer.select): about half the scoring
and top-k work, and no T x S tensor.

    python bench/long_context.py                          # 1K .. 8K, tiny preset, top-k 64
    python bench/long_context.py --lengths 1024 2048 --topk 256
"""

import argparse
import json
import sys
import time
from pathlib import Path

from memory import peak_rss_mb, rss_mb, run_one_in_subprocess  # bench/memory.py (the script's directory is on sys.path)

REPO = Path(__file__).resolve().parents[1]


def measure(mode: str, length: int, args) -> dict:
    """Forward, then forward + backward, of `mode` at `length`, in this (fresh) process."""
    import torch

    sys.path.insert(0, str(REPO))
    from model.config import preset
    from model.model import GLMModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # MTP off: its block would add one more DSA layer per step and blur the comparison.
    cfg = preset(args.preset).replace(mtp_depth=0, index_topk=args.topk,
                                      max_position_embeddings=max(length, 2048),
                                      dense_attention=(mode == "dense"))
    model = GLMModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, length + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    base = rss_mb()

    t0 = time.perf_counter()
    with torch.no_grad():
        model(x)
    forward_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    out = model(x, labels=y)
    out.loss.backward()
    train_s = time.perf_counter() - t0
    return {"mode": mode, "length": length, "forward_s": forward_s, "train_s": train_s,
            "peak_extra_mb": peak_rss_mb() - base}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--topk", type=int, default=64, help="index_topk (the tiny preset's)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--one", choices=["dense", "dsa"], help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.one:                                              # child: one measurement
        print(json.dumps(measure(args.one, args.lengths[0], args)))
        return

    passthrough = list(sys.argv[1:])
    if "--lengths" in passthrough:                            # drop the parent's length list
        i = j = passthrough.index("--lengths")
        j += 1
        while j < len(passthrough) and not passthrough[j].startswith("--"):
            j += 1
        passthrough = passthrough[:i] + passthrough[j:]

    print(f"GLMModel preset {args.preset}, top-k {args.topk}, batch {args.batch}, {args.threads} thread(s); "
          "fwd = forward (no grad); train = forward + backward of the LM loss; "
          "memory = peak RSS above model + inputs")
    print(f"{'length':>7} {'dense fwd':>10} {'DSA fwd':>8} {'fwd x':>6} {'dense train':>12} {'DSA train':>10} "
          f"{'train x':>8} {'dense MB':>9} {'DSA MB':>8} {'DSA/dense mem':>14}")
    for length in args.lengths:
        dn = run_one_in_subprocess(__file__, "dense", length, passthrough)
        ds = run_one_in_subprocess(__file__, "dsa", length, passthrough)
        print(f"{length:>7} {dn['forward_s']:>10.2f} {ds['forward_s']:>8.2f} "
              f"{dn['forward_s'] / ds['forward_s']:>5.2f}x {dn['train_s']:>12.2f} {ds['train_s']:>10.2f} "
              f"{dn['train_s'] / ds['train_s']:>7.2f}x {dn['peak_extra_mb']:>9.0f} {ds['peak_extra_mb']:>8.0f} "
              f"{ds['peak_extra_mb'] / max(dn['peak_extra_mb'], 1):>13.2f}x", flush=True)


if __name__ == "__main__":
    main()
