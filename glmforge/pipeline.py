"""The stage registry: every stage the pipeline knows, in execution order.

This is the application's one picture of the DAG, and the only place a stage is declared.
Curation stages reference their (torch-free) modules directly; the training and post-training
stages are named by "module:attribute" references, imported only when a config is validated or a
stage runs, so `glmforge status`, `artifacts` and `--help` never load torch.

quality, issue-pr, swe-envs and decontaminate also read raw files that are no artifact (labelled
text, GitHub exports, repositories, eval sets): their `fingerprint` (a content digest of those
files) joins the stage key. Curation stages take their seeds from their own sections (seeded=False): run.seed is not in
their keys.

    ingest -> quality -> dedup-exact -> dedup-minhash -> dedup-semantic -> decontaminate
    issue-pr --------------------------------------------------------------^
    issue-pr -> swe-envs (environments from real repositories) -> rl-agentic
    decontaminate -> tokenize -> pack -> pretrain -> context-1 -> context-2 -> context-3
    -> dsa-warmup -> dsa-adapt -> sft -> rl-prompts -> rl-reasoning -> rl-agentic
    rl-reasoning -> reward-model;  rl-agentic + reward-model -> rl-general
    rl-general + sft + rl-reasoning + rl-agentic (teachers) -> distill

Iterative self-distillation (`self_distill.iterations: N`) makes post-training a loop: round r
(2..N) rejection-samples the round before's RL model (`self-distill@r`), SFT trains again on
that data (`sft@r`, from the same base model) and every post-training stage runs again on it:

    rl-reasoning@(r-1) -> self-distill@r -> sft@r -> rl-prompts@r -> rl-reasoning@r -> ...
    -> distill@r

A round's stage is the registry's stage on its round's parents: its own name, so its own key,
artifact, checkpoint and Prefect task; `glmforge resume sft@2` resumes inside round 2.
"""
from __future__ import annotations

from data_processing import (decontaminate, dedup_exact, ingest, issue_pr, minhash, packing, quality, semantic,
                             tokenizer)
import dataclasses

from runtime.stage import StageSpec
from runtime.stage import upstream as stage_upstream

LONG = ("decontaminate", "tokenize")   # the long-context stages pack their mix from these
# version 2 of the long-data stages: retrieval documents are packed whole (data_processing.packing.WHOLE)
LONG_DATA_VERSION = "2"

CURATION: list[StageSpec] = [
    StageSpec("ingest", "ingest", ingest.IngestConfig, ingest.run, version=ingest.STAGE_VERSION,
              fingerprint=ingest.fingerprint, seeded=False),
    StageSpec("quality", "quality", quality.QualityConfig, quality.run, parents=("ingest",),
              fingerprint=quality.fingerprint, seeded=False),
    StageSpec("dedup-exact", "dedup_exact", dedup_exact.DedupExactConfig, dedup_exact.run, parents=("quality",),
              seeded=False),
    StageSpec("dedup-minhash", "dedup_minhash", minhash.MinHashConfig, minhash.run, parents=("dedup-exact",),
              seeded=False),
    StageSpec("dedup-semantic", "dedup_semantic", semantic.SemanticConfig, semantic.run, parents=("dedup-minhash",),
              seeded=False),
    StageSpec("issue-pr", "issue_pr", issue_pr.IssuePRConfig, issue_pr.run, parents=(),
              fingerprint=issue_pr.fingerprint, seeded=False),
    StageSpec("decontaminate", "decontaminate", decontaminate.DecontaminateConfig, decontaminate.run,
              parents=("dedup-semantic", "issue-pr"), fingerprint=decontaminate.fingerprint, seeded=False),
    StageSpec("tokenize", "tokenize", tokenizer.TokenizeConfig, tokenizer.run, parents=("decontaminate",),
              seeded=False),
    StageSpec("pack", "pack", packing.PackConfig, packing.run, parents=("decontaminate", "tokenize"), seeded=False),
]

TRAINING: list[StageSpec] = [
    StageSpec("pretrain", "pretrain", "training.config:PretrainConfig", "training.drivers:run_pretrain",
              parents=("pack", "tokenize")),
    StageSpec("context-1", "context_1", "training.config:ContextConfig", "training.drivers:run_context_1",
              parents=("pretrain", *LONG), version=LONG_DATA_VERSION),
    StageSpec("context-2", "context_2", "training.config:ContextConfig", "training.drivers:run_context_2",
              parents=("context-1", *LONG), version=LONG_DATA_VERSION),
    StageSpec("context-3", "context_3", "training.config:ContextConfig", "training.drivers:run_context_3",
              parents=("context-2", *LONG), version=LONG_DATA_VERSION),
    StageSpec("dsa-warmup", "dsa_warmup", "training.dsa:DsaWarmupConfig", "training.dsa:run_warmup",
              parents=("context-3", *LONG), version=LONG_DATA_VERSION),
    StageSpec("dsa-adapt", "dsa_adapt", "training.dsa:DsaAdaptConfig", "training.dsa:run_adapt",
              parents=("dsa-warmup", *LONG), version=LONG_DATA_VERSION),
]

LOCAL_GPUS = "rl.placement:local_gpus"  # the RL-side stages' ranks and the servers they start

