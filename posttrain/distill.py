"""The `distill` stage: on-policy cross-stage distillation, then the final INT4 export.

    rl-general (the student), sft / rl-reasoning / rl-agentic (teachers), tokenize --> distill

GLM-5 ends post-training by distilling the earlier stages' final checkpoints back into the last
RL model, so an RL stage that lowered an earlier domain's accuracy gets it back. Each step:
  1. for each teacher, `prompts_per_teacher` prompts from its domain, a pure function of
     (seed, step, teacher):
        sft           GSM8K train questions (after the lines SFT holds out), thinking off
        rl-reasoning  synthetic addition (domains.arithmetic train pairs)
        rl-agentic    addition with the calculator tool declared (the calc_arith environment's
                      prompt shape; the environments' own multi-turn episodes are not replayed)
  2. the student samples one response per prompt (group size 1) through the rollout engine;
  3. the prompt's teacher scores the student's exact token ids (no re-tokenisation: teacher and
     student must share the tokenizer, which is checked, see check_teacher);
  4. per token A_t = sg(log pi_teacher - log pi_student_old), and the GRPO + IcePop update with
     that per-token advantage: the `opd` policy loss (rl.algorithms, rl.opd.opd_loss: the RL
     core's IS correction, IcePop weights) through the trainer's update (rl.update).
With `use_qat` the student trains with INT4 fake quantization (quant.qat, as sft does): the
final exported INT4 model (export/int4, int4/) is the distilled one, the end of the chain.

Evals: rl.gates on every teacher, the student before and the result after: the full
table sft -> rl-reasoning -> rl-agentic -> rl-general -> distill (gates.md / gates.png), and per
teacher domain the teacher's, the student's before and after values with the share of the gap
recovered (`recovery`, (after - before) / (teacher - before) where the student was behind).
"""
from __future__ import annotations

import contextlib
import logging
import random
import time
from pathlib import Path
from typing import Any, Optional

import torch
from pydantic import Field, field_validator, model_validator

from chat.template import STOP_TOKENS
from data_processing.tokenizer import load_tokenizer
from domains import arithmetic
from domains.pools import gsm8k_tasks
from domains.task import Task
from runtime.stage import Workdir
from model.hf import artifact_weights, load_state, state_config
from model.config import ModelConfig
from model.model import GLMModel
from quant.qat import QATConfig, prepare_qat, ptq_int4, remove_qat, save_int4
from rl import gates, trainer
from rl.algorithms import PolicyLossName
from rl.gates import EVALS
from rl.ranks import SINGLE, Ranks, check_placement
from rl.rollout import RolloutEngine, SamplingParams, open_engine, prompt_ids
from rl.sample import Sample, Status
from rl.served import ServedEngine, ServerPoolConfig, group_seeds, named_pool
from rl.trainer import GateCheck
from rl.update import UpdateParams, collate, mismatch_trend, response_logprobs, update
from rl.stage_config import RLStageConfig
from training import checkpoint, metrics

log = logging.getLogger("glmforge")
TEACHERS = ("sft", "rl-reasoning", "rl-agentic")
# the evals that measure each teacher's domain
DOMAIN_EVALS = {"sft": ("gsm8k_acc", "heldout_ppl"), "rl-reasoning": ("arithmetic_acc",),
                "rl-agentic": ("tool_call_validity", "arithmetic_acc")}


