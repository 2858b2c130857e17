"""A group's prompt computed once vs once per sample: rollouts and the trainer, same samples.

GRPO samples `group` responses per prompt, and rl-general's prompts are long (a tool schema, a
rubric) before a short answer. Both sides of RL can compute a shared prompt once:
- rollouts (rl.rollout.RolloutEngine): one prefill per distinct prompt, its KV cache copied to
  each of the group's rows (model.generate's `rows`);
- the trainer (rl.update): the old log-prob recompute and every minibatch's forward + backward
  run each distinct prompt (but its last token) once, and each sample's response over a copy of
  its latent KV cache (collate's `share_prefix`); gradients of the copies sum into the prompt.
- agent turns (rl.rollout.TurnCache): each turn of an episode continues the KV cache of its
  previous turn and feeds only the new tokens (the last sampled token and the tool's reply).
Both arms of each side run in this process on the same model and samples; the results agree
(tests/rl/test_prefix_sharing.py checks log-probs, gradients and sampled tokens).

    .venv/bin/python bench/rl_prefix.py [--model tiny small] [--prompt 24 600] [--response 32] [--group 8] [--prompts 4] [--json]

--model: the models the tiny or small preset pretrains (configs/*.yaml: pretrain.model_preset and
model_overrides); --prompt 600 is rl-general's tool prompts, ~24 rl-reasoning's addition prompts;
every model is timed at every prompt length.

Prints per side the seconds of each arm and their ratio, and the trainer's token passes per
update (tokens through the layers, a backward counted as two forwards) and FLOPs per update
(model.info.flops_per_token at the full length) of each arm. Not a test: timings on a shared machine vary.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.config import preset  # noqa: E402
from model.generate import generate  # noqa: E402
from model.info import flops_per_token  # noqa: E402
from model.model import GLMModel  # noqa: E402
from rl.rollout import SamplingParams  # noqa: E402
from rl.sample import Sample  # noqa: E402
from rl.update import UpdateParams, update  # noqa: E402

PAD = 0


def samples_for(a, vocab: int) -> list[Sample]:
    """`prompts` random prompts of `prompt` tokens (lengths staggered by a few tokens, as real
    ones are), `group` responses each of up to `response` tokens, random advantages."""
    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(a.prompts):
        prompt = torch.randint(1, vocab, (a.prompt - 3 * k,), generator=g).tolist()
        for _ in range(a.group):
            r = int(torch.randint(a.response // 2, a.response + 1, (1,), generator=g))
            s = Sample(None, k, list(prompt))
            s.response_ids = torch.randint(1, vocab, (r,), generator=g).tolist()
            s.loss_mask, s.rollout_logprobs = [1] * r, [-2.0] * r
            s.reward = float(torch.rand(1, generator=g))
            s.advantage = float(torch.randn(1, generator=g))
            out.append(s)
    return out


def update_cost(samples: list[Sample], cfg, minibatches: int) -> dict[str, int]:
    """Token passes and forward FLOPs of one update, a backward counted as two forwards: the
    pi_old forward over the batch, then forward + backward of each minibatch (rl.update's split,
    the same generator); each sample's whole sequence (plain), or each distinct prompt but its
    last token once per pass and each sample's rest (shared). A token at position t attends to
    t + 1 keys (model.info.flops_per_token); the vocabulary projection runs on response
    positions only, as the trainer's does."""
    head = 2 * cfg.hidden_size * cfg.vocab_size
    per_position = [flops_per_token(cfg, t + 1, sparse=True) for t in range(max(
        len(s.prompt_ids) + len(s.response_ids) for s in samples))]

    def cost(part: list[Sample], share: bool) -> tuple[int, int]:
        tokens = flops = 0
        prompts = {tuple(s.prompt_ids) for s in part} if share else ()
        for p in prompts:                                     # positions 0 .. len(p) - 2
            tokens += len(p) - 1
            flops += sum(per_position[:len(p) - 1]) - head * (len(p) - 1)
        for s in part:
            first = len(s.prompt_ids) - 1 if share else 0
            last = len(s.prompt_ids) + len(s.response_ids) - 1          # positions first .. last - 1
            tokens += last - first
            flops += sum(per_position[first:last]) - head * (len(s.prompt_ids) - 1 - first)
        return tokens, flops

    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0)).tolist()
    size = -(-len(samples) // minibatches)
    parts = [[samples[j] for j in order[k:k + size]] for k in range(0, len(samples), size)]
    out = {}
    for share, name in ((False, ""), (True, "_shared")):
        tokens, flops = cost(samples, share)
        for part in parts:
            t, f = cost(part, share)
            tokens, flops = tokens + 3 * t, flops + 3 * f
        out[f"token_passes{name}"], out[f"flops_per_update{name}"] = tokens, flops
    return out


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def trainer_arm(model: GLMModel, samples: list[Sample], share: bool, repeats: int) -> float:
    """Seconds of one update (the pi_old recompute, then `minibatches` forward + backward +
    AdamW steps), from the same weights each time."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = UpdateParams(minibatches=2, share_prefix=share)

    def run():
        model.load_state_dict(state)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        update(model, opt, [_fresh(s) for s in samples], PAD, params, torch.Generator().manual_seed(0))

    return best(run, repeats)


def _fresh(s: Sample) -> Sample:
    c = Sample(s.task, s.group, s.prompt_ids)
    c.response_ids, c.loss_mask, c.rollout_logprobs = s.response_ids, s.loss_mask, s.rollout_logprobs
    c.reward, c.advantage = s.reward, s.advantage
    return c


def rollout_arm(model: GLMModel, a, share: bool, repeats: int) -> float:
    """Seconds to sample `response` tokens for every sample: one prefill per distinct prompt, or
    one per sample."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, model.config.vocab_size, (a.prompt - 3 * k,), generator=g) for k in range(a.prompts)]
    T0 = max(len(p) for p in prompts)

    def left_pad(ps):
        ids, mask = torch.zeros(len(ps), T0, dtype=torch.long), torch.zeros(len(ps), T0, dtype=torch.long)
        for i, p in enumerate(ps):
            ids[i, T0 - len(p):], mask[i, T0 - len(p):] = p, 1
        return ids, mask

    rows = torch.arange(a.prompts).repeat_interleave(a.group)
    ids, mask = left_pad(prompts if share else [prompts[r] for r in rows])
    return best(lambda: generate(model, ids, a.response, attention_mask=mask, rows=rows if share else None,
                                 generator=torch.Generator().manual_seed(0)), repeats)


def agent_arm(model: GLMModel, a, cached: bool, repeats: int) -> float:
    """Seconds for `turns` agent turns of every episode through rl.rollout.RolloutEngine.complete:
    each turn samples up to `response` tokens, then a tool reply of 8 tokens joins the
    conversation. With the turn cache a turn feeds only its new tokens; without it, the whole
    conversation again."""
    from rl.rollout import RolloutEngine

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, model.config.vocab_size, (a.prompt - 3 * k,), generator=g).tolist()
               for k in range(a.prompts)]
    reply = torch.randint(1, model.config.vocab_size, (8,), generator=g).tolist()

    def run():
        engine = RolloutEngine(model, None, [], PAD, batch_size=256)
        if not cached:
            engine.turns.longest = lambda p: (0, None)
        convs = [list(p) for p in prompts for _ in range(a.group)]
        for turn in range(a.turns):
            outs = engine.complete(convs, SamplingParams(1.0, 1.0, a.response), torch.Generator().manual_seed(turn))
            convs = [c + toks + reply for c, (toks, *_) in zip(convs, outs)]

    return best(run, repeats)


