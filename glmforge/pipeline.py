"""The stage registry: every stage the pipeline knows, in execution order.

Each library package exports its StageSpecs; this is the one place that orders them. Stages not
built yet are not listed (the README says which ones are missing)."""
from __future__ import annotations

from data_processing.ingest import STAGE as INGEST
from glmforge.stage import StageSpec


def _curation() -> list[StageSpec]:
    from data_processing.stages import STAGES as curation

    return [s for s in curation if s.name != "ingest"]


def _training() -> list[StageSpec]:
    from training.dsa import STAGES as dsa
    from posttrain.sft import STAGES as sft
    from training.stages import STAGES as training

    return [*training, *dsa, *sft]


def _posttrain() -> list[StageSpec]:
    from posttrain.distill import STAGES as distill
    from posttrain.reward_model import STAGES as reward_model
    from posttrain.rl_agentic import STAGES as rl_agentic
    from posttrain.rl_general import STAGES as rl_general
    from posttrain.rl_reasoning import STAGES as rl_reasoning

    return [*rl_reasoning, *rl_agentic, *reward_model, *rl_general, *distill]


STAGES: list[StageSpec] = [INGEST, *_curation(), *_training(), *_posttrain()]
STAGE_NAMES = [s.name for s in STAGES]
BY_NAME = {s.name: s for s in STAGES}


def get_stage(name: str) -> StageSpec:
    if name not in BY_NAME:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGE_NAMES)}")
    return BY_NAME[name]


def upstream(name: str) -> list[StageSpec]:
    """The stage and everything it depends on, in execution order."""
    need, stack = set(), [name]
    while stack:
        n = stack.pop()
        if n not in need:
            need.add(n)
            stack.extend(get_stage(n).parents)
    return [s for s in STAGES if s.name in need]


def stages_until(until: str | None) -> list[StageSpec]:
    """Stages to run for `--until STAGE`: the ones it needs (all stages when None)."""
    return list(STAGES) if until is None else upstream(until)
