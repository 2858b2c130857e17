"""DSA (lightning-indexer top-k + sparse attention) vs dense causal attention on CPU.

Times one forward + backward pass and measures peak memory at growing sequence length:
- dense: torch scaled_dot_product_attention(is_causal=True) forward + backward (q, k, v).
- DSA:   indexer scores + deterministic top-k chunk by chunk (no grad: the selection is not
         differentiable), then kernels.sparse_attention forward + backward (q, k, v).

Widths keep GLM-5's ratios scaled down: attention 64 heads x (qk 256, v 256) and indexer
32 heads x 128 become, by default, attention 4 x 64 and indexer 2 x 32; top-k stays 2048.

Each (method, length) runs in a fresh subprocess. Peak memory is that process's resident-set
high-water mark (getrusage ru_maxrss, which sees every torch allocation) minus its resident set
just before the measured pass, after the inputs exist: "extra memory the pass needs".

What to expect on CPU (measured on a shared 2-core VM, 1 thread): DSA is 0.03-0.09x the speed
of dense from 2K to 32K, and needs 6-10x its memory (mostly the int64 (T, K) indices). The
sparse half gathers K x H x D fresh key and value floats per query, which is memory-bound,
while SDPA's flash kernel reuses every key tile across a tile of queries. Dense time grows as
T^2 and DSA's as T * K, so the ratio improves with length, but the crossover lies far beyond
32K here; DSA pays off with the MQA (absorbed) form, where one gathered latent row serves all
heads, on GPU kernels.

    python bench/attention.py                        # 2K .. 16K
    python bench/attention.py --lengths 1024 2048    # quick
    python bench/attention.py --lengths 2048 4096 8192 16384 32768
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


def measure(method: str, length: int, args) -> dict:
    """One forward + backward of `method` at `length`, in this (fresh) process."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(REPO))
    from kernels.indexer import indexer_topk
    from kernels.sparse_attention import sparse_attention

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, T, H, D, HI, DI = args.batch, length, args.heads, args.head_dim, args.index_heads, args.index_dim
    q = torch.randn(B, T, H, D, requires_grad=True)
    k = torch.randn(B, T, H, D, requires_grad=True)
    v = torch.randn(B, T, H, D, requires_grad=True)
    q_i, k_i = torch.randn(B, T, HI, DI), torch.randn(B, T, DI)
    w_i = torch.randn(B, T, HI) * (HI * DI) ** -0.5
    dout = torch.randn(B, T, H, D)
    scale = D ** -0.5

    def dense():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=scale).transpose(1, 2)
        out.backward(dout)
        return {}

    def dsa():
        t0 = time.perf_counter()
        with torch.no_grad():
            idx = indexer_topk(q_i, k_i, w_i, args.topk, chunk=args.index_chunk)
        t1 = time.perf_counter()
        out = sparse_attention(q, k, v, idx, scale, chunk=args.attn_chunk)
        out.backward(dout)
        return {"indexer_s": t1 - t0, "sparse_attn_s": time.perf_counter() - t1}

    fn = {"dense": dense, "dsa": dsa}[method]
    base = _rss_mb()
    t0 = time.perf_counter()
    parts = fn()
    seconds = time.perf_counter() - t0
    return {"method": method, "length": length, "seconds": seconds,
            "peak_extra_mb": _peak_rss_mb() - base, **parts}


def run_in_subprocess(method: str, length: int, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--one", method, "--lengths", str(length), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{method} at {length} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--index-heads", type=int, default=2)
    p.add_argument("--index-dim", type=int, default=32)
    p.add_argument("--index-chunk", type=int, default=256, help="indexer queries per step")
    p.add_argument("--attn-chunk", type=int, default=None, help="sparse-attention queries per step")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; 1 is steadier on a shared machine")
    p.add_argument("--one", choices=["dense", "dsa"], help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.one:                                              # child: one measurement
        print(json.dumps(measure(args.one, args.lengths[0], args)))
        return

    passthrough = [a for a in sys.argv[1:]]
    i = passthrough.index("--lengths") if "--lengths" in passthrough else None
    if i is not None:                                         # drop the parent's length list
        j = i + 1
        while j < len(passthrough) and not passthrough[j].startswith("--"):
            j += 1
        passthrough = passthrough[:i] + passthrough[j:]

    print(f"attention {args.heads} x {args.head_dim}, indexer {args.index_heads} x "
          f"{args.index_dim}, top-k {args.topk}, batch {args.batch}, {args.threads} threads; "
          "time = one forward + backward; memory = peak RSS above the inputs")
    header = (f"{'length':>7} {'dense s':>8} {'DSA s':>8} {'(index':>7} {'attn)':>7} "
              f"{'speedup':>8} {'dense MB':>9} {'DSA MB':>8} {'DSA/dense mem':>14}")
    print(header)
    for length in args.lengths:
        dn = run_in_subprocess("dense", length, passthrough)
        ds = run_in_subprocess("dsa", length, passthrough)
        print(f"{length:>7} {dn['seconds']:>8.2f} {ds['seconds']:>8.2f} {ds['indexer_s']:>7.2f} "
              f"{ds['sparse_attn_s']:>7.2f} {dn['seconds'] / ds['seconds']:>7.2f}x "
              f"{dn['peak_extra_mb']:>9.0f} {ds['peak_extra_mb']:>8.0f} "
              f"{ds['peak_extra_mb'] / max(dn['peak_extra_mb'], 1):>13.2f}x", flush=True)


if __name__ == "__main__":
    main()
