"""The `rl-reasoning` stage: GRPO with IcePop on verifiable domains, after SFT.

    sft (weights), tokenize (tokenizer) --> rl-reasoning

Each step (GLM-5's reasoning RL: fully on-policy, no KL term, group-normalised advantages):
  1. the rollout engine takes the trainer's weights (a new policy version), optionally as a
     fake-INT4 copy (`rollout_int4`: the deployed precision, a real train/inference mismatch);
  2. `prompts_per_step` prompts drawn from the domains by weight, `group_size` samples each;
  3. rewards in a killable worker process (rl.rewards; model-written code in rl.sandbox);
  4. advantages per group, pi_train(theta_old) recomputed on the same token ids, then
     `minibatches` x `epochs` optimizer steps of the GRPO + IcePop loss (rl.update, rl.loss).
The DSA indexer is frozen and top-k is deterministic (model.kernels' tie rule) during RL, as
GLM-5 does, so rollouts and training select the same keys.

Checkpoints (training.checkpoint layout: digests + COMPLETE marker + atomic `latest`) hold the
model, the optimizer, the rollout RNG and the step; the prompts of a step derive from (seed,
step), so a resumed stage replays exactly the rollouts an uninterrupted one would have made.

Metrics: per step in metrics.jsonl and TensorBoard (reward per domain, IcePop masked fraction,
clip fraction, entropy, response length, zero-variance groups, reward failures by reason); for
the stage: reward first/last (means over the first/last 10% of steps), held-out accuracy on the
synthetic domain before/after with standard errors, greedy and sampled (k samples per prompt at
the rollout temperature: the held-out expected reward, which still moves when SFT has left
greedy accuracy at its ceiling), GSM8K test accuracy before/after.
"""
from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, StrictBool, field_validator, model_validator

from chat.template import STOP_TOKENS
from data_processing.tokenizer import load_tokenizer
from domains import arithmetic
from domains.pools import DOMAINS, gsm8k_tasks, load_pools
from domains.task import Task
from runtime.stage import OPERATIONAL, Workdir
from rl import gates, reward_audit, trainer
from rl import dynamic_sampling
from rl.dynamic_sampling import apply_overlong, fill_batch
from rl.prompts import PromptPoolConfig, draw_tasks, group_size, pool_tasks, read_pool
from rl.ranks import SINGLE, Ranks, check_placement
from rl.rewards import RewardWorker
from rl.scoring import score
from rl.rollout import RolloutEngine, SamplingParams, open_engine, prompt_ids
from rl.sample import Sample, Status
from rl.served import group_seeds
from rl.sandbox import require_isolation
from rl.trainer import GateCheck
from rl.update import UpdateParams, assign_advantages, mismatch_trend, update
from rl.stage_config import GroupRLConfig
from training import metrics

log = logging.getLogger("glmforge")