class DistillConfig(RLStageConfig):
    steps: int = Field(100, ge=1, description="distillation steps (rollouts, teacher scoring, update)")
    teachers: tuple[str, ...] = Field(TEACHERS, description="teacher stages (their domains' prompts)")
    prompts_per_teacher: int = Field(32, ge=1, description="prompts per teacher per step (group size 1)")
    policy_loss: PolicyLossName = Field("opd", description="policy loss by name (rl.algorithms.POLICY_LOSSES); "
                                        "opd reads the teachers' log-probs as per-token advantages")
    adv_clip: Optional[float] = Field(5.0, gt=0, description="clip |A_t| (nats); null: no clip")
    minibatches: int = Field(1, ge=1, description="optimizer steps per rollout batch (per epoch)")
    max_new_tokens: int = Field(256, ge=1, description="tokens a student's response may have at most")
    teacher_servers: ServerPoolConfig = Field(ServerPoolConfig(replicas=1), description=(
        "with rollout.backend=served: the server pool each teacher is served from (one pool per teacher, "
        "loaded from its artifact); the trainer's ranks then hold no teacher"))
    gsm8k_path: str = Field("{samples}/gsm8k/train.jsonl", description=(
        "GSM8K train questions of the sft teacher's prompts ({samples} expands)"))
    gsm8k_skip: int = Field(200, ge=0, description="GSM8K train lines SFT holds out (not RL prompts)")
    use_qat: bool = Field(True, description="train with INT4 fake quantization; the INT4 export is the final model")
    qat: QATConfig = Field(QATConfig(), description=(
        "the INT4 settings of training and export: the module kinds quantized and the group size of their scales"))
    export_hf: bool = Field(True, description="export/full + export/int4 (HF layout) besides int4/")

    @model_validator(mode="after")
    def _placement(self) -> "DistillConfig":
        check_placement("distill", self.parallel, self.rollout.backend)
        return self

    @field_validator("teachers")
    @classmethod
    def _teachers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = sorted(set(v) - set(TEACHERS))
        if bad or not v:
            raise ValueError(f"teachers must be a non-empty subset of {TEACHERS}, got {list(v)}")
        return v


# ---------------------------------------------------------------- teachers
def check_teacher(name: str, teacher_dir: Path, teacher: GLMModel | ModelConfig, tokenizer, student: GLMModel) -> None:
    """Refuse a teacher (its model, or its config) that cannot score the student's token ids: a
    different vocabulary size, or a tokenizer (its artifact's hf/tokenizer.json) whose token -> id
    map differs from the student's."""
    tv = (teacher.config if isinstance(teacher, GLMModel) else teacher).vocab_size
    sv = student.config.vocab_size
    if tv != sv:
        raise ValueError(f"distill: teacher {name!r} ({teacher_dir}) has vocab_size {tv}, the student {sv}: "
                         "on-policy distillation scores the student's exact token ids, so teacher and student "
                         "must share one tokenizer")
    tok_file = Path(teacher_dir) / "hf" / "tokenizer.json"
    if tok_file.exists():
        from tokenizers import Tokenizer

        theirs, ours = Tokenizer.from_file(str(tok_file)).get_vocab(), tokenizer.get_vocab()
        if theirs != ours:
            diff = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
            raise ValueError(f"distill: teacher {name!r}'s tokenizer ({tok_file}) differs from the student's "
                             f"({len(theirs)} vs {len(ours)} tokens; e.g. {diff}): on-policy distillation scores "
                             "the student's exact token ids, so teacher and student must share one tokenizer")


def domain_prompts(teacher: str, cfg: DistillConfig, seed: int) -> tuple[list[Task], Optional[list[dict]]]:
    """(task pool, tools declared in the prompt) of a teacher's domain."""
    if teacher == "sft":
        return gsm8k_tasks(cfg.gsm8k_path, cfg.gsm8k_skip), None
    pool = [arithmetic.task(a, b) for a, b in arithmetic.pairs("train")]
    if teacher == "rl-reasoning":
        return pool, None
    from domains.tools import CALCULATOR

    return pool, [CALCULATOR]


def draw(pool: list[Task], n: int, seed: int, step: int, teacher: str) -> list[Task]:
    rng = random.Random(f"{seed}/{step}/{teacher}")
    return [rng.choice(pool) for _ in range(n)]


@torch.no_grad()
def teacher_logprobs(teacher: GLMModel, samples: list[Sample], pad_id: int, chunk: int = 64) -> list[list[float]]:
    """log pi_teacher of each response token of the student's samples, on their exact ids."""
    out: list[list[float]] = []
    for i in range(0, len(samples), chunk):
        part = samples[i:i + chunk]
        b = collate(part, pad_id)
        logits = teacher(b["input_ids"], attention_mask=b["attention_mask"], logits_at=b["response_region"] > 0).logits
        logp, _ = response_logprobs(logits, b, 1.0)
        for k, s in enumerate(part):
            start = len(s.prompt_ids) - 1
            out.append(logp[k, start:start + len(s.response_ids)].tolist())
    return out


