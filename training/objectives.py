"""What a training step optimises. Every training stage runs the same loop, checkpoints and
launch (training.loop); what differs between pretraining, DSA indexer training and SFT is the
objective, chosen by name in the rank spec: {"objective": {"name": "lm", ...params}}.

An objective may change the model before the DeepSpeed engine is built (freeze all but the
indexer, wrap linears for QAT) and computes a micro-batch's loss. It reports floats under
"loss", "lm", "mtp" and "balance" (zero where they do not apply) so step logs, curves and stage
summaries read the same for every stage, plus any extra metrics of its own (e.g. "kl").
"""
from __future__ import annotations

from typing import Any, Callable

import torch

BASE_METRICS = ("loss", "lm", "mtp", "balance")


class Objective:
    """The model's own loss: next-token LM + MTP + sequence-wise balance (pretraining)."""

    def __init__(self, **params: Any):
        if params:
            raise ValueError(f"objective {type(self).__name__} takes no parameters, got {sorted(params)}")

    def prepare(self, model: torch.nn.Module) -> None:
        """Change the model before the optimizer sees it (default: nothing)."""

    def begin_step(self, model: torch.nn.Module, step: int) -> None:
        """Called before optimizer step `step` (0-based), also for the first step after a
        resume; for changes that follow the step count (default: nothing)."""

    def loss(self, engine: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        out = engine(batch["input_ids"], labels=batch["labels"], doc_ids=batch["doc_ids"])
        return out.loss, {"loss": out.loss.item(), **{k: _item(out.losses.get(k)) for k in BASE_METRICS[1:]}}


def _item(t: torch.Tensor | None) -> float:
    return 0.0 if t is None else float(t.item())


OBJECTIVES: dict[str, Callable[..., Objective]] = {"lm": Objective}


def register(name: str) -> Callable[[type[Objective]], type[Objective]]:
    def deco(cls: type[Objective]) -> type[Objective]:
        OBJECTIVES[name] = cls
        return cls

    return deco


def build_objective(spec: dict[str, Any] | None) -> Objective:
    spec = dict(spec or {"name": "lm"})
    name = spec.pop("name", "lm")
    if name not in OBJECTIVES:
        raise ValueError(f"unknown training objective {name!r}; known: {sorted(OBJECTIVES)}")
    return OBJECTIVES[name](**spec)