class RLReasoningConfig(GroupRLConfig):
    steps: int = Field(200, ge=1, description="rollout + update rounds")
    group_size: int = Field(32, ge=2, description="samples per prompt (GLM-5: 32)")
    domains: dict[str, float] = Field({"arithmetic": 1.0}, description=f"prompt weights over {DOMAINS}")
    # sampling
    routing_replay: bool = Field(False, description="rollouts record each token's experts and the trainer's "
                                 "forward passes use them (R3): log-probs of the experts that produced the tokens")
    prompt_pool: PromptPoolConfig = Field(PromptPoolConfig(), description=(
        "draw from rl-prompts' pool measured on the SFT model: filtered by pass rate, weighted by difficulty, hard "
        "prompts sampled more (rl.prompts)"))
    # rewards
    reward_timeout_s: float = Field(10.0, gt=0, description=(
        "seconds one sample's reward may take; past it the sample scores 0 (reason timeout)"))
    recheck_per_step: int = Field(4, ge=0, description="rewarded samples re-checked per step by an independent "
                                  "check (code: fresh inputs vs the reference; rl.reward_audit)")
    recheck_alert: float = Field(0.25, gt=0, le=1, description="share of re-checks that disagree that raises an alert")
    sandbox_allow_weak_isolation: StrictBool = Field(False, json_schema_extra=OPERATIONAL, description=(
        "where bwrap is missing, run the code domain's model-written code anyway, with only limits, a private "
        "uid and an empty environment (rl.sandbox); false: the stage refuses to start"))
    # prompt sources and evaluation
    gsm8k_path: str = Field("{samples}/gsm8k/train.jsonl", description=(
        "GSM8K train questions of the math and tool domains ({samples} expands)"))
    gsm8k_skip: int = Field(200, ge=0, description="GSM8K train lines SFT holds out (not RL prompts)")
    mbpp_path: str = Field("{samples}/mbpp/mbpp.jsonl", description=(
        "MBPP problems of the code domain ({samples} expands)"))
    heldout: int = Field(200, ge=1, description="held-out synthetic prompts, greedy, before and after")
    heldout_samples: int = Field(8, ge=0, description="samples per held-out prompt at the rollout temperature, "
                                 "before and after: the held-out expected reward, which moves where greedy "
                                 "accuracy sits at its ceiling (0: greedy only)")
    gsm8k_test_path: str = Field("{samples}/gsm8k/test.jsonl", description=(
        "GSM8K test questions scored before and after ({samples} expands)"))
    gsm8k_test: int = Field(16, ge=0, description="GSM8K test questions scored before and after (greedy)")
    gsm8k_max_new_tokens: int = Field(256, ge=1, description="generation budget per GSM8K test answer")

    @field_validator("domains")
    @classmethod
    def _domains(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(set(v) - set(DOMAINS))
        if bad:
            raise ValueError(f"unknown domains {bad}; known: {', '.join(DOMAINS)}")
        if any(w < 0 for w in v.values()) or not any(w > 0 for w in v.values()):
            raise ValueError("domain weights must be >= 0 with at least one > 0")
        return v

    @model_validator(mode="after")
    def _replay_needs_native(self) -> "RLReasoningConfig":
        if self.routing_replay and self.rollout.backend != "native":
            raise ValueError("routing_replay needs rollout.backend=native (vLLM's routed experts are not wired in)")
        return self

    @model_validator(mode="after")
    def _placement(self) -> "RLReasoningConfig":
        check_placement("rl-reasoning", self.parallel, self.rollout.backend)
        return self


def require_sandbox(cfg: RLReasoningConfig) -> None:
    """Refuse to start (rl.sandbox.SandboxError) when the code domain would run model-written code
    without isolation, unless the config opts out by name."""
    if cfg.domains.get("code", 0) > 0:
        require_isolation(cfg.sandbox_allow_weak_isolation, "rl_reasoning.sandbox_allow_weak_isolation")


# ---------------------------------------------------------------- one step
def step_record(step: int, samples: list[Sample], stats: dict[str, float], flat: float, failures: Counter,
                seconds: dict[str, float]) -> dict[str, Any]:
    by_domain: dict[str, list[float]] = {}
    for s in samples:
        by_domain.setdefault(s.task.domain, []).append(s.reward)
    lengths = [len(s.response_ids) for s in samples]
    return {
        "step": step,
        "reward": sum(s.reward for s in samples) / len(samples),
        **{f"reward/{d}": sum(v) / len(v) for d, v in sorted(by_domain.items())},
        "zero_variance_groups": flat,
        "response_length": sum(lengths) / len(lengths),
        "truncated_fraction": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        "reward_failures": dict(failures),
        **reward_audit.step_metrics(samples),
        **{k: v for k, v in stats.items()},
        **{f"time/{k}": v for k, v in seconds.items()},
    }


# ---------------------------------------------------------------- evaluation
@torch.no_grad()
def heldout_accuracy(engine: RolloutEngine, worker: RewardWorker, tokenizer, tasks: list[Task],
                     max_new_tokens: int, timeout_s: float) -> dict[str, float]:
    """Greedy accuracy (reward == 1) with its binomial standard error."""
    samples = [Sample(t, i, prompt_ids(tokenizer, t)) for i, t in enumerate(tasks)]
    engine.generate(samples, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens), torch.Generator())
    score(worker, samples, timeout_s)
    p = sum(s.reward >= 1.0 for s in samples) / len(samples)
    return {"acc": p, "stderr": math.sqrt(p * (1 - p) / len(samples)), "n": len(samples)}