def distill_step(engine: RolloutEngine, model: GLMModel, opt: torch.optim.Optimizer,
                 teachers: dict[str, GLMModel], prompts: dict[str, list[list[int]]], pad_id: int,
                 sampling: SamplingParams, params: UpdateParams, gen: torch.Generator,
                 step: int, tasks: Optional[dict[str, list[Task]]] = None, ranks: Ranks = SINGLE,
                 sample_gen: Optional[torch.Generator] = None) -> dict[str, Any]:
    """One step (module doc 2-4) on prompt token ids per teacher; returns the step's statistics.
    On ranks each samples and scores with the teachers its share of the prompts (from its own
    `sample_gen`), and all train on the gathered batch with the shared `gen` (rl.ranks)."""
    engine.sync(model, step)
    samples, owner = [], []
    for name, ps in prompts.items():
        for i, ids in enumerate(ps):
            task = tasks[name][i] if tasks else Task(name, "", "")
            samples.append(Sample(task, len(samples), list(ids)))       # group size 1: a group per sample
            owner.append(name)
    lo, hi = ranks.bounds(len(samples))
    if isinstance(engine, ServedEngine):      # per-sample seeds alike on any placement (group = index)
        seeds = group_seeds(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)), len(samples))
        engine.generate(samples[lo:hi], sampling, gen, seeds={i: seeds[i] for i in range(lo, hi)})
    else:
        engine.generate(samples[lo:hi], sampling, sample_gen or gen)
    for name, teacher in teachers.items():
        idx = [i for i, o in enumerate(owner) if o == name and lo <= i < hi]
        mine = [samples[i] for i in idx]
        if isinstance(teacher, ServedEngine):
            scored = teacher.prefill_logprobs([(s.prompt_ids, s.response_ids) for s in mine])
        else:
            scored = teacher_logprobs(teacher, mine, pad_id)
        for i, lp in zip(idx, scored):
            samples[i].teacher_logprobs = lp
    samples = [s for share in ranks.gather(samples[lo:hi]) for s in share]
    rec: dict[str, Any] = update(model, opt, samples, pad_id, params, gen, ranks)
    for name in teachers:
        idx = [i for i, o in enumerate(owner) if o == name and samples[i].trainable]
        gaps = [t - s for i in idx for t, s in zip(samples[i].teacher_logprobs, samples[i].train_logprobs or [])]
        if gaps:
            rec[f"reverse_kl/{name}"] = -sum(gaps) / len(gaps)
    rec["response_length"] = sum(len(s.response_ids) for s in samples) / len(samples)
    rec["truncated_fraction"] = sum(s.status == Status.TRUNCATED for s in samples) / len(samples)
    return rec


# ---------------------------------------------------------------- recovery
def recovery(teacher: dict[str, float], before: dict[str, float], after: dict[str, float], names: tuple[str, ...]
             ) -> dict[str, dict[str, Any]]:
    """Per eval: teacher / before / after and, where the student was behind the teacher, the share
    of the gap recovered ((after - before) / (teacher - before); 1 = all of it)."""
    out = {}
    for n in names:
        sign = EVALS[n]
        gap = sign * (teacher[n] - before[n])
        rec = sign * (after[n] - before[n]) / gap if gap > 1e-12 else None
        out[n] = {"teacher": teacher[n], "before": before[n], "after": after[n], "recovered": rec}
    return out


# ---------------------------------------------------------------- the stage
def run_distill(cfg: DistillConfig, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]:
    for name in cfg.teachers:            # a teacher missing its weights: one line before any rank or server starts
        artifact_weights(inputs[name], name)
    if cfg.parallel.launch.world_size > 1:
        from rl.launch import run_on_ranks

        return run_on_ranks("distill", cfg, inputs, workdir, cfg.parallel.launch)
    return train(cfg, inputs, workdir)


