"""The `rl-agentic` stage: asynchronous agentic RL (GLM-5 section 4.3), after rl-reasoning.

    rl-reasoning (weights), tokenize (tokenizer) --> rl-agentic

Inference is decoupled from training. Rollout workers (rl.rollout_worker, separate processes
reached over TCP by rl.orchestrator.WorkerPool) run multi-turn tool episodes (rl.agent, token-in-
token-out) in registered environments (rl.envs) and return trajectories whose every token carries
the policy version that sampled it. The trainer:
  - submits prompt groups while admission allows (rl.staleness.admit: at most (eta + v + 1) * B
    samples submitted by policy version v), each group routed by a consistent hash of its id;
  - trains as soon as B samples are in, oldest groups first: drops samples more than tau versions
    stale and groups with a valid minority (rl.staleness.filter_groups), group-normalised
    advantages over the valid members, then one optimizer step (rl.update) of the policy loss
    named by `policy_loss`: GLM-5's double-sided IS (rl.loss.double_sided_is_loss, the rollout
    log-probs as pi_old: no pi_old forward pass);
  - every K optimizer steps publishes the weights as a new version (in verified buckets,
    rl.weight_sync; workers load it whole between requests or turns; its bytes, buckets and
    seconds in the step's metrics) and resets the optimizer state, as GLM-5 does after each sync.
With tau = 0, K = 1, eta = 0 and one worker this is synchronous on-policy training, step for step
(`synchronous: true` runs that reference in-process; a test checks they match).

Defaults the paper does not give (chosen here): eps_low 0.2 / eps_high 0.28, the same band as
the reasoning stage's clip-higher; tau 2 and eta 1 (a sample may start one version behind and is
dropped beyond two: the admission limit makes drops rare, dropping is the backstop); K 1 (weights
every step: cheap at this size; raise it when a weight sync costs more than a step).

Resume: a checkpoint holds the model, optimizer, step, version, the next group id, the groups
finished but not yet trained (their samples), and the ids of in-flight groups, which a resumed
stage submits again (their rollouts are seeded by group id, rl.agent.seed_for). No trajectory is
lost or trained twice: each step records the group ids it trained on.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import statistics
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from chat.template import STOP_TOKENS
from data_processing.tokenizer import load_tokenizer
from domains.task import Task
from runtime.stage import OPERATIONAL, Workdir
from model.model import GLMModel
from rl import gates, reward_audit, trainer, weight_sync
from rl.agent import context_for, prompt_tools, run_group
from rl.algorithms import AdvantageName, PolicyLossName
from rl.envs import ENVIRONMENTS, make_env, tasks_for
from rl.orchestrator import WorkerPool
from rl.ranks import SINGLE, ParallelConfig, Ranks, check_placement, is_engine
from rl.rollout import RolloutConfig, RolloutEngine, SamplingParams, open_engine
from rl.sample import Sample
from rl.sandbox import require_isolation
from rl.staleness import admit, filter_groups
from rl.trainer import GateCheck
from rl.update import UpdateParams, assign_advantages, mismatch_trend, update
from rl.wire import sample_from_dict, sample_to_dict
from rl.stage_config import RLStageConfig
from training import checkpoint, metrics

log = logging.getLogger("glmforge")
BUFFER = "buffer.json"
# environments whose tools or verifier run model-written code in rl.sandbox (a test checks the list)
SANDBOXED_ENVIRONMENTS = frozenset({"swe", "swe_repair", "terminal"})


class AgentContextConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    keep_recent: int = Field(3, ge=1, description="tool results kept visible; older ones are elided")
    max_tokens: Optional[int] = Field(None, ge=64, description="history reset above this many tokens")


class RLAgenticConfig(RLStageConfig):
    steps: int = Field(100, ge=1, description="optimizer steps")
    prompts_per_step: int = Field(16, ge=1, description="groups per optimizer step (B = this x group_size)")
    group_size: int = Field(8, ge=2, description="episodes per task (a GRPO group)")
    environments: dict[str, float] = Field({"calc_arith": 1.0}, description="episode weights over rl.envs")
    env_args: dict[str, dict[str, Any]] = Field({}, description="constructor arguments per environment")
    max_turns: int = Field(4, ge=1, description="assistant turns per episode at most")
    context: Optional[AgentContextConfig] = Field(None, description="keep-recent-k context management (forks trajectories)")
    workers: int = Field(2, ge=1, description="rollout worker processes")
    synchronous: bool = Field(False, description="the on-policy reference: generate in the trainer, no workers")
    eta: int = Field(1, ge=0, description="admission: samples start at most eta versions behind")
    tau: int = Field(2, ge=0, description="drop samples whose oldest token is more than tau versions stale")
    sync_every: int = Field(1, ge=1, description="K: optimizer steps between weight syncs (optimizer reset)")
    advantage: AdvantageName = Field("grpo", description="advantage estimator by name (rl.algorithms.ADVANTAGES)")
    policy_loss: PolicyLossName = Field("double_sided_is", description="policy loss by name (rl.algorithms."
                                        "POLICY_LOSSES); GLM-5's agentic RL: double_sided_is")
    max_new_tokens: int = Field(256, ge=1, description="per assistant turn")
    rollout_batch: int = Field(64, ge=1, description="sequences per generate() call")
    rollout: RolloutConfig = Field(RolloutConfig(), description="the engine rollouts come from: native (each worker "
                                   "holds a copy) or vLLM (the stage's servers; workers send it their turns)")
    heartbeat_s: float = Field(1.0, gt=0, description="seconds between a rollout worker's heartbeats")
    dead_after_s: float = Field(60.0, gt=0, description=(
        "a worker silent this long is deregistered, killed and replaced"))
    heldout: int = Field(100, ge=0, description="held-out episodes per environment, greedy, before and after")
    heldout_samples: int = Field(8, ge=0, description="episodes per held-out task at the rollout temperature, before "
                                 "and after: the held-out expected reward, which moves where greedy accuracy sits at "
                                 "its ceiling (0: greedy only)")
    recheck_alert: float = Field(0.25, gt=0, le=1, description="share of rewarded episodes whose environment "
                                 "re-check disagrees that raises an alert (rl.reward_audit)")
    canary_alert: float = Field(0.0, ge=0, lt=1, description="share of canary episodes (swe's canary instances) "
                                "passing their contradicting tests above which a step alerts (rl.reward_audit)")
    checkpoint_every: int = Field(10, ge=1, description="steps between checkpoints (and one at the end)")
    threads: Optional[int] = Field(None, ge=1, description="torch threads of the trainer process (None: torch's "
                                   "default; tiny matrices on a shared CPU run fastest on 1)")
    parallel: ParallelConfig = Field(ParallelConfig(), description="the trainer's ranks (rl.ranks); one: in the "
                                     "stage's process; the rollout side stays with rank 0")
    sandbox_allow_weak_isolation: StrictBool = Field(False, json_schema_extra=OPERATIONAL, description=(
        "where bwrap is missing, run the sandboxed environments' model-written code anyway, with only limits, a "
        "private uid and an empty environment (rl.sandbox); false: the stage refuses to start"))

    @field_validator("environments")
    @classmethod
    def _envs(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(set(v) - set(ENVIRONMENTS))
        if bad:
            raise ValueError(f"unknown environments {bad}; known: {', '.join(sorted(ENVIRONMENTS))}")
        if any(w < 0 for w in v.values()) or not any(w > 0 for w in v.values()):
            raise ValueError("environment weights must be >= 0 with at least one > 0")
        return v

    @field_validator("env_args")
    @classmethod
    def _env_args(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        # refused here, before any work, not in a rollout worker's constructor call
        for name, args in v.items():
            if name not in ENVIRONMENTS:
                raise ValueError(f"env_args: unknown environment {name!r}; known: {', '.join(sorted(ENVIRONMENTS))}")
            params = inspect.signature(ENVIRONMENTS[name].__init__).parameters
            bad = sorted(set(args) - set(params) - {"self"})
            if bad and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                raise ValueError(f"env_args.{name}: unknown arguments {bad}; "
                                 f"{name} takes {', '.join(p for p in params if p != 'self') or 'none'}")
        return v

    @model_validator(mode="after")
    def _vllm_on_one_rank(self) -> "RLAgenticConfig":
        if self.rollout.backend == "vllm" and self.parallel.launch.world_size > 1:
            raise ValueError("rl-agentic on vLLM trains on one rank (its trainer ranks would each need the servers' "
                             "weight updates coordinated: not built)")
        if self.rollout.backend == "served" and self.synchronous and self.parallel.launch.world_size > 1:
            raise ValueError("rl-agentic: synchronous=true generates in rank 0's process; on rollout servers with "
                             "several trainer ranks use the asynchronous workers (synchronous=false)")
        return self

    @model_validator(mode="after")
    def _placement(self) -> "RLAgenticConfig":
        check_placement("rl-agentic", self.parallel, self.rollout.backend)
        return self


def require_sandbox(cfg: RLAgenticConfig) -> None:
    """Refuse to start (rl.sandbox.SandboxError) when a sandboxed environment would run
    model-written code without isolation, unless the config opts out by name."""
    used = {e for e, w in cfg.environments.items() if w > 0}
    if "delayed" in used:                  # a wrapper: its inner environment runs the tools
        default = inspect.signature(ENVIRONMENTS["delayed"].__init__).parameters["inner"].default
        used.add(cfg.env_args.get("delayed", {}).get("inner", default))
    if used & SANDBOXED_ENVIRONMENTS:
        require_isolation(cfg.sandbox_allow_weak_isolation, "rl_agentic.sandbox_allow_weak_isolation")


# ---------------------------------------------------------------- prompts
class Prompts:
    """Group id -> task, a pure function of (seed, group): resume and re-routing see the same."""

    def __init__(self, cfg: RLAgenticConfig, seed: int):
        self.seed, self.weights = seed, {k: w for k, w in cfg.environments.items() if w > 0}
        self.pools = {e: tasks_for(e, "train", 2000, seed, cfg.env_args.get(e)) for e in self.weights}

    def task(self, group: int) -> Task:
        rng = random.Random(self.seed * 1_000_003 + group)
        env = rng.choices(list(self.weights), weights=list(self.weights.values()))[0]
        return rng.choice(self.pools[env])


def env_factory(cfg: RLAgenticConfig, task: Task):
    return lambda: make_env(task.domain, **cfg.env_args.get(task.domain, {}))


def episodes(engine, tokenizer, cfg: RLAgenticConfig, task: Task, group: int, n: int, params: SamplingParams,
             seed: int) -> list[Sample]:
    """In-process episodes (the synchronous path and evaluation): what a rollout worker runs."""
    make = env_factory(cfg, task)
    ctx = context_for(cfg.context.model_dump() if cfg.context else None, tokenizer, prompt_tools(make()))
    return run_group(engine, tokenizer, make, task, group, n, params, cfg.max_turns, seed, context=ctx)


# ---------------------------------------------------------------- the trainer step
def train_step(model: GLMModel, opt: torch.optim.Optimizer, groups: dict[int, list[Sample]], version: int,
               cfg: RLAgenticConfig, pad_id: int, generator: torch.Generator, ranks: Ranks = SINGLE) -> dict[str, Any]:
    """Staleness filter, then one rl.update step of the configured algorithm on what is kept."""
    f = filter_groups(groups, version, cfg.tau)
    stats: dict[str, Any] = {"kept": len(f.kept), "dropped": dict(f.dropped), "lag": dict(f.lags),
                             "kept_length_mean": _mean(f.kept_lengths), "dropped_length_mean": _mean(f.dropped_lengths)}
    if not f.kept:
        return {**stats, "loss": 0.0, "grad_norm": 0.0}
    stats["zero_variance_groups"] = assign_advantages(f.kept, False, cfg.advantage)
    params = UpdateParams(cfg.eps_low, cfg.eps_high, cfg.icepop_beta, 1, 1, cfg.temperature, False,
                          cfg.optim.grad_clip, cfg.policy_loss)
    return {**stats, **update(model, opt, f.kept, pad_id, params, generator, ranks)}


def _mean(xs: list[int]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def reset_optimizer(opt) -> None:
    """GLM-5 resets the optimizer state after each weight sync. `opt`: a torch optimizer or a
    DeepSpeed engine (whose torch optimizer is inside its ZeRO wrapper at ZeRO 1/2)."""
    if is_engine(opt):
        opt = getattr(opt.optimizer, "optimizer", opt.optimizer)
    opt.state.clear()


# ---------------------------------------------------------------- checkpoints
def buffer_text(buffer: dict[int, list[Sample]]) -> dict[str, str]:
    """The sample buffer as a checkpoint's text file (samples are plain data: rl.wire)."""
    return {BUFFER: json.dumps({str(g): [sample_to_dict(s) for s in ss] for g, ss in buffer.items()})}


