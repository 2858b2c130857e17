"""Training-step throughput: the DeepSpeed stage's step vs a plain PyTorch loop, and MFU.

Same model (same init), same batches, same optimizer, in one process:
  plain      model(...) -> loss.backward() -> clip_grad_norm_ -> opt.step() -> zero_grad,
             then the router-bias update (what a hand-written loop does)
  deepspeed  training.loop.train_step: engine(...) -> engine.backward -> engine.step, router
             update (exactly what every rank of the pretrain stage runs)
for two optimizer setups: Muon Split + AdamW (training.optim) at ZeRO 0, and AdamW at ZeRO 2
(torch.optim.AdamW in the plain loop). One rank: the overhead DeepSpeed adds to a step, not
the collectives (two ranks on 2 cores give the same tokens/s as one, see the stack notes).

MFU = model FLOPs / s over the machine's measured matmul peak (a large fp32 matmul timed here,
best of several). Model FLOPs per token = 3 x forward matmul FLOPs (model.info.flops_per_token,
attention at the mean causal context, DSA top-k; MTP not counted: a lower bound).

    python bench/train.py                       # tiny model, synthetic tokens
    python bench/train.py --pack DIR            # batches from a packed dataset (pack artifact)
    python bench/train.py --steps 30 --rounds 5 --threads 2 --hidden 64 --seq-len 256 --batch 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def matmul_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Best-of fp32 GEMM rate with the same thread count as the training steps."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b                                                           # warm-up
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Synthetic:
    """Random tokens with a document boundary in the middle of each sequence."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.tokens = rng.integers(2, vocab, size=(n, seq_len))
        self.seq_len, self.meta = seq_len, {"pad_id": 1}

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"input_ids": self.tokens[i], "doc_starts": np.array([0, self.seq_len // 2])}


def model_config(args, vocab: int):
    from model.config import tiny

    return tiny().replace(vocab_size=vocab, hidden_size=args.hidden, num_layers=args.layers, first_k_dense=1,
                          intermediate_size=3 * args.hidden, num_heads=2, q_lora_rank=32, kv_lora_rank=32,
                          qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, index_n_heads=2,
                          index_head_dim=16, index_topk=64, n_routed_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=args.hidden * 3 // 2, mtp_depth=1,
                          max_position_embeddings=max(2048, args.seq_len))


def plain_step(model, opt, loader, clip: float, gamma: float) -> None:
    from model.moe import update_router_bias

    b = loader.next_batch()
    out = model(b["input_ids"], labels=b["labels"], doc_ids=b["doc_ids"])
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    update_router_bias(model, gamma)


def make_step(setup: str, args, dataset, mcfg):
    """A closure running one training step of `setup` on its own model (same init, same data)."""
    from model.model import GLMModel
    from training.config import TrainConfig
    from training.data import PackedLoader
    from training.engine import build_engine
    from training.loop import train_step
    from training.optim import build_optimizer

    torch.manual_seed(0)
    model = GLMModel(mcfg)
    loader = PackedLoader(dataset, args.batch, seed=0)
    muon = setup.endswith("muon_split")
    cfg = TrainConfig(optimizer="muon_split" if muon else "adamw", zero_stage=0 if muon else 2,
                      micro_batch_size=args.batch, lr=3e-3, grad_clip=1.0)
    if setup.startswith("plain"):
        opt = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay, num_heads=mcfg.num_heads) if muon \
            else torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)
        return lambda: plain_step(model, opt, loader, cfg.grad_clip, mcfg.bias_update_rate)
    engine = build_engine(model, cfg, cuda=False)
    return lambda: train_step(engine, loader, 1, cfg.zero_stage, mcfg.bias_update_rate, "cpu")


def compare(pair: tuple[str, str], args, dataset, mcfg) -> dict[str, list[float]]:
    """Seconds per step of both setups, in alternating rounds so that a change in machine load
    (this machine is shared) hits both alike."""
    steps = {s: make_step(s, args, dataset, mcfg) for s in pair}
    for s in pair:
        for _ in range(args.warmup):
            steps[s]()
    times: dict[str, list[float]] = {s: [] for s in pair}
    for _ in range(args.rounds):
        for s in pair:
            times[s] += [_timed(steps[s]) for _ in range(args.steps // args.rounds)]
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pack", type=Path, help="packed dataset dir (else synthetic tokens)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5, help="alternations of the two setups")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a torchrun rank has 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    from training.launch import free_port
    from training.loop import skip_shm_comm_op

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    skip_shm_comm_op()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    if args.pack:
        from data_processing.packing import PackedDataset

        dataset = PackedDataset(args.pack, "train")
        args.seq_len, vocab = dataset.seq_len, args.vocab
    else:
        dataset, vocab = Synthetic(4096, args.seq_len, args.vocab), args.vocab
    mcfg = model_config(args, vocab)

    from model.info import flops_per_token, param_counts

    peak = matmul_peak_gflops()
    flops_tok = 3 * flops_per_token(mcfg, context=args.seq_len // 2, sparse=True)
    tokens = args.batch * args.seq_len
    rows = {}
    for pair in (("plain muon_split", "deepspeed zero0 muon_split"), ("plain adamw", "deepspeed zero2 adamw")):
        for setup, secs in compare(pair, args, dataset, mcfg).items():
            med = statistics.median(secs)
            rows[setup] = {"s_per_step": med, "tokens_per_s": tokens / med,
                           "mfu": flops_tok * tokens / med / (peak * 1e9)}
    result = {
        "threads": args.threads, "matmul_peak_gflops": peak, "params": param_counts(mcfg).total_with_mtp,
        "train_flops_per_token": flops_tok, "batch": args.batch, "seq_len": args.seq_len, "setups": rows,
        "deepspeed_overhead": {
            "muon_split zero0": rows["plain muon_split"]["tokens_per_s"] / rows["deepspeed zero0 muon_split"]["tokens_per_s"] - 1,
            "adamw zero2": rows["plain adamw"]["tokens_per_s"] / rows["deepspeed zero2 adamw"]["tokens_per_s"] - 1,
        },
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
