"""The RL trainer on ranks: one update on 1 vs 2 gloo ranks, the bucketed weight sync, and the
train/inference mismatch of fake-INT4 rollouts with and without routing replay.

    .venv/bin/python bench/rl_ranks.py [--preset tiny] [--samples 32] [--repeats 3] [--json]

1. Update: the same scored batch (`--samples` responses of the synthetic addition task with
   random advantages), one rl.update call (pi_old pass + 2 minibatch steps, GRPO + IcePop): one
   process with a torch AdamW on all cores (and on 1 thread) vs 2 DeepSpeed ranks (ZeRO 0) with
   the cores shared out, in this script; the ratio is 1-rank time / 2-rank time (the median of
   --repeats after a warm-up). On 2 cores the ranks share them: the ratio says what splitting the
   batch costs or saves here, not what 2 GPUs gain.
2. Weight sync: the preset's and `small`'s full state published as one version in 256 MiB
   buckets by 1 and by 2 ranks (rl.weight_sync; the ranks' parts written one after another here,
   timed each) and loaded whole and verified: bytes, buckets, seconds.
3. Routing replay: rollouts from a fake-INT4 copy (group 16) of the preset's model, the trainer's
   log-probs of the same tokens without and with replayed routes: mean |delta log p| and K3.
   The model is random unless --weights names a consolidated.safetensors (e.g. a tiny run's sft).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chat.template import STOP_TOKENS  # noqa: E402
from data_processing.tokenizer import train_tokenizer  # noqa: E402
from domains import arithmetic  # noqa: E402
from model.config import preset  # noqa: E402
from model.hf import load_state  # noqa: E402
from model.model import GLMModel  # noqa: E402
from model.moe import recording_routes  # noqa: E402
from quant.qat import QATConfig  # noqa: E402
from rl import weight_sync  # noqa: E402
from rl.ranks import Ranks, build_engine  # noqa: E402
from rl.rollout import RolloutEngine, SamplingParams, prompt_ids  # noqa: E402
from rl.sample import Sample  # noqa: E402
from rl.trainer import OptimConfig, build_optimizer  # noqa: E402
from rl.update import UpdateParams, collate, mismatch, recompute_old_logprobs, update  # noqa: E402

OPTIM = OptimConfig(lr=1e-4)
PARAMS = UpdateParams(minibatches=2)


def tokenizer():
    tasks = arithmetic.tasks(200, "train", seed=0)
    return train_tokenizer([t.prompt + " " + t.answer for t in tasks] * 3, vocab_size=300, min_frequency=2)


def model_for(name: str, vocab: int, weights: str | None = None) -> GLMModel:
    if weights:
        return load_state(weights)
    torch.manual_seed(0)
    return GLMModel(preset(name).model_copy(update={"vocab_size": vocab}))


def rollouts(model, tok, n: int, int4: QATConfig | None = None, record: bool = False) -> list[Sample]:
    stops = [tok.token_to_id(t) for t in STOP_TOKENS]
    engine = RolloutEngine(model, tok, stops, tok.token_to_id("<|pad|>"), int4=int4, batch_size=64,
                           record_routes=record)
    tasks = arithmetic.tasks(max(1, n // 4), "train", seed=1)
    samples = [Sample(t, g, prompt_ids(tok, t)) for g, t in enumerate(tasks) for _ in range(4)][:n]
    engine.generate(samples, SamplingParams(1.0, 1.0, 16), torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    for s in samples:
        s.advantage = float(torch.randn((), generator=g))
    return samples


# ---------------------------------------------------------------- 1. update on 1 vs 2 ranks
def _update_times(model_fn, samples, engine_fn, ranks, repeats: int) -> list[float]:
    times = []
    for i in range(repeats + 1):
        model = model_fn()
        opt = engine_fn(model)
        t = time.perf_counter()
        update(model, opt, copy.deepcopy(samples), 0, PARAMS, torch.Generator().manual_seed(0), ranks)
        if i:                                   # the first is a warm-up
            times.append(time.perf_counter() - t)
    return times


def _rank_worker(rank: int, port: int, args, samples, out: str) -> None:
    import deepspeed

    from training.loop import skip_shm_comm_op

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    times = _update_times(lambda: model_for(args.preset, args.vocab, args.weights), samples,
                          lambda m: build_engine(m, OPTIM), Ranks.current(), args.repeats)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    import torch.distributed as dist

    dist.destroy_process_group()


def bench_update(args, samples) -> dict:
    threads = torch.get_num_threads()
    rows = {}
    for n in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(n)
        rows[n] = statistics.median(_update_times(lambda: model_for(args.preset, args.vocab, args.weights), samples,
                                                  lambda m: build_optimizer(m, OPTIM), Ranks(), args.repeats))
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as d, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.start_processes(_rank_worker, args=(port, args, samples, f"{d}/t.json"), nprocs=2, start_method="fork")
        two = json.loads(Path(f"{d}/t.json").read_text())
    m1, m2 = rows[threads], statistics.median(two)
    return {"one_rank_s": m1, "one_rank_threads": threads, "one_rank_1_thread_s": rows[1], "two_ranks_s": m2,
            "ratio": m1 / m2, "ratio_1_thread": rows[1] / m2, "samples": len(samples)}


# ---------------------------------------------------------------- 2. weight sync
def bench_sync(name: str, vocab: int) -> dict:
    model = model_for(name, vocab)
    rows = {}
    for world in (1, 2):
        with tempfile.TemporaryDirectory() as d:
            sent = [weight_sync.publish(Path(d), 1, weight_sync.rank_part(model, r, world), rank=r, world=world,
                                        config_json=model.config.model_dump_json()) for r in range(world)]
            t = time.perf_counter()
            _, state, moved = weight_sync.load_version(Path(d), 1)
            weight_sync.apply(copy.deepcopy(model), state)
            load_s = time.perf_counter() - t
        rows[world] = {"bytes": moved, "buckets": sum(s.buckets for s in sent),
                       "publish_s_slowest_rank": max(s.seconds for s in sent), "load_s": load_s}
    return {"preset": name, "params": sum(p.numel() for p in model.parameters()), "by_ranks": rows}


# ---------------------------------------------------------------- 3. routing replay
def bench_replay(args, tok) -> dict:
    model = model_for(args.preset, args.vocab, args.weights)
    samples = rollouts(model, tok, args.samples, int4=QATConfig(group_size=16), record=True)
    out = {}
    for replay in (False, True):
        ss = copy.deepcopy(samples)
        if not replay:
            for s in ss:
                s.routes = None
        recompute_old_logprobs(model, ss, tok.token_to_id("<|pad|>"), 1.0)
        out["with_replay" if replay else "without_replay"] = mismatch(ss)
    # how often the trainer's own routing differs from the rollout's: the share of (token, MoE layer)
    # whose top-k expert set changes between the INT4 copy and the full-precision weights
    batch = collate(samples, tok.token_to_id("<|pad|>"))
    with torch.no_grad(), recording_routes(model) as logs:
        model(batch["input_ids"], attention_mask=batch["attention_mask"])
    real = batch["attention_mask"].bool()
    changed = [float((got[0].long().sort(-1).values != want.sort(-1).values).any(-1)[real].float().mean())
               for got, want in zip(logs, batch["routes"])]
    out["routes_changed_share"] = sum(changed) / max(len(changed), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--weights", default=None, help="a consolidated.safetensors to use instead of random weights")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json to use with --weights (the run's own)")
    ap.add_argument("--sync-presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--parts", nargs="+", default=["update", "sync", "replay"], choices=["update", "sync", "replay"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(args.tokenizer)
    else:
        tok = tokenizer()
    args.vocab = tok.get_vocab_size() if not args.weights else load_state(args.weights).config.vocab_size
    result = {"settings": {"preset": args.preset, "samples": args.samples, "repeats": args.repeats,
                           "weights": args.weights or "random", "cpus": os.cpu_count()}}
    if "update" in args.parts:
        samples = rollouts(model_for(args.preset, args.vocab, args.weights), tok, args.samples)
        result["update"] = u = bench_update(args, samples)
        print(f"update of {u['samples']} samples: 1 rank {u['one_rank_s']:.2f} s ({u['one_rank_threads']} threads), "
              f"{u['one_rank_1_thread_s']:.2f} s (1 thread); 2 ranks (1 thread each) {u['two_ranks_s']:.2f} s "
              f"= {u['ratio']:.2f}x / {u['ratio_1_thread']:.2f}x")
    if "sync" in args.parts:
        result["weight_sync"] = [bench_sync(p, args.vocab) for p in args.sync_presets]
    if "replay" in args.parts:
        result["routing_replay"] = bench_replay(args, tok)
    for w in result.get("weight_sync", []):
        for world, r in w["by_ranks"].items():
            print(f"weight sync {w['preset']} ({w['params']:,} params) by {world} rank(s): {r['bytes'] / 2**20:.1f} MiB "
                  f"in {r['buckets']} bucket(s), publish {r['publish_s_slowest_rank']:.3f} s (slowest rank), "
                  f"load + verify {r['load_s']:.3f} s")
    rr = result.get("routing_replay", {})
    for k in ("without_replay", "with_replay"):
        if k in rr:
            print(f"INT4 rollouts {k}: mean |d log p| {rr[k]['mismatch/abs_logp']:.4f}, K3 {rr[k]['mismatch/k3']:.5f}")
    if rr:
        print(f"routing changed by INT4 on {rr['routes_changed_share']:.1%} of (token, MoE layer)")
    if args.json:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
