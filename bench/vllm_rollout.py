"""Rollouts on vLLM vs the native engine: the same model, the same prompts, the same token count.

    .venv/bin/python bench/vllm_rollout.py [--prompts 16] [--group 8] [--new-tokens 32] [--threads 2]
                                           [--weights SFT/consolidated.safetensors --tokenizer DIR] [--json]

Both sides generate `--prompts` x `--group` sequences of exactly `--new-tokens` tokens (no stop
tokens) at temperature 1, from the same weights, with `--threads` CPU threads each (the native
engine in this process, all sequences in one batch; the vLLM server with OMP_NUM_THREADS, the
sequences as concurrent requests), and the ratio is vLLM tokens/s over native tokens/s (the
median of --repeats after a warm-up round). Also: the server's start-up, one weight update
(pause, reload, resume), and the log-prob parity of each engine's tokens against the trainer's
forward (mean and max |delta log p|).

The model is the smallest of this family vLLM serves on CPU (GLM-5's MLA latent 512 + 64, one
dense and one MoE layer, random weights) unless --weights names a trained one of that shape.
Needs `make vllm-setup`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_processing.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402
from domains import arithmetic  # noqa: E402
from model.config import tiny  # noqa: E402
from model.hf import load_state  # noqa: E402
from model.model import GLMModel  # noqa: E402
from rl.rollout import RolloutEngine, SamplingParams  # noqa: E402
from rl.sample import Sample  # noqa: E402
from rl.update import recompute_old_logprobs  # noqa: E402
from rl.vllm_engine import VLLMEngine  # noqa: E402
from rl.vllm_server import VLLMConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def parity(model: GLMModel, samples: list[Sample]) -> dict[str, float]:
    recompute_old_logprobs(model, samples, 0, 1.0)
    d = [abs(a - b) for s in samples for a, b in zip(s.rollout_logprobs, s.train_logprobs)]
    return {"mean_abs_dlogp": sum(d) / len(d), "max_abs_dlogp": max(d)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--weights", help="a consolidated.safetensors of the servable shape (else random)")
    ap.add_argument("--tokenizer", help="the tokenizer directory that goes with --weights")
    ap.add_argument("--python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    tasks = arithmetic.tasks(a.prompts, "heldout", seed=0)
    if a.weights:
        tok = load_tokenizer(a.tokenizer)
        model = load_state(a.weights)
    else:
        tok = train_tokenizer([t.prompt + " " + t.answer for t in arithmetic.tasks(200, "train", seed=0)] * 3,
                              vocab_size=300, min_frequency=2)
        torch.manual_seed(0)
        model = GLMModel(tiny().replace(vocab_size=tok.get_vocab_size(), num_layers=2, kv_lora_rank=512,
                                        qk_rope_head_dim=64, index_head_dim=64, dense_attention=True, mtp_depth=0,
                                        rms_norm_eps=1e-6))
    model.eval()
    prompts = [tok.encode(t.prompt).ids for t in tasks]
    params = SamplingParams(1.0, 1.0, a.new_tokens)

    def batch() -> list[Sample]:
        return [Sample(t, g, p) for g, (t, p) in enumerate(zip(tasks, prompts)) for _ in range(a.group)]

    def timed(engine, gen) -> tuple[float, list[Sample]]:
        samples = batch()
        t0 = time.perf_counter()
        engine.generate(samples, params, gen)
        dt = time.perf_counter() - t0
        assert all(len(s.response_ids) == a.new_tokens for s in samples)
        return dt, samples

    tokens = a.prompts * a.group * a.new_tokens
    native = RolloutEngine(model, tok, [], 0, batch_size=a.prompts * a.group)
    gen = torch.Generator().manual_seed(0)
    timed(native, gen)
    native_s = [timed(native, gen)[0] for _ in range(a.repeats)]
    native_parity = parity(model, timed(native, gen)[1])

    cfg = VLLMConfig(python=a.python, max_model_len=max(len(p) for p in prompts) + a.new_tokens + 8,
                     max_num_seqs=a.prompts * a.group, concurrency=a.prompts * a.group,
                     env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                          "OMP_NUM_THREADS": str(a.threads)})
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        with VLLMEngine(model, tok, [], cfg, Path(root)) as engine:
            startup = time.perf_counter() - t0
            timed(engine, gen)
            vllm_s = [timed(engine, gen)[0] for _ in range(a.repeats)]
            vllm_parity = parity(model, timed(engine, gen)[1])
            engine.sync(model, 1)
            update_s = engine.metrics()["vllm/weight_update_s"]

    n_med, v_med = statistics.median(native_s), statistics.median(vllm_s)
    result = {
        "native": {"seconds": n_med, "tokens_per_s": tokens / n_med, **native_parity},
        "vllm": {"seconds": v_med, "tokens_per_s": tokens / v_med, "startup_s": startup, "weight_update_s": update_s,
                 **vllm_parity},
        "ratio_vllm_over_native": n_med / v_med,
        "settings": {"sequences": a.prompts * a.group, "new_tokens": a.new_tokens, "threads_each": a.threads,
                     "tokens": tokens, "repeats": a.repeats, "model": a.weights or "random 2-layer, latent 512+64",
                     "params": sum(p.numel() for p in model.parameters()), "cpu": os.cpu_count()},
    }
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"native {result['native']['tokens_per_s']:.0f} tok/s, vLLM {result['vllm']['tokens_per_s']:.0f} tok/s "
              f"= {result['ratio_vllm_over_native']:.2f}x; vLLM start-up {startup:.0f} s, weight update "
              f"{update_s:.2f} s; parity |dlogp| mean/max native {native_parity['mean_abs_dlogp']:.1e}/"
              f"{native_parity['max_abs_dlogp']:.1e}, vLLM {vllm_parity['mean_abs_dlogp']:.1e}/"
              f"{vllm_parity['max_abs_dlogp']:.1e}")


if __name__ == "__main__":
    main()
