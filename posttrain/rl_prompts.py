"""The `rl-prompts` stage: RL prompts measured by difficulty before RL spends rollouts on them.

    sft (weights), tokenize --> rl-prompts --> rl-reasoning

GLM-4.5 (which GLM-5 builds on) filters its RL prompts by how often the SFT model already solves
them: dropping the ones it always solves gave +2-4% with half the data, and hard ones get more
samples. This stage measures that once, as an artifact with its own key: for up to `candidates`
prompts of each domain (a seeded choice), `samples` responses from the SFT model on the rollout
engine (native, served or vLLM), scored by the same verifiers rl-reasoning rewards with (rl.rewards;
model-written code in the sandbox). A prompt's pass rate is the share of its samples rewarded 1.
rl-reasoning then draws from the pool with its `prompt_pool` policy (rl.prompts).

Prompts are measured in chunks of `chunk`; each chunk samples from its own seeded generator and
is appended to the checkpoint's pool.jsonl with a cursor, so a killed stage goes on after its
last chunk and writes the pool an uninterrupted one would have.

Artifact: pool.jsonl (one prompt per line: the task, its pass rate, mean reward and rewards) and
pool.json (per domain: prompts, mean pass rate, the pass-rate histogram).
"""
from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from chat.template import STOP_TOKENS
from data_processing.tokenizer import load_tokenizer
from domains.pools import DOMAINS, load_pools
from domains.task import Task
from runtime.stage import OPERATIONAL, Workdir
from rl import trainer
from rl.prompts import histogram
from rl.rewards import RewardWorker
from rl.rollout import RolloutConfig, SamplingParams, open_engine, prompt_ids
from rl.sample import Sample
from rl.scoring import score
from rl.sandbox import require_isolation

POOL = "pool.jsonl"


class RLPromptsConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    domains: list[str] = Field(["arithmetic"], min_length=1, description=f"domains to measure, of {DOMAINS}")
    candidates: int = Field(512, ge=1, description="prompts measured per domain at most (a seeded choice of its "
                            "pool; all of it when smaller)")
    samples: int = Field(8, ge=1, description="responses per prompt from the SFT model: its pass rate's resolution")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (rl-reasoning's, so the pass rate is "
                               "the one its rollouts will see)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    max_new_tokens: int = Field(512, ge=1, description="response length limit")
    chunk: int = Field(64, ge=1, description="prompts measured between checkpoints")
    rollout_batch: int = Field(256, ge=1, description="sequences per generate() call")
    rollout: RolloutConfig = Field(RolloutConfig(), description="the engine samples come from: native, served or vLLM")
    reward_timeout_s: float = Field(10.0, gt=0, description="deadline of one reward call")
    sandbox_allow_weak_isolation: StrictBool = Field(False, json_schema_extra=OPERATIONAL, description=(
        "where bwrap is missing, run the code domain's model-written code with only limits (rl.sandbox); false: "
        "the stage refuses to start"))
    gsm8k_path: str = Field("{samples}/gsm8k/train.jsonl", description="GSM8K train file (math and tool domains)")
    gsm8k_skip: int = Field(200, ge=0, description="GSM8K train lines SFT holds out (not RL prompts)")
    mbpp_path: str = Field("{samples}/mbpp/mbpp.jsonl", description="MBPP file (code domain)")
    threads: Optional[int] = Field(None, ge=1, description="torch threads of the stage's process")

    @field_validator("domains")
    @classmethod
    def _domains(cls, v: list[str]) -> list[str]:
        bad = sorted(set(v) - set(DOMAINS))
        if bad:
            raise ValueError(f"unknown domains {bad}; known: {', '.join(DOMAINS)}")
        return v


def candidates(cfg: RLPromptsConfig, seed: int) -> list[Task]:
    """The prompts to measure, in order: per domain a seeded choice of up to `candidates`."""
    pools = load_pools({d: 1.0 for d in cfg.domains}, gsm8k_path=cfg.gsm8k_path, gsm8k_skip=cfg.gsm8k_skip,
                       mbpp_path=cfg.mbpp_path)
    out: list[Task] = []
    for d in cfg.domains:
        pool = pools[d]
        pick = random.Random(f"{seed}/rl-prompts/{d}").sample(range(len(pool)), min(cfg.candidates, len(pool)))
        out += [pool[i] for i in sorted(pick)]
    return out


def sample_and_score(engine, worker: RewardWorker, tokenizer, tasks: list[Task], k: int, sampling: SamplingParams,
                     generator: torch.Generator, timeout_s: float) -> list[list[Sample]]:
    """k sampled responses of each task, scored by the verifiers: one list of samples per task."""
    samples = [Sample(t, i, prompt_ids(tokenizer, t)) for i, t in enumerate(tasks) for _ in range(k)]
    engine.generate(samples, sampling, generator)
    score(worker, samples, timeout_s)
    return [samples[i * k:(i + 1) * k] for i in range(len(tasks))]


def measure(engine, worker: RewardWorker, tokenizer, tasks: list[Task], k: int, sampling: SamplingParams,
            generator: torch.Generator, timeout_s: float) -> list[dict[str, Any]]:
    """Each task's k sampled responses scored: {task, pass_rate (share rewarded 1), mean_reward, rewards}."""
    out = []
    for t, group in zip(tasks, sample_and_score(engine, worker, tokenizer, tasks, k, sampling, generator, timeout_s)):
        rewards = [s.reward for s in group]
        out.append({"domain": t.domain, "prompt": t.prompt, "answer": t.answer, "meta": t.meta,
                    "pass_rate": sum(r >= 1.0 for r in rewards) / k, "mean_reward": sum(rewards) / k,
                    "rewards": rewards})
    return out


def in_chunks(tasks: list[Task], chunk: int, workdir: Workdir, lines: Path, desc: str,
              rows_of: Callable[[list[Task], int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """rows_of(each chunk of `chunk` tasks, its index), appended to `lines` (a JSONL file in the
    checkpoint) with a cursor after each chunk: a killed stage goes on after its last chunk, and
    what it wrote after that cursor is cut off first. Returns every row, in task order."""
    cursor_file = lines.with_name(lines.stem + ".cursor.json")
    cursor = json.loads(cursor_file.read_text()) if cursor_file.exists() else {"chunks": 0, "bytes": 0}
    with open(lines, "ab") as f:                 # what a killed attempt wrote after its last cursor
        f.truncate(cursor["bytes"])
    chunks = [tasks[i:i + chunk] for i in range(0, len(tasks), chunk)]
    for c in range(cursor["chunks"], len(chunks)):
        rows = rows_of(chunks[c], c)
        with open(lines, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        cursor = {"chunks": c + 1, "bytes": lines.stat().st_size}
        tmp = cursor_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(cursor))
        tmp.replace(cursor_file)
        workdir.persist_checkpoint()
        workdir.progress(min((c + 1) * chunk, len(tasks)), len(tasks), desc)
    return [json.loads(x) for x in lines.read_text(encoding="utf-8").splitlines() if x.strip()]


class PolicySampler:
    """`parent`'s model on its rollout engine, with a reward worker beside it, all started on first
    use (`open()`, from a chunk that needs sampling): a stage resumed after its last chunk, or whose
    chunks are all done, loads no model and starts no server or worker. A context manager: leaving
    it closes whatever was started."""

    def __init__(self, cfg: RLPromptsConfig, inputs: dict[str, Path], parent: str, workdir: Workdir):
        self.cfg, self.inputs, self.parent, self.workdir = cfg, inputs, parent, workdir
        self.tokenizer = load_tokenizer(inputs["tokenize"])
        self.sampling = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens)
        self._stack = contextlib.ExitStack()
        self._opened: tuple[Any, RewardWorker] | None = None

    def open(self) -> tuple[Any, RewardWorker]:
        """(the rollout engine holding the parent's weights, the reward worker)."""
        if self._opened is None:
            cfg, tok = self.cfg, self.tokenizer
            model = trainer.load_policy(self.inputs[self.parent], self.parent, tok, self.workdir.seed, cfg.threads)
            engine = self._stack.enter_context(open_engine(
                cfg.rollout, model, tok, [tok.token_to_id(t) for t in STOP_TOKENS], tok.token_to_id("<|pad|>"),
                self.workdir.checkpoint / "engine", batch_size=cfg.rollout_batch))
            engine.sync(model, 0)
            self._opened = engine, self._stack.enter_context(RewardWorker())
        return self._opened

    def __enter__(self) -> "PolicySampler":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


def run(cfg: RLPromptsConfig, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]:
    if "code" in cfg.domains:
        require_isolation(cfg.sandbox_allow_weak_isolation, "rl_prompts.sandbox_allow_weak_isolation")
    seed = workdir.seed
    tasks = candidates(cfg, seed)
    workdir.checkpoint.mkdir(parents=True, exist_ok=True)
    with PolicySampler(cfg, inputs, "sft", workdir) as sampler:

        def rows_of(chunk: list[Task], c: int) -> list[dict[str, Any]]:
            engine, worker = sampler.open()
            gen = torch.Generator().manual_seed(seed * 1_000_003 + c)
            return measure(engine, worker, sampler.tokenizer, chunk, cfg.samples, sampler.sampling, gen,
                           cfg.reward_timeout_s)

        rows = in_chunks(tasks, cfg.chunk, workdir, workdir.checkpoint / POOL, "rl-prompts: measured", rows_of)
    workdir.out.mkdir(parents=True, exist_ok=True)
    (workdir.out / POOL).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    result = summary(rows, cfg.samples)
    (workdir.out / "pool.json").write_text(json.dumps(result, indent=1))
    return result


def summary(rows: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """Per domain: prompts, mean pass rate, solved (1) and unsolved (0) shares, and the histogram."""
    out: dict[str, Any] = {"prompts": len(rows), "samples_per_prompt": k, "domains": {}}
    for d in sorted({r["domain"] for r in rows}):
        rates = [r["pass_rate"] for r in rows if r["domain"] == d]
        out["domains"][d] = {"prompts": len(rates), "mean_pass_rate": sum(rates) / len(rates),
                             "solved": sum(p == 1.0 for p in rates) / len(rates),
                             "unsolved": sum(p == 0.0 for p in rates) / len(rates),
                             "histogram": histogram(rates)}
    return out