@torch.no_grad()
def sampled_accuracy(engine: RolloutEngine, worker: RewardWorker, tokenizer, tasks: list[Task], k: int,
                     sampling: SamplingParams, timeout_s: float, seed: int) -> dict[str, float]:
    """Mean accuracy of `k` samples per prompt at the rollout sampling: the held-out expected
    reward that GRPO raises. Its standard error is over prompts (the per-prompt means are the
    independent draws), so k only narrows each prompt's term. Its own generator, seeded, so the
    number does not depend on the rollouts' RNG and a resumed stage measures the same."""
    samples = [Sample(t, i, prompt_ids(tokenizer, t)) for i, t in enumerate(tasks) for _ in range(k)]
    engine.generate(samples, sampling, torch.Generator().manual_seed(seed))
    score(worker, samples, timeout_s)
    per_prompt = [sum(s.reward >= 1.0 for s in samples[i * k:(i + 1) * k]) / k for i in range(len(tasks))]
    n = len(per_prompt)
    stderr = statistics.stdev(per_prompt) / math.sqrt(n) if n > 1 else 0.0
    return {"acc": statistics.fmean(per_prompt), "stderr": stderr, "n": n, "samples": k}


def evaluate(engine: RolloutEngine, worker: RewardWorker, tokenizer, cfg: RLReasoningConfig,
             heldout: list[Task], gsm8k: list[Task], seed: int) -> dict[str, Any]:
    # Evaluated as deployed: through the rollout engine (INT4 when rollouts are INT4), which the
    # caller has synced to the policy.
    digits = len(heldout[0].answer.split()) + 1
    out = {"heldout": heldout_accuracy(engine, worker, tokenizer, heldout, digits, cfg.reward_timeout_s)}
    if cfg.heldout_samples:
        sampling = SamplingParams(cfg.temperature, cfg.top_p, digits)
        out["heldout_sampled"] = sampled_accuracy(engine, worker, tokenizer, heldout, cfg.heldout_samples, sampling,
                                                  cfg.reward_timeout_s, seed)
    if gsm8k:
        out["gsm8k_test"] = heldout_accuracy(engine, worker, tokenizer, gsm8k, cfg.gsm8k_max_new_tokens,
                                             cfg.reward_timeout_s)
    return out


# ---------------------------------------------------------------- the stage
def prompt_pools(cfg: RLReasoningConfig, inputs: dict[str, Path]
                 ) -> tuple[dict[str, list[Task]], dict[str, list[float]] | None]:
    """The step's prompt sources: each domain's whole pool, or rl-prompts' measured pool under
    `prompt_pool` (with per-prompt weights when weighted by difficulty)."""
    if cfg.prompt_pool.measured:
        from posttrain.rl_prompts import POOL

        return pool_tasks(read_pool(inputs["rl-prompts"] / POOL), cfg.domains, cfg.prompt_pool, "rl-reasoning")
    return load_pools(cfg.domains, gsm8k_path=cfg.gsm8k_path, gsm8k_skip=cfg.gsm8k_skip, mbpp_path=cfg.mbpp_path), None


def run_rl_reasoning(cfg: RLReasoningConfig, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]:
    require_sandbox(cfg)
    prompt_pools(cfg, inputs)            # a pool the policy leaves empty stops the stage before any work
    if cfg.parallel.launch.world_size > 1:
        from rl.launch import run_on_ranks

        return run_on_ranks("rl-reasoning", cfg, inputs, workdir, cfg.parallel.launch)
    return train(cfg, inputs, workdir)


