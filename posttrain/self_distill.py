"""The `self-distill@R` stage: a round of iterative self-distillation's SFT data, rejection-sampled
from the round before's RL model.

    rl-reasoning@(R-1) (weights), tokenize --> self-distill@R --> sft@R --> the RL stages @R

GLM-5 runs RL until the reward plateaus, then lets the RL model's verified trajectories replace
the SFT data and trains SFT and RL again: what RL found becomes the next round's starting point.
For `candidates` prompts of each domain (rl-prompts' seeded choice), `samples` responses from the
RL model on the rollout engine, scored by the verifiers rl-reasoning rewards with; a response
rewarded 1 that ended on its stop token is kept, distinct responses only, at most
`cap_per_prompt` of a prompt (so the easy prompts, solved k times out of k, do not crowd out the
hard ones). Examples are token ids, prompt and response as sampled (token in, token out: SFT
trains on exactly what the model wrote, never a re-tokenised decode).

SFT then adds them to its train split; with `replace`, they take the place of the original
demonstrations of their domain (arithmetic: the direct-answer ones, which the preset corrupts on
purpose to leave RL room; math: the GSM8K rationales), and the tool-call demonstrations and
everything else of the original mix stay. The held-out splits are unchanged, so the rounds'
evaluations compare.

Chunks of `chunk` prompts, each with its own seeded generator and a cursor in the checkpoint
(posttrain.rl_prompts.in_chunks): a killed stage goes on after its last chunk.

Artifact: examples.jsonl (domain, prompt, prompt_ids, response_ids), self_distill.json (counts).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from domains.task import Task
from posttrain.rl_prompts import PolicySampler, RLPromptsConfig, candidates, in_chunks, sample_and_score
from posttrain.sft_data import DISTILLED, DISTILLED_META
from rl.sample import Status
from rl.sandbox import require_isolation
from runtime.stage import Workdir

TEACHER = "rl-reasoning"     # the round's model whose verified responses become the next SFT data


class SelfDistillConfig(RLPromptsConfig):
    iterations: int = Field(1, ge=1, description="post-training rounds: 1 runs sft and the RL stages once; N "
                            "adds rounds 2..N (self-distill@R, sft@R, rl-prompts@R ... distill@R)")
    samples: int = Field(4, ge=1, description="responses per prompt from the round's RL model")
    cap_per_prompt: int = Field(2, ge=1, description="distinct verified responses kept per prompt at most")
    min_examples: int = Field(1, ge=0, description="fewer verified examples fail the stage (nothing for the next "
                              "round to learn from); 0: the round's SFT trains on the original mix alone")
    replace: bool = Field(True, description="the distilled examples replace SFT's original demonstrations of "
                          "their domain (arithmetic: the direct answers; math: GSM8K rationales); false: added")


def kept(group, cap: int) -> list[dict[str, Any]]:
    """A prompt's verified responses (rewarded 1, ended on a stop token), distinct, at most `cap`,
    in sampling order."""
    out, seen = [], set()
    for s in group:
        ids = tuple(s.response_ids)
        if s.status is Status.OK and s.reward >= 1.0 and ids not in seen and len(out) < cap:
            seen.add(ids)
            out.append({"prompt_ids": list(s.prompt_ids), "response_ids": list(ids)})
    return out


def run(cfg: SelfDistillConfig, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]:
    if "code" in cfg.domains:
        require_isolation(cfg.sandbox_allow_weak_isolation, "self_distill.sandbox_allow_weak_isolation")
    seed = workdir.seed
    tasks = candidates(cfg, seed)
    workdir.checkpoint.mkdir(parents=True, exist_ok=True)
    with PolicySampler(cfg, inputs, TEACHER, workdir) as sampler:

        def rows_of(chunk: list[Task], c: int) -> list[dict[str, Any]]:
            engine, worker = sampler.open()
            gen = torch.Generator().manual_seed(seed * 1_000_003 + 7_919 + c)
            groups = sample_and_score(engine, worker, sampler.tokenizer, chunk, cfg.samples, sampler.sampling, gen,
                                      cfg.reward_timeout_s)
            return [{"domain": t.domain, "prompt": t.prompt, "pass_rate": sum(s.reward >= 1.0 for s in g) / len(g),
                     "kept": kept(g, cfg.cap_per_prompt)} for t, g in zip(chunk, groups)]

        rows = in_chunks(tasks, cfg.chunk, workdir, workdir.checkpoint / "rows.jsonl", "self-distill: sampled",
                         rows_of)
    examples = [{"domain": r["domain"], "prompt": r["prompt"], **k} for r in rows for k in r["kept"]]
    if len(examples) < cfg.min_examples:
        raise ValueError(f"self-distill: {len(examples)} verified responses ({cfg.samples} samples of {len(rows)} "
                         f"prompts), fewer than min_examples={cfg.min_examples}: too little SFT data for the next "
                         "round (more candidates or samples, or fewer rounds)")
    workdir.out.mkdir(parents=True, exist_ok=True)
    (workdir.out / DISTILLED).write_text("".join(json.dumps(e) + "\n" for e in examples))
    result = {"prompts": len(rows), "samples_per_prompt": cfg.samples, "cap_per_prompt": cfg.cap_per_prompt,
              "replace": cfg.replace, "examples": len(examples),
              "domains": {d: {"prompts": sum(r["domain"] == d for r in rows),
                              "mean_pass_rate": _mean([r["pass_rate"] for r in rows if r["domain"] == d]),
                              "prompts_with_examples": sum(bool(r["kept"]) for r in rows if r["domain"] == d),
                              "examples": sum(e["domain"] == d for e in examples)}
                          for d in sorted({r["domain"] for r in rows})}}
    (workdir.out / DISTILLED_META).write_text(json.dumps(result, indent=1))
    return result


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None
