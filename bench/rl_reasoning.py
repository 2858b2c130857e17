"""RL throughput on the tiny model: rollout tokens/s, trainer tokens/s, and one RL step split
into generation / reward / training — the same calls the rl-reasoning stage makes.

    .venv/bin/python bench/rl_reasoning.py [--prompts 16] [--group 8] [--steps 5] [--int4] [--json]

The model is the tiny preset as the pipeline trains it (2 layers, hidden 32; random weights:
speed does not depend on what the weights know), the task the synthetic addition domain, and a
byte-level tokenizer trained on the prompts' alphabet. Ratios are within this one run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chat.template import STOP_TOKENS  # noqa: E402
from data_processing.tokenizer import train_tokenizer  # noqa: E402
from domains import arithmetic  # noqa: E402
from model.config import tiny  # noqa: E402
from model.model import GLMModel  # noqa: E402
from quant.qat import QATConfig  # noqa: E402
from rl.update import UpdateParams, assign_advantages, update  # noqa: E402
from rl.rewards import RewardWorker  # noqa: E402
from rl.rollout import RolloutEngine, SamplingParams, prompt_ids  # noqa: E402
from rl.sample import Sample  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--int4", action="store_true", help="rollouts from a fake-INT4 copy (experts + MLP, group 8)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    tok = train_tokenizer([t.prompt + t.answer for t in arithmetic.tasks(500, "train", 0)], vocab_size=400)
    model = GLMModel(tiny().replace(vocab_size=tok.get_vocab_size(), num_layers=2, first_k_dense=1, hidden_size=32,
                                    intermediate_size=96, num_heads=2, q_lora_rank=32, kv_lora_rank=32,
                                    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, index_n_heads=2,
                                    index_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=48, mtp_depth=1))
    stops = [tok.token_to_id(t) for t in STOP_TOKENS]
    pad = tok.token_to_id("<|pad|>")
    engine = RolloutEngine(model, tok, stops, pad, int4=QATConfig(group_size=8, attention=False) if a.int4 else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    split = {"generate": 0.0, "reward": 0.0, "train": 0.0}
    gen_tokens = train_tokens = 0
    with RewardWorker() as worker:
        for step in range(a.steps):
            engine.sync(model, step)
            tasks = arithmetic.tasks(a.prompts, "train", step)
            samples = [Sample(t, g, prompt_ids(tok, t)) for g, t in enumerate(tasks) for _ in range(a.group)]
            t0 = time.perf_counter()
            engine.generate(samples, SamplingParams(1.0, 1.0, a.max_new_tokens), gen)
            t1 = time.perf_counter()
            for s, o in zip(samples, worker.score([(s.text, s.task) for s in samples], 10.0)):
                s.reward = o.score
            t2 = time.perf_counter()
            assign_advantages(samples, False)
            update(model, opt, samples, pad, UpdateParams(minibatches=2), gen)
            t3 = time.perf_counter()
            if step == 0:
                continue                              # warm-up: first-call allocations
            split["generate"] += t1 - t0
            split["reward"] += t2 - t1
            split["train"] += t3 - t2
            gen_tokens += sum(len(s.response_ids) for s in samples)
            # the trainer processes prompt + response twice (old log-probs) plus once per minibatch
            train_tokens += 2 * sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    total = sum(split.values())
    out = {"rollout_tokens_per_s": gen_tokens / split["generate"],
           "trainer_tokens_per_s": train_tokens / split["train"],
           "step_s": total / (a.steps - 1),
           "split": {k: v / total for k, v in split.items()},
           "settings": {"prompts": a.prompts, "group": a.group, "int4": a.int4, "threads": a.threads}}
    if a.json:
        print(json.dumps(out))
    else:
        print(f"rollout {out['rollout_tokens_per_s']:.0f} generated tokens/s, trainer {out['trainer_tokens_per_s']:.0f} "
              f"tokens/s, {out['step_s']:.2f} s/step: generation {out['split']['generate']:.0%}, reward "
              f"{out['split']['reward']:.0%}, training {out['split']['train']:.0%}")


if __name__ == "__main__":
    main()