def train(cfg: RLReasoningConfig, inputs: dict[str, Path], workdir: Workdir,
          ranks: Ranks = SINGLE) -> dict[str, Any] | None:
    """The stage in this process, or as one of `ranks` (rl.launch): each rank generates (with its
    own engine, or through the rollout servers) and scores its share of the step's groups with its
    own sampling RNG, every rank trains on all of them (rl.ranks; the experts sharded over them with
    parallel.expert_parallel), rank 0 evaluates, gates, exports and returns the result (the others
    None)."""
    seed = workdir.seed
    lead = ranks.rank == 0
    tokenizer = load_tokenizer(inputs["tokenize"])
    model = trainer.load_policy(inputs["sft"], "sft", tokenizer, seed, cfg.threads)
    ranks = ranks.with_experts_sharded(model, cfg.parallel.expert_parallel)
    stop_ids = [tokenizer.token_to_id(t) for t in STOP_TOKENS]
    pad_id = tokenizer.token_to_id("<|pad|>")
    pools, within = prompt_pools(cfg, inputs)
    heldout = arithmetic.tasks(cfg.heldout, "heldout", seed)
    gsm8k = gsm8k_tasks(cfg.gsm8k_test_path, 0)[: cfg.gsm8k_test] if cfg.gsm8k_test else []

    gen = torch.Generator().manual_seed(seed)
    sample_gen = trainer.sampling_rng(gen, seed, ranks)
    policy = trainer.policy_for(model, cfg.optim, gen, ranks, cfg.parallel.zero_stage, sample_gen)
    sampling = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens)
    params = UpdateParams(cfg.eps_low, cfg.eps_high, cfg.icepop_beta, cfg.minibatches, cfg.epochs,
                          cfg.temperature, cfg.std_normalize, cfg.optim.grad_clip, cfg.policy_loss)
    ckpt_root, log_path = workdir.checkpoint / trainer.CHECKPOINTS, workdir.checkpoint / "metrics.jsonl"
    last: list[Sample] = []
    counts: Counter = Counter()         # a step's overlong counts and reward seconds, over its rounds

    served = cfg.rollout.backend == "served"
    engine_root = workdir.checkpoint / ("engine" if served else f"engine-rank{ranks.rank}")
    with open_engine(cfg.rollout, model, tokenizer, stop_ids, pad_id, engine_root, int4=cfg.rollout_int4,
                     batch_size=cfg.rollout_batch, record_routes=cfg.routing_replay, ranks=ranks
                     ) as engine, RewardWorker() as worker:
        def rollout(step: int, rnd: int, first: int, n: int) -> tuple[list[Sample], Counter]:
            """Round `rnd` of the step: n prompts (group ids first ..), generated and scored by
            each rank for its share, gathered: every rank gets every group."""
            t0 = time.perf_counter()
            tasks = draw_tasks(pools, cfg.domains, n, seed, step, rnd, within)
            lo, hi = ranks.bounds(len(tasks))               # this rank's groups (all of them on one)
            mine = [Sample(t, first + g, prompt_ids(tokenizer, t)) for g, t in enumerate(tasks) if lo <= g < hi
                    for _ in range(group_size(t, cfg.group_size, cfg.prompt_pool))]
            if served:       # one seed per group, drawn alike on any placement: rank count changes nothing
                seeds = group_seeds(seed * 1_000_003 + step + rnd * 7_919_000_001, len(tasks))
                engine.generate(mine, sampling, sample_gen, seeds={first + g: seeds[g] for g in range(lo, hi)})
            else:
                engine.generate(mine, sampling, sample_gen)
            t1 = time.perf_counter()
            failures = score(worker, mine, cfg.reward_timeout_s)
            counts.update(apply_overlong(mine, cfg.overlong, cfg.max_new_tokens))
            if rnd == 0:
                reward_audit.recheck_rewarded(worker, mine, cfg.recheck_per_step, seed, step, cfg.reward_timeout_s)
            counts.update({"time/generate": t1 - t0, "time/reward": time.perf_counter() - t1})
            samples = [s for share in ranks.gather(mine) for s in share]
            return samples, sum((Counter(f) for f in ranks.gather(dict(failures))), Counter())

        def one_step(step: int) -> dict[str, Any]:
            t0 = time.perf_counter()
            engine.sync(model, step)
            counts.clear()
            samples, drawn, failures, dynamic = fill_batch(
                lambda rnd, first, n: rollout(step, rnd, first, n), cfg.prompts_per_step, cfg.dynamic_sampling)
            t2 = time.perf_counter()
            flat = assign_advantages(samples, cfg.std_normalize, cfg.advantage)
            stats = update(model, policy.optimizer, samples, pad_id, params, gen, ranks)
            t3 = time.perf_counter()
            last[:] = samples
            # the reward and its figures from the step's own draw: the trained batch is selected for signal
            seconds = {"generate": t2 - t0 - counts["time/reward"], "reward": counts["time/reward"],
                       "train": t3 - t2}
            rec = step_record(step, drawn, stats, flat, failures, seconds)
            rec.update(engine.metrics())
            rec.update(dynamic)
            keys = ("overlong/truncated", "overlong/filtered", "overlong/penalised")
            rec.update(zip(keys, (int(v) for v in ranks.sum([float(counts[k]) for k in keys]))))
            if ranks.world > 1:
                rec["trainer_ranks"] = ranks.world
            if lead:
                reward_audit.warn("rl-reasoning", rec, cfg.recheck_alert)
            return rec

        resumed = trainer.load_latest(ckpt_root, policy, log_path, "rl-reasoning")
        if resumed is not None:
            start, before = resumed[0], resumed[1]["before"]
        else:
            engine.sync(model, 0)                            # on every rank: a collective with servers
            whole = trainer.whole_model(model, ranks)        # a collective with expert parallelism
            start, before = 0, {}
            if lead:
                before = evaluate(engine, worker, tokenizer, cfg, heldout, gsm8k, seed)
                before["gates"] = trainer.measure_gates(whole, tokenizer, cfg.gates, seed)
        trainer.run_steps("rl-reasoning", policy, one_step, start=start, steps=cfg.steps, root=ckpt_root,
                          log_path=log_path, workdir=workdir, checkpoint_every=cfg.checkpoint_every,
                          keep_last=cfg.keep_last, meta=lambda: {"before": before},
                          describe=lambda r: f"reward {r['reward']:.3f}")
        engine.sync(model, cfg.steps + 1)
        whole = trainer.whole_model(model, ranks)
        if not lead:
            return None
        after = evaluate(engine, worker, tokenizer, cfg, heldout, gsm8k, seed)
    after["gates"] = trainer.measure_gates(whole, tokenizer, cfg.gates, seed)

    records = metrics.read(log_path)
    result = summary(cfg, records, before, after)
    result["trainer_ranks"] = ranks.world
    result["prompt_pool"] = ({"prompts": {d: len(ts) for d, ts in pools.items()},
                              **cfg.prompt_pool.model_dump(exclude={"measured"})}
                             if cfg.prompt_pool.measured else None)
    result["placement"] = {"trainer_ranks": ranks.world, "expert_parallel": cfg.parallel.expert_parallel,
                           "rollout": cfg.rollout.backend,
                           "servers": (len(cfg.rollout.servers.urls) or cfg.rollout.servers.replicas)
                           if cfg.rollout.backend == "served" else 0}
    if cfg.rollout.backend == "served":
        result["weight_sync"] = weight_sync_summary(records)
    gate = GateCheck(cfg.gates, before["gates"], after["gates"], "sft", gates.read_chain(inputs.get("sft")), seed)
    result["gates"] = trainer.publish(
        "rl-reasoning", workdir.out, records, model=whole, tokenizer_dir=inputs["tokenize"], gate=gate,
        export_info={"heldout_before": result["heldout_accuracy"]["before"],
                     "heldout_after": result["heldout_accuracy"]["after"]},
        plot=lambda rs, out: plot_rewards(rs, out / "reward.png", result))
    with open(workdir.out / "samples.jsonl", "w") as f:
        for s in last[: cfg.examples]:
            f.write(json.dumps({"domain": s.task.domain, "prompt": s.task.prompt, "response": s.text,
                                "answer": s.task.answer, "reward": s.reward, "status": s.status.value}) + "\n")
    return result


