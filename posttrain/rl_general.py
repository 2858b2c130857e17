"""The `rl-general` stage: GRPO on general chat prompts with a hybrid reward (GLM-5 section 4.4).

    rl-agentic (weights), reward-model (ORM), sft (the GRM's weights), tokenize --> rl-general

Prompts: GSM8K train questions (after the lines SFT holds out), the same questions with the
calculator tool declared (`tool`: the rules then check calls against its schema and run them),
MBPP training descriptions and synthetic addition, drawn by `prompts` weights; one user turn,
thinking off. Each step:
  1. the rollout engine takes the policy's weights; `prompts_per_step` x `group_size` samples;
  2. the hybrid reward (rl.judges): rules (format via parse_assistant on the raw text with its
     special tokens, language, and on tool prompts whether the call runs), the ORM (the
     reward-model stage's scalar head over the prompt with its tools and the raw reply, sigmoid;
     its pairs include tool calls) and the GRM (the SFT checkpoint prompted with a rubric that
     names tools, through its own RolloutEngine, a 0-10 score),
     weighted by `weights` (renormalised over the components present: an unparseable GRM reply
     drops that component for the sample), plus `length_weight` x the length penalty;
  3. the ORM and GRM are JudgeServices with deadlines: a judge past its deadline (or raising)
     fails its samples (Status.REWARD_ERROR, never trained) and the step goes on;
  4. GRPO + IcePop (rl.update.update), as rl-reasoning.
Reward-hacking guards: the length penalty, and per step the disagreement rate between the rule,
ORM and GRM verdicts (rl.judges.disagreement; a policy exploiting one judge shows as that judge
drifting from the others).

Metrics: per step in metrics.jsonl / TensorBoard; for the stage: reward first/last per component,
the verified accuracy of the arithmetic and tool prompts (verified_accuracy: the sum, and whether
the first call computes a step of the reference solution; never rewarded: the witness that a
rising reward is not a gamed judge), each reward source's accuracy as a judge of that outcome on
held-out prompts before training (judge_accuracy),
disagreement first/last, judge failures, the ORM's held-out pairwise accuracy (from the
reward-model artifact), the evaluation gates (rl.gates; a broken gate fails the stage).
Checkpoints as rl-reasoning's: model, optimizer, rollout RNG, step; prompts derive from (seed, step).
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from pydantic import Field, field_validator, model_validator

from chat.template import STOP_TOKENS, parse_assistant
from data_processing.tokenizer import load_tokenizer
from domains import arithmetic
from domains.pools import gsm8k_tasks, mbpp_tasks
from domains.task import Task
from domains.tools import CALCULATOR
from runtime.stage import Workdir
from model.hf import artifact_weights, load_state, state_config
from rl import dynamic_sampling, gates, trainer
from rl.dynamic_sampling import apply_overlong, fill_batch
from rl.judges import (
    COMPONENTS,
    Judge,
    JudgeService,
    combine,
    disagreement,
    grm_judge,
    length_penalty,
    orm_judge,
    rule_reward,
)
from rl.prompts import draw_tasks
from rl.ranks import SINGLE, Ranks, check_placement
from rl.rewards import REWARDS
from rl.rollout import RolloutEngine, SamplingParams, open_engine, prompt_ids
from rl.sample import Sample, Status
from rl.served import ServedEngine, ServerPoolConfig, group_seeds, named_pool
from rl.trainer import GateCheck
from rl.update import UpdateParams, assign_advantages, mismatch_trend, update
from rl.stage_config import GroupRLConfig
from training import checkpoint, metrics

log = logging.getLogger("glmforge")
SOURCES = ("gsm8k", "mbpp", "arithmetic", "tool")


class RLGeneralConfig(GroupRLConfig):
    steps: int = Field(100, ge=1, description="rollout + update rounds")
    group_size: int = Field(8, ge=2, description="samples per prompt")
    prompts: dict[str, float] = Field({"gsm8k": 1.0, "tool": 1.0, "mbpp": 1.0, "arithmetic": 1.0},
                                      description=f"prompt weights over {SOURCES}")
    weights: dict[str, float] = Field({"rule": 1.0, "orm": 1.0, "grm": 1.0},
                                      description=f"hybrid reward weights over {COMPONENTS}")
    length_target: int = Field(256, ge=1, description="tokens a reply may use before the length penalty")
    length_weight: float = Field(0.5, ge=0, description=(
        "weight of the length penalty (past length_target) in the hybrid reward"))
    orm_timeout_s: float = Field(30.0, gt=0, description="deadline per ORM chunk")
    grm_timeout_s: float = Field(60.0, gt=0, description="deadline per GRM chunk")
    judge_chunk: int = Field(32, ge=1, description=(
        "samples per request to a judge (ORM, GRM); each chunk has its own deadline"))
    judge_eval: int = Field(32, ge=0, description="held-out verifiable prompts (half addition, half GSM8K test "
                            "questions offered the calculator) on which each reward source is scored against the "
                            "verified outcome before training (judge_accuracy); 0: not measured")
    judge_eval_samples: int = Field(4, ge=2, description="replies sampled per judge_eval prompt")
    grm_scoring: Literal["parse", "expected"] = Field(
        "parse", description="parse: the first 0-10 integer of a greedy reply of up to grm_max_new_tokens; expected: "
                             "the verdict's expectation over the first token's distribution (rl.judges.grm_judge)")
    grm_max_new_tokens: int = Field(4, ge=1, description="tokens of the GRM's verdict reply (grm_scoring parse)")
    grm_min_number_mass: float = Field(0.05, ge=0, le=1, description="expected: below this, no verdict")
    judge_servers: ServerPoolConfig = Field(ServerPoolConfig(replicas=1), description=(
        "with rollout.backend=served: the server pool each judge is served from (the GRM's weights, the "
        "ORM); the trainer's ranks then hold no judge"))
    gsm8k_path: str = Field("{samples}/gsm8k/train.jsonl", description=(
        "GSM8K train questions of the gsm8k and tool prompts ({samples} expands)"))
    gsm8k_skip: int = Field(200, ge=0, description="GSM8K train lines SFT holds out (not RL prompts)")
    mbpp_path: str = Field("{samples}/mbpp/mbpp.jsonl", description=(
        "MBPP problems of the mbpp prompts ({samples} expands)"))

    @model_validator(mode="after")
    def _placement(self) -> "RLGeneralConfig":
        check_placement("rl-general", self.parallel, self.rollout.backend)
        if self.judge_servers.engine == "vllm" and self.weights.get("orm", 0) > 0:
            raise ValueError("rl_general.judge_servers.engine=vllm: the ORM (a scalar head on the backbone) is served "
                             "by native servers only; use engine: native, or weights.orm: 0")
        return self

    @field_validator("prompts")
    @classmethod
    def _prompts(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(set(v) - set(SOURCES))
        if bad:
            raise ValueError(f"unknown prompt sources {bad}; known: {', '.join(SOURCES)}")
        if any(w < 0 for w in v.values()) or not any(w > 0 for w in v.values()):
            raise ValueError("prompt weights must be >= 0 with at least one > 0")
        return v

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(set(v) - set(COMPONENTS))
        if bad:
            raise ValueError(f"unknown reward components {bad}; known: {', '.join(COMPONENTS)}")
        if any(w < 0 for w in v.values()) or not any(w > 0 for w in v.values()):
            raise ValueError("reward weights must be >= 0 with at least one > 0")
        return v


def general_pools(cfg: RLGeneralConfig) -> dict[str, list[Task]]:
    pools: dict[str, list[Task]] = {}
    for src, w in cfg.prompts.items():
        if w <= 0:
            continue
        if src == "gsm8k":
            ts = gsm8k_tasks(cfg.gsm8k_path, cfg.gsm8k_skip)
        elif src == "mbpp":
            ts = mbpp_tasks(cfg.mbpp_path)
        elif src == "tool":
            ts = tool_tasks(cfg.gsm8k_path, cfg.gsm8k_skip)
        else:
            ts = [arithmetic.task(a, b) for a, b in arithmetic.pairs("train")]
        pools[src] = [Task("general", t.prompt, t.answer, {**t.meta, "source": src}) for t in ts]
        if not pools[src]:
            raise ValueError(f"rl-general: prompt source {src!r} has no prompts")
    return pools


# ---------------------------------------------------------------- rewards
def hybrid_rewards(samples: list[Sample], tokenizer, judges: dict[str, JudgeService], cfg: RLGeneralConfig
                   ) -> tuple[Counter, list[dict[str, Optional[float]]], dict[str, float]]:
    """Set reward / rewards / status on each sample (module doc, step 2-3). Returns judge failures
    by reason, the per-sample components of the scored samples, and extra step statistics."""
    failures: Counter = Counter()
    todo = [s for s in samples if s.status in (Status.OK, Status.TRUNCATED)]
    raw = [tokenizer.decode(s.response_ids, skip_special_tokens=False) for s in todo]
    rules = [rule_reward(r, s.task.meta.get("tools")) for r, s in zip(raw, todo)]
    items = list(zip((s.task for s in todo), raw))      # the judges read the raw reply (rl.judges)
    judged = {name: svc.score(items) for name, svc in judges.items() if cfg.weights.get(name, 0) > 0}
    comps_all: list[dict[str, Optional[float]]] = []
    unparsed = 0
    for i, s in enumerate(todo):
        failed = [n for n, res in judged.items() if res.failed[i]]
        if failed:
            s.status, s.reward = Status.REWARD_ERROR, 0.0
            s.reward_reason = "; ".join(judged[n].reason for n in failed)
            for n in failed:
                failures[f"{n}:{'timeout' if 'timed out' in judged[n].reason else 'error'}"] += 1
            continue
        comps: dict[str, Optional[float]] = {"rule": rules[i]["rule"]}
        for n, res in judged.items():
            comps[n] = res.scores[i]
        unparsed += comps.get("grm", 0.0) is None and "grm" in judged
        pen = length_penalty(len(s.response_ids), cfg.length_target)
        s.reward = combine(comps, cfg.weights, pen, cfg.length_weight)
        s.rewards = {**{k: v for k, v in comps.items() if v is not None}, "length": pen,
                     **{k: v for k, v in rules[i].items() if k != "rule"}}
        comps_all.append(comps)
    extra = {"grm_unparsed_fraction": unparsed / max(len(comps_all), 1)}
    return failures, comps_all, extra


# prompt source -> the rl.rewards domain that checks it in this process: only checkers that run no
# model text (GSM8K's goes through sympy and MBPP's runs code: those belong in the reward worker)
VERIFIED = {"arithmetic": "arithmetic"}


def verified(s: Sample, tokenizer) -> tuple[str, float] | None:
    """(what was verified, 1.0 or 0.0) for a sample whose prompt source has a safe checker
    (verified_accuracy's), None otherwise. A tool prompt's outcome is `tool_step`: the reply's
    first tool call parses against the declared tools and the calculator computes one of the
    reference solution's calculator steps with it (calls_step). The rules pay a call the tool
    runs; whether it computes a step of the solution needs the reference, which no judge sees."""
    src = s.task.meta.get("source")
    if src in VERIFIED:
        t = Task(VERIFIED[src], s.task.prompt, s.task.answer, s.task.meta)
        return src, REWARDS[t.domain](s.text, t).score
    if src == "tool":
        raw = tokenizer.decode(s.response_ids, skip_special_tokens=False)
        return "tool_step", float(calls_step(raw, s.task.meta["tools"], s.task.meta["steps"]))
    return None


def calls_step(raw: str, tools: list[dict], steps: list[str]) -> bool:
    """The reply's first tool call is well formed against `tools`, is the calculator, and its
    expression evaluates to one of `steps` (the reference solution's calculator results)."""
    from domains.tools import calculator, same_number

    parsed = parse_assistant(raw, tools=tools)
    if not parsed.ok or not parsed.message.tool_calls:
        return False
    call = parsed.message.tool_calls[0]
    try:
        value = calculator(str(call.arguments.get("expression", "")))
    except ValueError:
        return False
    return call.name == "calculator" and any(same_number(value, x) for x in steps)


def tool_tasks(path: str, skip: int) -> list[Task]:
    """GSM8K questions after `skip` lines with the calculator declared, each with the results of
    its reference solution's calculator steps (meta `steps`; questions whose annotations the
    calculator cannot reproduce have none and are left out)."""
    from domains.gsm8k import calculator_results, read_gsm8k

    out = []
    for i, p in enumerate(read_gsm8k(path)[skip:]):
        steps = [r for r in calculator_results(p) if r is not None]
        if steps:
            out.append(Task("general", p.question, p.answer,
                            {"line": skip + i + 1, "tools": [CALCULATOR], "source": "tool", "steps": steps}))
    return out


def judge_tasks(cfg: RLGeneralConfig, seed: int) -> list[Task]:
    """judge_eval held-out prompts: addition sums of the held-out split and GSM8K test questions
    offered the calculator (neither is an RL prompt)."""
    half = cfg.judge_eval // 2
    arith = [Task("general", t.prompt, t.answer, {**t.meta, "source": "arithmetic"})
             for t in arithmetic.tasks(cfg.judge_eval - half, "heldout", seed)]
    tool = tool_tasks(cfg.gates.evals.gsm8k_path, 0)[:half]
    return arith + tool


def pairwise_agreement(samples: list[Sample], scores: list[Optional[float]], outcome: list[float]) -> tuple[float, int]:
    """Over the pairs of replies to one prompt where one is verified right and the other wrong, the
    share the scores order the right one first (a tie counts one half), and the number of pairs."""
    hits, pairs = 0.0, 0
    by_prompt: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        by_prompt.setdefault(s.group, []).append(i)
    for idx in by_prompt.values():
        for a in idx:
            for b in idx:
                if outcome[a] > outcome[b] and scores[a] is not None and scores[b] is not None:
                    pairs += 1
                    hits += 1.0 if scores[a] > scores[b] else 0.5 if scores[a] == scores[b] else 0.0
    return (hits / pairs if pairs else float("nan")), pairs


def judge_accuracy(engine, tokenizer, services: dict[str, JudgeService], cfg: RLGeneralConfig, seed: int
                   ) -> dict[str, Any]:
    """Each reward source (the rules, the ORM, the GRM, and the combined reward) as a judge of
    the policy's own replies on held-out verifiable prompts: how often it ranks a verified-right
    reply above a verified-wrong one to the same prompt (module doc: what the stage can and cannot
    see). Sampled from its own generator: the training rollouts do not change."""
    tasks = judge_tasks(cfg, seed)
    samples = [Sample(t, i, prompt_ids(tokenizer, t, t.meta.get("tools")))
               for i, t in enumerate(tasks) for _ in range(cfg.judge_eval_samples)]
    engine.generate(samples, SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens),
                    torch.Generator().manual_seed(seed * 1_000_003 + 17))
    _, comps, _ = hybrid_rewards(samples, tokenizer, services, cfg)
    judged = [s for s in samples if s.status in (Status.OK, Status.TRUNCATED)]
    outcome = [(verified(s, tokenizer) or ("", 0.0))[1] for s in judged]
    out: dict[str, Any] = {"prompts": len(tasks), "samples": cfg.judge_eval_samples,
                           "verified_share": sum(outcome) / max(len(outcome), 1), "judges": {}}
    for name in [*sorted({k for c in comps for k in c}), "reward"]:
        scores = [s.reward for s in judged] if name == "reward" else [c.get(name) for c in comps]
        acc, pairs = pairwise_agreement(judged, scores, outcome)
        out["judges"][name] = {"pairwise": None if pairs == 0 else acc, "pairs": pairs}
    return out


def verified_accuracy(samples: list[Sample], tokenizer) -> dict[str, float]:
    """Per prompt source with a checker, the share of samples that get it right: the arithmetic
    answer, and for the tool prompts a first call that computes a step of the reference solution
    (verified). Never part of the reward: it tells a policy that got better from one that learned
    to please its judges."""
    hits: dict[str, list[float]] = {}
    for s in samples:
        v = verified(s, tokenizer)
        if v is not None:
            hits.setdefault(v[0], []).append(v[1])
    return {src: sum(v) / len(v) for src, v in hits.items()}


def step_record(step: int, samples: list[Sample], tokenizer, comps: list[dict[str, Optional[float]]],
                stats: dict[str, float], flat: float, failures: Counter, extra: dict[str, float],
                seconds: dict[str, float]) -> dict[str, Any]:
    scored = [s for s in samples if s.status in (Status.OK, Status.TRUNCATED)]
    rec: dict[str, Any] = {"step": step, "reward": sum(s.reward for s in scored) / max(len(scored), 1)}
    for key in (*COMPONENTS, "length", "format", "language", "tool"):
        vals = [s.rewards[key] for s in scored if key in s.rewards]
        if vals:
            rec[f"reward/{key}"] = sum(vals) / len(vals)
    rec.update({f"disagreement/{k}": v for k, v in disagreement(comps).items()})
    rec.update({f"verified/{k}": v for k, v in verified_accuracy(samples, tokenizer).items()})
    lengths = [len(s.response_ids) for s in samples]
    rec.update({"zero_variance_groups": flat, "response_length": sum(lengths) / len(lengths),
                "reward_error_fraction": sum(s.status == Status.REWARD_ERROR for s in samples) / len(samples),
                "judge_failures": dict(failures), **extra, **stats,
                **{f"time/{k}": v for k, v in seconds.items()}})
    return rec


# ---------------------------------------------------------------- the stage
def make_judges(cfg: RLGeneralConfig, inputs: dict[str, Path], tokenizer, stop_ids: list[int], pad_id: int
                ) -> dict[str, Judge]:
    from rl.orm import load_reward_model

    out: dict[str, Judge] = {}
    if cfg.weights.get("orm", 0) > 0:
        orm, info = load_reward_model(inputs["reward-model"], pad_id)
        out["orm"] = orm_judge(orm, tokenizer, int(info["max_len"]), info["score_mean"], info["score_std"],
                               info.get("score_scales"))
    if cfg.weights.get("grm", 0) > 0:
        sft = load_state(artifact_weights(inputs["sft"], "sft"))
        out["grm"] = grm_judge(RolloutEngine(sft, tokenizer, stop_ids, pad_id, batch_size=cfg.rollout_batch),
                               tokenizer, cfg.grm_scoring, cfg.grm_max_new_tokens, cfg.grm_min_number_mass)
    return out


def serve_judges(cfg: RLGeneralConfig, inputs: dict[str, Path], tokenizer, stop_ids: list[int], pad_id: int,
                 root: Path, ranks: Ranks, stack: contextlib.ExitStack) -> dict[str, Judge]:
    """make_judges' judges on server pools of their own (rl.served), opened on every rank (rank 0
    starts the servers) and closed by `stack`: the GRM generates from the SFT weights served, the
    ORM scores on a served reward model."""
    from rl.orm import load_info

    def pool(name: str, model=None) -> ServedEngine:
        return stack.enter_context(ServedEngine(None, tokenizer, stop_ids, pad_id, named_pool(cfg.judge_servers, name),
                                                root / name, ranks=ranks, model=model))

    out: dict[str, Judge] = {}
    if cfg.weights.get("orm", 0) > 0:
        info = load_info(inputs["reward-model"])
        orm = pool("orm")
        orm.serve_orm(inputs["reward-model"])
        out["orm"] = orm_judge(orm, tokenizer, int(info["max_len"]), info["score_mean"], info["score_std"],
                               info.get("score_scales"))
    if cfg.weights.get("grm", 0) > 0:
        weights = artifact_weights(inputs["sft"], "sft")
        grm = pool("grm", state_config(weights))
        grm.serve_file(weights)
        out["grm"] = grm_judge(grm, tokenizer, cfg.grm_scoring, cfg.grm_max_new_tokens, cfg.grm_min_number_mass)
    return out


def orm_accuracy(inputs: dict[str, Path]) -> Optional[float]:
    p = inputs.get("reward-model")
    if p is None or not (Path(p) / "orm.json").exists():
        return None
    return json.loads((Path(p) / "orm.json").read_text())["heldout_pairwise_accuracy"]


def run_rl_general(cfg: RLGeneralConfig, inputs: dict[str, Path], workdir: Workdir,
                   judges: Optional[dict[str, Judge]] = None) -> dict[str, Any]:
    """`judges` replaces the ORM / GRM built from the inputs (tests: deterministic fakes; in this
    process only: ranks build their own)."""
    if cfg.parallel.launch.world_size > 1:
        from rl.launch import run_on_ranks

        if judges is not None:
            raise ValueError("rl-general on ranks builds its judges from its inputs on every rank; "
                             "judges given in process cannot reach them")
        return run_on_ranks("rl-general", cfg, inputs, workdir, cfg.parallel.launch)
    return train(cfg, inputs, workdir, judges=judges)


def train(cfg: RLGeneralConfig, inputs: dict[str, Path], workdir: Workdir, ranks: Ranks = SINGLE,
          judges: Optional[dict[str, Judge]] = None) -> dict[str, Any] | None:
    """The stage in this process, or as one of `ranks` (rl.launch; rl_reasoning.train's split:
    each rank generates and judges its share of the groups, rank 0 measures, gates and exports).
    With rollout servers (rollout.backend=served) the policy samples from them and the
    judges are served too: the ranks hold only the policy (expert-sharded with
    parallel.expert_parallel)."""
    seed = workdir.seed
    lead = ranks.rank == 0
    served = cfg.rollout.backend == "served"
    tokenizer = load_tokenizer(inputs["tokenize"])
    model = trainer.load_policy(inputs["rl-agentic"], "rl-agentic", tokenizer, seed, cfg.threads)
    stop_ids = [tokenizer.token_to_id(t) for t in STOP_TOKENS]
    pad_id = tokenizer.token_to_id("<|pad|>")
    pools = general_pools(cfg)
    if judges is None and not served:
        judges = make_judges(cfg, inputs, tokenizer, stop_ids, pad_id)
    timeouts = {"orm": cfg.orm_timeout_s, "grm": cfg.grm_timeout_s}
    services: dict[str, JudgeService] = {}
    resumed_meta = checkpoint.select_resume(workdir.checkpoint / trainer.CHECKPOINTS)
    before = {}
    if resumed_meta is None and lead:     # before the experts are sharded: the whole model's gates
        before = trainer.measure_gates(model, tokenizer, cfg.gates, seed, (inputs["rl-agentic"], "rl-agentic"))
    ranks = ranks.with_experts_sharded(model, cfg.parallel.expert_parallel)
    gen = torch.Generator().manual_seed(seed)
    sample_gen = trainer.sampling_rng(gen, seed, ranks)
    policy = trainer.policy_for(model, cfg.optim, gen, ranks, cfg.parallel.zero_stage, sample_gen)
    opt = policy.optimizer
    sampling = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens)
    params = UpdateParams(cfg.eps_low, cfg.eps_high, cfg.icepop_beta, cfg.minibatches, cfg.epochs,
                          cfg.temperature, cfg.std_normalize, cfg.optim.grad_clip, cfg.policy_loss)
    root, log_path = workdir.checkpoint / trainer.CHECKPOINTS, workdir.checkpoint / "metrics.jsonl"
    last: list[Sample] = []
    counts: Counter = Counter()         # a step's overlong counts and reward seconds, over its rounds

    def rollout(step: int, rnd: int, first: int, n: int) -> tuple[list[Sample], tuple]:
        """Round `rnd` of the step: n prompts (group ids first ..) generated and scored by each rank
        for its share, gathered; with the scored samples' components, judge failures and extras."""
        t0 = time.perf_counter()
        tasks = draw_tasks(pools, cfg.prompts, n, seed, step, rnd)
        lo, hi = ranks.bounds(len(tasks))               # this rank's groups (all of them on one)
        mine = [Sample(t, first + g, prompt_ids(tokenizer, t, t.meta.get("tools")))
                for g, t in enumerate(tasks) if lo <= g < hi for _ in range(cfg.group_size)]
        if served:           # one seed per group, drawn alike on any placement
            seeds = group_seeds(seed * 1_000_003 + step + rnd * 7_919_000_001, len(tasks))
            engine.generate(mine, sampling, sample_gen, seeds={first + g: seeds[g] for g in range(lo, hi)})
        else:
            engine.generate(mine, sampling, sample_gen)
        t1 = time.perf_counter()
        failures, comps, extra = hybrid_rewards(mine, tokenizer, services, cfg)
        counts.update(apply_overlong(mine, cfg.overlong, cfg.max_new_tokens))
        counts.update({"time/generate": t1 - t0, "time/reward": time.perf_counter() - t1})
        shares = ranks.gather((mine, comps, dict(failures), extra["grm_unparsed_fraction"] * len(comps)))
        samples = [s for share in shares for s in share[0]]
        comps = [c for share in shares for c in share[1]]
        failures = sum((Counter(share[2]) for share in shares), Counter())
        extra = {"grm_unparsed_fraction": sum(share[3] for share in shares) / max(len(comps), 1)}
        return samples, (comps, failures, extra)

    def one_step(step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        engine.sync(model, step)
        counts.clear()
        samples, drawn, (comps, failures, extra), dynamic = fill_batch(
            lambda rnd, first, n: rollout(step, rnd, first, n), cfg.prompts_per_step, cfg.dynamic_sampling)
        t2 = time.perf_counter()
        flat = assign_advantages(samples, cfg.std_normalize, cfg.advantage)
        stats = update(model, opt, samples, pad_id, params, gen, ranks)
        t3 = time.perf_counter()
        last[:] = samples
        # the reward, its components and the verified shares from the step's own draw: the trained
        # batch is selected for signal
        rec = step_record(step, drawn, tokenizer, comps, stats, flat, failures, extra,
                          {"generate": t2 - t0 - counts["time/reward"], "reward": counts["time/reward"],
                           "train": t3 - t2})
        rec.update(engine.metrics())
        rec.update(dynamic)
        keys = ("overlong/truncated", "overlong/filtered", "overlong/penalised")
        rec.update(zip(keys, (int(v) for v in ranks.sum([float(counts[k]) for k in keys]))))
        if ranks.world > 1:
            rec["trainer_ranks"] = ranks.world
        return rec

    resumed = trainer.load_latest(root, policy, log_path, "rl-general")
    start, judged = 0, None
    if resumed is not None:
        start, before, judged = resumed[0], resumed[1]["before"], resumed[1].get("judges")
    engine_root = workdir.checkpoint / ("engine" if served else f"engine-rank{ranks.rank}")
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(open_engine(cfg.rollout, model, tokenizer, stop_ids, pad_id, engine_root,
                                                 int4=cfg.rollout_int4, batch_size=cfg.rollout_batch, ranks=ranks))
        if judges is None:
            judges = serve_judges(cfg, inputs, tokenizer, stop_ids, pad_id, workdir.checkpoint / "judges", ranks,
                                  stack)
        services.update({n: JudgeService(n, j, timeouts[n], cfg.judge_chunk) for n, j in judges.items()})
        if resumed is None and cfg.judge_eval and ranks.world == 1:   # before any step: the stage's own judges
            engine.sync(model, 0)
            judged = judge_accuracy(engine, tokenizer, services, cfg, seed)
        trainer.run_steps("rl-general", policy, one_step, start=start, steps=cfg.steps, root=root, log_path=log_path,
                          workdir=workdir, checkpoint_every=cfg.checkpoint_every, keep_last=cfg.keep_last,
                          meta=lambda: {"before": before, "judges": judged},
                          describe=lambda r: f"reward {r['reward']:.3f}")
    model = trainer.whole_model(model, ranks)       # a collective with expert parallelism
    if not lead:
        return None
    after = trainer.measure_gates(model, tokenizer, cfg.gates, seed)
    records = metrics.read(log_path)
    result = summary(records, inputs)
    result["judge_accuracy"] = judged
    result["trainer_ranks"] = ranks.world
    result["placement"] = {"trainer_ranks": ranks.world, "expert_parallel": cfg.parallel.expert_parallel,
                           "rollout": cfg.rollout.backend, "judges_served": served}
    with open(workdir.out / "samples.jsonl", "w") as f:
        for s in last[: cfg.examples]:
            f.write(json.dumps({"prompt": s.task.prompt, "response": s.text, "rewards": s.rewards,
                                "reward": s.reward, "status": s.status.value}) + "\n")
    gate = GateCheck(cfg.gates, before, after, "rl-agentic", gates.read_chain(inputs.get("rl-agentic")), seed)
    result["gates"] = trainer.publish("rl-general", workdir.out, records, model=model, tokenizer_dir=inputs["tokenize"],
                                      gate=gate, export_info={"reward_last": (result["reward"] or {}).get("last")},
                                      plot=lambda rs, out: plot(rs, out / "reward.png"))
    return result


def summary(records: list[dict[str, Any]], inputs: dict[str, Path]) -> dict[str, Any]:
    failures: Counter = Counter()
    for r in records:
        failures.update(r.get("judge_failures", {}))
    keys = sorted({k for r in records for k in r if k.startswith("reward/")})
    dkeys = sorted({k for r in records for k in r if k.startswith("disagreement/")})
    vkeys = sorted({k for r in records for k in r if k.startswith("verified/")})
    return {
        "steps": len(records),
        "reward": metrics.first_last(records, "reward"),
        "reward_per_component": {k.split("/", 1)[1]: metrics.first_last(records, k) for k in keys},
        "disagreement": {k.split("/", 1)[1]: metrics.first_last(records, k) for k in dkeys},
        "verified_accuracy": {k.split("/", 1)[1]: metrics.first_last(records, k) for k in vkeys},
        "judge_failures": dict(failures),
        "reward_error_fraction": sum(r["reward_error_fraction"] for r in records) / len(records),
        "grm_unparsed_fraction": sum(r["grm_unparsed_fraction"] for r in records) / len(records),
        "response_length": metrics.first_last(records, "response_length"),
        "icepop_masked_fraction": sum(r.get("icepop_masked_fraction", 0.0) for r in records) / len(records),
        "mismatch": mismatch_trend(records),
        "batch_shaping": dynamic_sampling.totals(records),
        "orm_heldout_pairwise_accuracy": orm_accuracy(inputs),
    }


def plot(records: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in records]
    for key in ("reward", *(f"reward/{c}" for c in (*COMPONENTS, "length"))):
        ys = [r.get(key) for r in records]
        if any(y is not None for y in ys):
            a1.plot(steps, [float("nan") if y is None else y for y in ys], label=key)
    a1.set_title("rl-general: hybrid reward")
    a1.legend(fontsize=7)
    for key in sorted({k for r in records for k in r if k.startswith("disagreement/")}):
        a2.plot(steps, [r.get(key, float("nan")) for r in records], label=key)
    a2.set_title("judge disagreement rate")
    a2.legend(fontsize=7)
    for a in (a1, a2):
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