def measure(model_name: str, prompt: int, a) -> dict:
    """Both arms of each side for one model and prompt length."""
    from glmforge.config import load_config

    torch.manual_seed(0)
    pretrain = load_config(model_name).pretrain
    cfg = preset(pretrain.model_preset, **pretrain.model_overrides)
    model = GLMModel(cfg)
    a = argparse.Namespace(**{**vars(a), "prompt": prompt})
    samples = samples_for(a, cfg.vocab_size)
    cost = update_cost(samples, cfg, minibatches=2)

    trainer_arm(model, samples[:2], False, 1)          # warm-up: first-call allocations and kernel set-up
    train = {share: trainer_arm(model, samples, share, a.repeats) for share in (False, True)}
    model.eval()
    roll = {share: rollout_arm(model, a, share, a.repeats) for share in (False, True)}
    agent = {cached: agent_arm(model, a, cached, a.repeats) for cached in (False, True)}
    r = {"model": model_name, "prompt": prompt,
         "trainer_s": train[False], "trainer_shared_s": train[True], "trainer_speedup": train[False] / train[True],
         "rollout_s": roll[False], "rollout_shared_s": roll[True], "rollout_speedup": roll[False] / roll[True],
         "agent_s": agent[False], "agent_cached_s": agent[True], "agent_speedup": agent[False] / agent[True],
         **cost}
    r["token_ratio"] = cost["token_passes"] / cost["token_passes_shared"]
    r["flops_ratio"] = cost["flops_per_update"] / cost["flops_per_update_shared"]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "small"), nargs="+", default=["tiny"],
                    help="the presets whose models to time (each with every --prompt)")
    ap.add_argument("--prompt", type=int, nargs="+", default=[600],
                    help="prompt tokens (rl-general's tool prompts: ~600; rl-reasoning's addition prompts: ~24)")
    ap.add_argument("--response", type=int, default=32, help="response tokens at most")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (GLM-5: 32)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3, help="agent turns (the agent arm)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for model_name in a.model:
        for prompt in a.prompt:
            r = measure(model_name, prompt, a)
            rows.append(r)
            if not a.json:
                print(f"{model_name}, prompt {prompt}: trainer {r['trainer_s']:.2f} s per update -> "
                      f"{r['trainer_shared_s']:.2f} s shared = {r['trainer_speedup']:.2f}x (token passes "
                      f"{r['token_ratio']:.2f}x fewer, FLOPs {r['flops_ratio']:.2f}x fewer); rollouts {r['rollout_s']:.2f} "
                      f"-> {r['rollout_shared_s']:.2f} s = {r['rollout_speedup']:.2f}x; agent turns {r['agent_s']:.2f} "
                      f"-> {r['agent_cached_s']:.2f} s with the turn cache = {r['agent_speedup']:.2f}x", flush=True)
    if a.json:
        print(json.dumps({"rows": rows, "settings": {"response": a.response, "group": a.group, "prompts": a.prompts,
                                                     "turns": a.turns, "threads": a.threads, "repeats": a.repeats}},
                         indent=1))


if __name__ == "__main__":
    main()