def weight_sync_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes the trainer's ranks published per version, whole and as deltas, against what every
    version would have cost whole (rl.served)."""
    syncs = [r for r in records if "sync/bytes" in r]
    deltas = [r for r in syncs if r["sync/delta"]]
    return {"versions": len(syncs), "deltas": len(deltas), "full_bytes": syncs[-1]["sync/full_bytes"] if syncs else 0,
            "bytes_per_delta": statistics.fmean(r["sync/bytes"] for r in deltas) if deltas else None,
            "seconds_per_sync": statistics.fmean(r["sync/seconds"] for r in syncs) if syncs else None,
            "server_restarts": max((r["servers/restarts"] for r in syncs), default=0)}


def summary(cfg: RLReasoningConfig, records: list[dict[str, Any]], before: dict[str, Any],
            after: dict[str, Any]) -> dict[str, Any]:
    def gain(b: dict[str, Any], a: dict[str, Any], **extra: Any) -> dict[str, Any]:
        se = math.sqrt(b["stderr"] ** 2 + a["stderr"] ** 2)
        return {"before": b["acc"], "after": a["acc"], "stderr_before": b["stderr"], "stderr_after": a["stderr"],
                "n": a["n"], **extra, "gain_in_stderr": (a["acc"] - b["acc"]) / se if se > 0 else None}

    failures: Counter = Counter()
    for r in records:
        failures.update(r.get("reward_failures", {}))
    domains = sorted({k.split("/", 1)[1] for r in records for k in r if k.startswith("reward/")})
    return {
        "steps": len(records),
        "reward": metrics.first_last(records, "reward"),
        "reward_per_domain": {d: metrics.first_last(records, f"reward/{d}") for d in domains},
        "heldout_accuracy": gain(before["heldout"], after["heldout"]),
        "heldout_sampled_accuracy": (gain(before["heldout_sampled"], after["heldout_sampled"],
                                          samples=after["heldout_sampled"]["samples"])
                                     if "heldout_sampled" in before and "heldout_sampled" in after else None),
        "gsm8k_test_accuracy": ({"before": before["gsm8k_test"]["acc"], "after": after["gsm8k_test"]["acc"],
                                 "n": after["gsm8k_test"]["n"]} if "gsm8k_test" in after else None),
        "icepop_masked_fraction": sum(r.get("icepop_masked_fraction", 0.0) for r in records) / len(records),
        "mismatch": mismatch_trend(records),
        "clip_fraction": sum(r.get("clip_fraction", 0.0) for r in records) / len(records),
        "zero_variance_groups": metrics.first_last(records, "zero_variance_groups"),
        "batch_shaping": dynamic_sampling.totals(records),
        "entropy": metrics.first_last(records, "entropy"),
        "response_length": metrics.first_last(records, "response_length"),
        "reward_failures": dict(failures),
        "reward_recheck": reward_audit.summary(records, cfg.recheck_alert),
        "seconds_per_step": {k: sum(r[f"time/{k}"] for r in records) / len(records)
                             for k in ("generate", "reward", "train")},
        "rollout_int4": cfg.rollout_int4 is not None,
    }


def plot_rewards(records: list[dict[str, Any]], png: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["reward"] for r in records], label="mean reward (sampled)")
    ax.plot(steps, [r["zero_variance_groups"] for r in records], label="zero-variance groups", alpha=0.6)
    h = result["heldout_accuracy"]
    ax.scatter([0, steps[-1]], [h["before"], h["after"]], color="red", zorder=3, label="held-out greedy accuracy")
    if hs := result.get("heldout_sampled_accuracy"):
        ax.scatter([0, steps[-1]], [hs["before"], hs["after"]], color="purple", marker="s", zorder=3,
                   label=f"held-out accuracy, {hs['samples']} samples per prompt")
    ax.set_xlabel("step")
    ax.set_title("rl-reasoning (GRPO + IcePop)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