POSTTRAIN: list[StageSpec] = [
    # GLM-5 post-trains the model that DSA continue-pretraining produced.
    StageSpec("sft", "sft", "posttrain.sft:SFTConfig", "posttrain.sft:run_sft", parents=("dsa-adapt", "tokenize")),
    # RL prompts measured by the SFT model's pass rate, for rl-reasoning to filter and weight
    StageSpec("rl-prompts", "rl_prompts", "posttrain.rl_prompts:RLPromptsConfig", "posttrain.rl_prompts:run",
              parents=("sft", "tokenize"), gpus=LOCAL_GPUS),
    StageSpec("rl-reasoning", "rl_reasoning", "posttrain.rl_reasoning:RLReasoningConfig",
              "posttrain.rl_reasoning:run_rl_reasoning", parents=("sft", "tokenize", "rl-prompts"), gpus=LOCAL_GPUS),
    # software-engineering environments from real repositories (rl.swe), for rl-agentic's `swe`:
    # synthesised bugs, and issue-pr's pairs of the sources that are git checkouts
    StageSpec("swe-envs", "swe_envs", "posttrain.swe_envs:SWEEnvsConfig", "posttrain.swe_envs:run",
              parents=("issue-pr",), fingerprint="posttrain.swe_envs:fingerprint", seeded=False),
    StageSpec("rl-agentic", "rl_agentic", "posttrain.rl_agentic:RLAgenticConfig",
              "posttrain.rl_agentic:run_rl_agentic", parents=("rl-reasoning", "tokenize", "swe-envs"), gpus=LOCAL_GPUS),
    StageSpec("reward-model", "reward_model", "posttrain.reward_model:RewardModelConfig",
              "posttrain.reward_model:run_reward_model", parents=("rl-reasoning", "tokenize"), gpus=LOCAL_GPUS),
    StageSpec("rl-general", "rl_general", "posttrain.rl_general:RLGeneralConfig",
              "posttrain.rl_general:run_rl_general", parents=("rl-agentic", "reward-model", "sft", "tokenize"),
              gpus=LOCAL_GPUS),
    StageSpec("distill", "distill", "posttrain.distill:DistillConfig", "posttrain.distill:run_distill",
              parents=("rl-general", "sft", "rl-reasoning", "rl-agentic", "tokenize"), gpus=LOCAL_GPUS),
]

STAGES: list[StageSpec] = [*CURATION, *TRAINING, *POSTTRAIN]
STAGE_NAMES = [s.name for s in STAGES]
BY_NAME = {s.name: s for s in STAGES}

# The loop's rounds 2..N: the stage that makes a round's SFT data, then every post-training
# stage that depends on SFT (swe-envs, which reads only issue-pr, runs once).
SELF_DISTILL = StageSpec("self-distill", "self_distill", "posttrain.self_distill:SelfDistillConfig",
                         "posttrain.self_distill:run", parents=("rl-reasoning", "tokenize"), gpus=LOCAL_GPUS)
ROUND_STAGES = ("sft", "rl-prompts", "rl-reasoning", "rl-agentic", "reward-model", "rl-general", "distill")
# every stage that owns a section of the pipeline config
SECTIONS: list[StageSpec] = [*STAGES, SELF_DISTILL]


def in_round(name: str, r: int) -> str:
    return name if r == 1 else f"{name}@{r}"


def stage_round(name: str) -> tuple[str, int]:
    """"sft@2" -> ("sft", 2); "sft" -> ("sft", 1). Only the loop's stages have rounds."""
    base, at, r = name.partition("@")
    if not at:
        return name, 1
    loop = (SELF_DISTILL.name, *ROUND_STAGES)
    if base not in loop or not r.isdigit() or int(r) < 2:
        raise ValueError(f"unknown stage {name!r}: only {', '.join(loop)} have rounds, named STAGE@R with R >= 2 "
                         "(round 1 is the stage's plain name)")
    return base, int(r)


def stages_for(iterations: int = 1) -> list[StageSpec]:
    """Every stage of a pipeline with `iterations` post-training rounds, in execution order."""
    out = list(STAGES)
    for r in range(2, iterations + 1):
        out.append(dataclasses.replace(SELF_DISTILL, name=in_round(SELF_DISTILL.name, r),
                                       parents=(in_round("rl-reasoning", r - 1), "tokenize")))
        for spec in POSTTRAIN:
            if spec.name in ROUND_STAGES:
                parents = tuple(in_round(p, r) if p in ROUND_STAGES else p for p in spec.parents)
                if spec.name == "sft":
                    parents += (in_round(SELF_DISTILL.name, r),)
                out.append(dataclasses.replace(spec, name=in_round(spec.name, r), parents=parents))
    return out


def iterations(cfg) -> int:
    """The config's post-training rounds (self_distill.iterations)."""
    return cfg.self_distill.iterations


def get_stage(name: str, rounds: int | None = None) -> StageSpec:
    """The stage `name` ("sft", "sft@2"); with `rounds` (the config's iterations), a round past
    them is refused."""
    base, r = stage_round(name)
    if rounds is not None and r > rounds:
        raise ValueError(f"stage {name!r} is in round {r}, and the config has {rounds} "
                         f"(self_distill.iterations={rounds})")
    for spec in stages_for(r):
        if spec.name == name:
            return spec
    raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGE_NAMES)}")


def upstream(name: str) -> list[StageSpec]:
    """The stage and everything it depends on, in execution order."""
    get_stage(name)
    return stage_upstream(stages_for(stage_round(name)[1]), name)


def stages_until(until: str | None, rounds: int = 1) -> list[StageSpec]:
    """Stages to run for `--until STAGE`: the ones it needs (all stages of `rounds` rounds when None)."""
    if until is None:
        return stages_for(rounds)
    get_stage(until, rounds)
    return upstream(until)