def read_buffer(folder: Path) -> dict[int, list[Sample]]:
    raw = json.loads((folder / BUFFER).read_text())
    return {int(g): [sample_from_dict(s) for s in ss] for g, ss in raw.items()}


# ---------------------------------------------------------------- evaluation
def evaluate(engine: RolloutEngine, tokenizer, cfg: RLAgenticConfig, tasks: list[Task], seed: int) -> dict[str, Any]:
    """Per environment: greedy accuracy (reward 1) of one episode per held-out task, with its
    binomial standard error; and with heldout_samples k, "sampled": the mean accuracy of k
    episodes per task at the rollout temperature, its standard error over the tasks (the
    per-task means are the independent draws). Episodes are seeded by (seed, task): the same
    weights play the same episodes, and a resumed stage measures the same."""
    greedy = SamplingParams(0.0, 1.0, cfg.max_new_tokens)
    sampling = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens)
    by_env: dict[str, list[float]] = {}
    sampled: dict[str, list[float]] = {}
    for i, t in enumerate(tasks):
        (s, *_) = episodes(engine, tokenizer, cfg, t, -1 - i, 1, greedy, seed)
        by_env.setdefault(t.domain, []).append(float(s.reward >= 1.0))
        if cfg.heldout_samples:
            eps = episodes(engine, tokenizer, cfg, t, -1 - i, cfg.heldout_samples, sampling, seed + 1)
            sampled.setdefault(t.domain, []).append(sum(e.reward >= 1.0 for e in eps) / len(eps))
    out = {}
    for e, xs in by_env.items():
        p = sum(xs) / len(xs)
        out[e] = {"acc": p, "stderr": math.sqrt(p * (1 - p) / len(xs)), "n": len(xs)}
        if e in sampled:
            per = sampled[e]
            out[e]["sampled"] = {"acc": statistics.fmean(per), "n": len(per), "samples": cfg.heldout_samples,
                                 "stderr": statistics.stdev(per) / math.sqrt(len(per)) if len(per) > 1 else 0.0}
    return out


