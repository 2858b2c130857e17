"""MoE training step on 2 ranks: expert parallelism (E/2 experts per rank, all-to-all dispatch)
against the replicated MoE (every rank holds all E experts, gradients all-reduced).

One MoE layer (router, routed + shared experts, balance loss) on --tokens tokens per rank;
a step is forward, backward, gradient sync (sync_ep_gradients: all-reduce of replicated
weights, experts only rescaled under EP) and an AdamW update. Reports the median step time,
the time in collectives is part of it. Backend gloo on CPU (what this machine has), NCCL with
one GPU per rank when --backend nccl. Also prints the expert weights each rank holds.

    .venv/bin/python bench/moe_ep.py --tokens 2048 --steps 10

Not run by the tests.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rank(rank: int, world: int, port: int, args, mode: str, out: str) -> None:
    import torch.distributed as dist

    from model.config import preset
    from model.moe import MoE, shard_experts, sync_ep_gradients

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    dev = torch.device(f"cuda:{rank}") if args.backend == "nccl" else torch.device("cpu")
    cfg = preset("tiny").model_copy(update={
        "hidden_size": args.hidden, "n_routed_experts": args.experts, "num_experts_per_tok": args.topk,
        "moe_intermediate_size": args.expert_width})
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    if mode == "ep":
        shard_experts(moe)
    moe = moe.to(dev).train()
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, args.tokens, args.hidden, generator=g).to(dev)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.zero_grad()
        y, stats = moe(x)
        (y.float().pow(2).mean() + 1e-4 * stats["balance"]).backward()
        sync_ep_gradients(moe)
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t)
    expert_params = sum(p.numel() for p in moe.experts.parameters())
    if rank == 0:
        Path(out).write_text(json.dumps({"mode": mode, "median_s": statistics.median(times),
                                         "expert_params_per_rank": expert_params}))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--expert-width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args()
    import tempfile

    rows = []
    for mode in ("replicated", "ep"):
        out = tempfile.mktemp(suffix=".json")
        mp.spawn(_rank, args=(2, free_port(), args, mode, out), nprocs=2)
        rows.append(json.loads(Path(out).read_text()))
    print(f"\n2 ranks ({args.backend}), {args.tokens} tokens/rank, D={args.hidden}, E={args.experts}, "
          f"K={args.topk}, I={args.expert_width}\n")
    print("| MoE | step time (median) | expert parameters per rank |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['median_s'] * 1e3:.1f} ms | {r['expert_params_per_rank']:,} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