def train(cfg: DistillConfig, inputs: dict[str, Path], workdir: Workdir, ranks: Ranks = SINGLE) -> dict[str, Any] | None:
    """The stage in this process, or as one of `ranks` (rl.launch; rl_reasoning.train's split:
    shares of the prompts per rank, rank 0 measures, gates and exports). With rollout servers
    (rollout.backend=served) the student samples from them and each teacher is a server
    pool of its own: the ranks hold only the student (expert-sharded with parallel.expert_parallel)."""
    seed = workdir.seed
    lead = ranks.rank == 0
    served = cfg.rollout.backend == "served"
    tokenizer = load_tokenizer(inputs["tokenize"])
    model = trainer.load_policy(inputs["rl-general"], "rl-general", tokenizer, seed)
    teacher_files = {name: artifact_weights(inputs[name], name) for name in cfg.teachers}
    teachers: dict[str, GLMModel | ServedEngine] = {}
    for name, path in teacher_files.items():
        if served:
            check_teacher(name, inputs[name], state_config(path), tokenizer, model)
            continue
        t = load_state(path)
        check_teacher(name, inputs[name], t, tokenizer, model)
        t.eval()
        for p in t.parameters():
            p.requires_grad_(False)
        teachers[name] = t
    stop_ids = [tokenizer.token_to_id(t) for t in STOP_TOKENS]
    pad_id = tokenizer.token_to_id("<|pad|>")
    pools = {n: domain_prompts(n, cfg, seed) for n in cfg.teachers}
    root, log_path = workdir.checkpoint / trainer.CHECKPOINTS, workdir.checkpoint / "metrics.jsonl"

    found = checkpoint.select_resume(root)          # before QAT: the gates measure the model as given
    before, teacher_evals = {}, {}
    if found is None and lead:
        before = trainer.measure_gates(model, tokenizer, cfg.gates, seed, (inputs.get("rl-general"), "rl-general"))
        for n, path in teacher_files.items():     # a served teacher is loaded here only when its gates are not recorded
            known = gates.recorded(gates.read_chain(inputs.get(n)), n, gates.spec(cfg.gates.evals, seed))
            teacher_evals[n] = known if known is not None else trainer.measure_gates(
                teachers.get(n) or load_state(path), tokenizer, cfg.gates, seed)
    ranks = ranks.with_experts_sharded(model, cfg.parallel.expert_parallel)
    if cfg.use_qat:
        prepare_qat(model, cfg.qat)      # names unchanged: checkpoints and engine syncs stay plain copies
    gen = torch.Generator().manual_seed(seed)
    sample_gen = trainer.sampling_rng(gen, seed, ranks)
    policy = trainer.policy_for(model, cfg.optim, gen, ranks, cfg.parallel.zero_stage, sample_gen)
    opt = policy.optimizer
    resumed = trainer.load_latest(root, policy, log_path, "distill")
    start = 0
    if resumed is not None:
        start, before, teacher_evals = resumed[0], resumed[1]["before"], resumed[1]["teacher_evals"]
    sampling = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens)
    params = UpdateParams(cfg.eps_low, cfg.eps_high, cfg.icepop_beta, cfg.minibatches, 1, cfg.temperature,
                          False, cfg.optim.grad_clip, cfg.policy_loss, cfg.adv_clip)

    def one_step(step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        tasks = {n: draw(pools[n][0], cfg.prompts_per_teacher, seed, step, n) for n in cfg.teachers}
        prompts = {n: [prompt_ids(tokenizer, t, pools[n][1]) for t in ts] for n, ts in tasks.items()}
        rec = distill_step(engine, model, opt, teachers, prompts, pad_id, sampling, params, gen, step, tasks,
                           ranks, sample_gen)
        rec.update(step=step, step_s=time.perf_counter() - t0, **engine.metrics())
        if ranks.world > 1:
            rec["trainer_ranks"] = ranks.world
        return rec

    engine_root = workdir.checkpoint / ("engine" if served else f"engine-rank{ranks.rank}")
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(open_engine(cfg.rollout, model, tokenizer, stop_ids, pad_id, engine_root,
                                                 int4=cfg.rollout_int4, batch_size=cfg.rollout_batch, ranks=ranks))
        if served:
            for name, path in teacher_files.items():
                pool = stack.enter_context(ServedEngine(None, tokenizer, stop_ids, pad_id,
                                                        named_pool(cfg.teacher_servers, name),
                                                        workdir.checkpoint / "teachers" / name, ranks=ranks,
                                                        model=state_config(path)))
                pool.serve_file(path)
                teachers[name] = pool
        trainer.run_steps("distill", policy, one_step, start=start, steps=cfg.steps, root=root, log_path=log_path,
                          workdir=workdir, checkpoint_every=cfg.checkpoint_every, keep_last=cfg.keep_last,
                          meta=lambda: {"before": before, "teacher_evals": teacher_evals},
                          describe=lambda r: f"reverse KL {r.get('reverse_kl', float('nan')):.3f}")
    if cfg.use_qat:
        remove_qat(model)            # the full-precision weights QAT trained; INT4 is exported from them
    model = trainer.whole_model(model, ranks)       # a collective with expert parallelism
    if not lead:
        return None
    after = trainer.measure_gates(model, tokenizer, cfg.gates, seed)
    int4_after = trainer.measure_gates(ptq_int4(model, cfg.qat), tokenizer, cfg.gates, seed)
    records = metrics.read(log_path)
    out = workdir.out
    result = summary(cfg, records, before, after, int4_after, teacher_evals)
    result["trainer_ranks"] = ranks.world
    result["placement"] = {"trainer_ranks": ranks.world, "expert_parallel": cfg.parallel.expert_parallel,
                           "rollout": cfg.rollout.backend, "teachers_served": served}
    measured = gates.spec(cfg.gates.evals, seed)
    gate = GateCheck(cfg.gates, before, after, "rl-general", chain_parent(inputs, teacher_evals, before, measured), seed)
    result["gates"] = trainer.publish("distill", out, records, model=model, tokenizer_dir=inputs["tokenize"], gate=gate,
                                      export_info=dict(after), plot=lambda rs, o: plot(rs, o / "distill.png", cfg.teachers))
    save_int4(model, cfg.qat, out / "int4")
    if cfg.export_hf:
        from quant.export import export_all

        export_all(model, cfg.qat, out / "export", inputs["tokenize"])
    return result


def chain_parent(inputs: dict[str, Path], teacher_evals: dict[str, dict[str, float]], before: dict[str, float],
                 measured: dict[str, Any]) -> dict[str, Any]:
    """rl-general's gate chain, with any teacher stage it lacks filled in from the teachers'
    measured evals (a stage without gates.json, e.g. an rl-agentic built before the gates)."""
    parent = gates.read_chain(inputs.get("rl-general")) or {"chain": [gates.entry("rl-general", before, measured)],
                                                            "gates": {}}
    have = {c["stage"] for c in parent["chain"]}
    missing = [gates.entry(n, teacher_evals[n], measured) for n in TEACHERS if n in teacher_evals and n not in have]
    return {"chain": missing + parent["chain"], "gates": parent["gates"]}


def summary(cfg: DistillConfig, records: list[dict[str, Any]], before: dict[str, float], after: dict[str, float],
            int4_after: dict[str, float], teacher_evals: dict[str, dict[str, float]]) -> dict[str, Any]:
    domains = {n: recovery(teacher_evals[n], before, after, DOMAIN_EVALS[n]) for n in cfg.teachers}
    rec_values = [e["recovered"] for d in domains.values() for e in d.values() if e["recovered"] is not None]
    k = max(1, len(records) // 10)
    return {
        "steps": len(records),
        "reverse_kl": {"first": sum(r.get("reverse_kl", 0.0) for r in records[:k]) / k,
                       "last": sum(r.get("reverse_kl", 0.0) for r in records[-k:]) / k},
        "reverse_kl_per_teacher": {n: {"first": records[0].get(f"reverse_kl/{n}"), "last": records[-1].get(f"reverse_kl/{n}")}
                                   for n in cfg.teachers},
        "domain_accuracy": domains,
        "min_recovered": min(rec_values) if rec_values else None,
        "icepop_masked_fraction": sum(r.get("icepop_masked_fraction", 0.0) for r in records) / len(records),
        "mismatch": mismatch_trend(records),
        "int4_evals": int4_after,
        "qat": cfg.use_qat,
    }


def plot(records: list[dict[str, Any]], png: Path, teachers: tuple[str, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records]
    for n in teachers:
        ax.plot(steps, [r.get(f"reverse_kl/{n}", float("nan")) for r in records], label=f"KL(student || {n})")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token (on student samples)")
    ax.set_title("distill: on-policy cross-stage distillation")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