def heldout_gain(before: dict[str, Any], after: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """Before and after with their standard errors, and the gain in standard errors of the difference."""
    se = math.sqrt(before["stderr"] ** 2 + after["stderr"] ** 2)
    return {"before": before["acc"], "after": after["acc"], "stderr_before": before["stderr"],
            "stderr_after": after["stderr"], "n": after["n"], **extra,
            "gain_in_stderr": (after["acc"] - before["acc"]) / se if se > 0 else None}


# ---------------------------------------------------------------- the stage
def run_rl_agentic(cfg: RLAgenticConfig, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]:
    require_sandbox(cfg)
    if cfg.parallel.launch.world_size > 1:
        from rl.launch import run_on_ranks

        return run_on_ranks("rl-agentic", cfg, inputs, workdir, cfg.parallel.launch)
    return train(cfg, inputs, workdir)


def with_instances(cfg: RLAgenticConfig, inputs: dict[str, Path]) -> RLAgenticConfig:
    """The swe environment's instances are the swe-envs artifact: its folder joins env_args.swe
    (unless the config names another)."""
    if cfg.environments.get("swe", 0) <= 0 or cfg.env_args.get("swe", {}).get("root"):
        return cfg
    if "swe-envs" not in inputs:
        raise ValueError("rl_agentic.environments.swe needs the swe-envs artifact (or env_args.swe.root)")
    args = {**cfg.env_args, "swe": {**cfg.env_args.get("swe", {}), "root": str(inputs["swe-envs"])}}
    return cfg.model_copy(update={"env_args": args})


def train(cfg: RLAgenticConfig, inputs: dict[str, Path], workdir: Workdir, ranks: Ranks = SINGLE) -> dict[str, Any] | None:
    """The stage in this process, or as one of `ranks` (rl.launch): rank 0 owns the rollout side
    (the worker pool, the sample buffer, admission, the evaluations) and hands each step's groups to
    every rank; all train on them (rl.ranks), and at a sync every rank publishes its share of the
    new version (rl.weight_sync) before rank 0 announces it to the workers. On vLLM the stage's
    servers take each version (pause, reload, resume) and the workers send them their turns."""
    cfg = with_instances(cfg, inputs)
    with contextlib.ExitStack() as engines:
        return _train(cfg, inputs, workdir, ranks, engines)


def _train(cfg: RLAgenticConfig, inputs: dict[str, Path], workdir: Workdir, ranks: Ranks,
           engines: contextlib.ExitStack) -> dict[str, Any] | None:
    seed = workdir.seed
    lead = ranks.rank == 0
    served = cfg.rollout.backend == "served"
    tokenizer = load_tokenizer(inputs["tokenize"])
    model = trainer.load_policy(inputs["rl-reasoning"], "rl-reasoning", tokenizer, seed, cfg.threads)
    ckpt_root = workdir.checkpoint / trainer.CHECKPOINTS
    gates_before = None
    if checkpoint.select_resume(ckpt_root) is None and lead:     # the whole model, before any sharding
        gates_before = trainer.measure_gates(model, tokenizer, cfg.gates, seed, (inputs["rl-reasoning"], "rl-reasoning"))
    ranks = ranks.with_experts_sharded(model, cfg.parallel.expert_parallel)
    pad_id = tokenizer.token_to_id("<|pad|>")
    stop_ids = [tokenizer.token_to_id(t) for t in STOP_TOKENS]
    prompts = Prompts(cfg, seed)
    heldout = [t for e in prompts.weights for t in tasks_for(e, "heldout", cfg.heldout, seed, cfg.env_args.get(e))]
    gen = torch.Generator().manual_seed(seed)
    sampling = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens)
    engine_root = workdir.checkpoint / ("engine" if served else f"engine-rank{ranks.rank}")
    engine = engines.enter_context(open_engine(cfg.rollout, model, tokenizer, stop_ids, pad_id, engine_root,
                                               int4=cfg.rollout_int4, batch_size=cfg.rollout_batch, ranks=ranks))
    on_vllm = cfg.rollout.backend == "vllm"
    log_path = workdir.checkpoint / "metrics.jsonl"
    weights_dir = workdir.checkpoint / "weights"
    B = cfg.prompts_per_step * cfg.group_size

    buffer: dict[int, list[Sample]] = {}
    policy = trainer.policy_for(model, cfg.optim, gen, ranks, cfg.parallel.zero_stage,
                                texts=lambda: buffer_text(buffer))
    opt = policy.optimizer
    resumed = trainer.load_latest(ckpt_root, policy, log_path, "rl-agentic")
    if resumed is not None:
        state = resumed[1]
        if lead:
            buffer = read_buffer(resumed[2])
            log.info("rl-agentic: %d groups buffered, %d re-submitted", len(buffer), len(state["inflight"]))
    else:
        state = {"step": 0, "version": 0, "next_group": 0, "submitted": 0, "inflight": []}
        if served or lead:
            engine.sync(model, 0)                   # with servers a collective: every rank publishes its part
        if lead:
            state.update(before=evaluate(engine, tokenizer, cfg, heldout, seed), gates_before=gates_before)

    pool = None
    if not cfg.synchronous and lead:
        urls = [s.url for s in engine.servers] if on_vllm or served else None
        pool = WorkerPool(cfg.workers, worker_config(cfg, inputs, seed, urls), weights_dir,
                          heartbeat_s=cfg.heartbeat_s, dead_after_s=cfg.dead_after_s)
        pool.start()

    def publish_version() -> dict[str, Any]:
        """The current version to the workers: from this process, or every rank its share; on vLLM
        or the native servers to the servers the workers send their turns to (a collective there:
        every rank publishes its part)."""
        if on_vllm or served:
            engine.sync(model, state["version"])
            return engine.metrics()
        if ranks.world == 1:
            sent = pool.publish(model, state["version"])
        else:
            sent = weight_sync.publish(weights_dir, state["version"], weight_sync.rank_part(model, ranks.rank, ranks.world),
                                       rank=ranks.rank, world=ranks.world, config_json=model.config.model_dump_json())
            ranks.barrier()
            if pool is not None:
                pool.announce(state["version"])
            moved = ranks.sum([float(sent.bytes), float(sent.buckets), sent.seconds])
            sent = weight_sync.Published(sent.version, int(moved[0]), int(moved[1]), moved[2] / ranks.world)
        return {"weight_sync/bytes": sent.bytes, "weight_sync/buckets": sent.buckets,
                "weight_sync/seconds": sent.seconds}

    def fill() -> float:
        """Fill the buffer to B samples (the synchronous reference generates them here; otherwise
        admit new groups to the workers and poll); the seconds the trainer waited."""
        t0 = time.perf_counter()
        while True:
            if pool is None:
                engine.sync(model, state["version"])
                while sum(map(len, buffer.values())) < B:
                    g = state["next_group"]
                    buffer[g] = episodes(engine, tokenizer, cfg, prompts.task(g), g, cfg.group_size, sampling, seed)
                    state["next_group"] += 1
            else:
                while admit(state["submitted"], cfg.group_size, state["version"], cfg.eta, B):
                    g = state["next_group"]
                    pool.submit(g, prompts.task(g), cfg.group_size)
                    state["next_group"] += 1
                    state["submitted"] += cfg.group_size
                for g, samples in pool.poll(timeout=1.0):
                    buffer[g] = samples
            if sum(map(len, buffer.values())) >= B:
                return time.perf_counter() - t0

    def one_step(step: int) -> dict[str, Any]:
        """Rank 0 fills the buffer and takes the oldest groups; every rank trains on them."""
        t0 = time.perf_counter()
        idle, take = 0.0, {}
        if lead:
            idle = fill()
            for g in sorted(buffer):                        # oldest groups first
                if sum(map(len, take.values())) >= B:
                    break
                take[g] = buffer.pop(g)
        take = ranks.broadcast(take)
        state.update(ranks.broadcast({k: v for k, v in state.items() if k in ("next_group", "submitted")}))
        rec = train_step(model, opt, take, state["version"], cfg, pad_id, gen, ranks)
        state["step"] = step
        if step % cfg.sync_every == 0:
            state["version"] += 1
            reset_optimizer(opt)
            if not cfg.synchronous:
                rec.update(publish_version())
        trained = [s for ss in take.values() for s in ss]
        rewards = [s.reward for s in trained]
        # a tool result in the response (loss-masked observation tokens) means the episode called a tool
        rec.update(step=step, version=state["version"], groups=sorted(take), reward=sum(rewards) / len(rewards),
                   tool_call_rate=sum(0 in s.loss_mask for s in trained) / len(trained), wait_s=idle,
                   step_s=time.perf_counter() - t0, worker_restarts=pool.restarts if pool else 0,
                   rerouted=pool.rerouted if pool else 0, **reward_audit.step_metrics(trained))
        if ranks.world > 1:
            rec["trainer_ranks"] = ranks.world
        if lead:
            reward_audit.warn("rl-agentic", rec, cfg.recheck_alert, cfg.canary_alert)
        return rec

    def meta() -> dict[str, Any]:
        state["inflight"] = sorted(pool.inflight()) if pool else []     # generated again on resume
        return state

    try:
        if not cfg.synchronous:
            publish_version()
            if pool is not None:
                for g in state["inflight"]:                 # in flight at the checkpoint: generate again
                    pool.submit(g, prompts.task(g), cfg.group_size)
        trainer.run_steps("rl-agentic", policy, one_step, start=state["step"], steps=cfg.steps, root=ckpt_root,
                          log_path=log_path, workdir=workdir, checkpoint_every=cfg.checkpoint_every,
                          keep_last=cfg.keep_last, meta=meta, describe=lambda r: f"reward {r['reward']:.3f}")
    finally:
        if pool is not None:
            pool.close()
    if served or lead:
        engine.sync(model, state["version"])
    model = trainer.whole_model(model, ranks)      # a collective with expert parallelism
    if not lead:
        return None
    after = evaluate(engine, tokenizer, cfg, heldout, seed)
    records = metrics.read(log_path)
    result = summary(records, state["before"], after)
    result["trainer_ranks"] = ranks.world
    result["placement"] = {"trainer_ranks": ranks.world, "expert_parallel": cfg.parallel.expert_parallel,
                           "rollout": cfg.rollout.backend}
    result["reward_recheck"] = reward_audit.summary(records, cfg.recheck_alert, cfg.canary_alert)
    gate = GateCheck(cfg.gates, state["gates_before"], trainer.measure_gates(model, tokenizer, cfg.gates, seed),
                     "rl-reasoning", gates.read_chain(inputs.get("rl-reasoning")), seed)
    result["gates"] = trainer.publish("rl-agentic", workdir.out, records, model=model, tokenizer_dir=inputs["tokenize"],
                                      gate=gate, export_info={"reward_last": (result["reward"] or {}).get("last")})
    return result


def worker_config(cfg: RLAgenticConfig, inputs: dict[str, Path], seed: int,
                  server_urls: list[str] | None = None) -> dict[str, Any]:
    """What a rollout worker needs; server_urls: the stage's vLLM or native servers, which the
    workers call instead of holding weights of their own."""
    vllm = served = None
    if server_urls is not None and cfg.rollout.backend == "vllm":
        vllm = {"urls": server_urls, "config": cfg.rollout.vllm.model_dump()}
    elif server_urls is not None:
        served = {"urls": server_urls, "config": cfg.rollout.servers.model_dump()}
    return {"tokenizer": str(inputs["tokenize"]), "seed": seed, "max_turns": cfg.max_turns,
            "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens},
            "int4": cfg.rollout_int4.model_dump() if cfg.rollout_int4 else None, "batch_size": cfg.rollout_batch,
            "env_args": cfg.env_args, "threads": 1, "context": cfg.context.model_dump() if cfg.context else None,
            "vllm": vllm, "served": served}


def summary(records: list[dict[str, Any]], before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    drops: Counter = Counter()
    lags: Counter = Counter()
    for r in records:
        drops.update(r.get("dropped", {}))
        lags.update({str(k): v for k, v in r.get("lag", {}).items()})
    trained = [g for r in records for g in r["groups"]]
    return {
        "steps": len(records),
        "reward": metrics.first_last(records, "reward"),
        "heldout_accuracy": {e: heldout_gain(before[e], after[e]) for e in after},
        "heldout_sampled_accuracy": {e: heldout_gain(before[e]["sampled"], after[e]["sampled"],
                                                     samples=after[e]["sampled"]["samples"])
                                     for e in after if "sampled" in after[e] and "sampled" in before[e]} or None,
        "dropped": dict(drops),
        "kept_length_mean": metrics.first_last(records, "kept_length_mean"),
        "tool_call_rate": metrics.first_last(records, "tool_call_rate"),
        "dropped_length_mean": _mean([r["dropped_length_mean"] for r in records if r.get("dropped_length_mean")]),
        "is_masked_fraction": sum(r.get("is_masked_fraction", 0.0) for r in records) / len(records),
        "mismatch": mismatch_trend(records),
        "version_lag_histogram": dict(sorted(lags.items())),
        "worker_restarts": records[-1]["worker_restarts"],
        "rerouted_groups": records[-1]["rerouted"],
        "groups_trained": len(trained),
        "groups_trained_twice": len(trained) - len(set(trained)),
        "trainer_wait_fraction": sum(r["wait_s"] for r in records) / max(sum(r["step_s"] for r in records), 1e-9),
    }
