"""What a training step optimises, as typed specs and the code that runs them on a rank.

Every training stage runs the same loop, checkpoints and launch (training.loop); what differs
between pretraining, DSA indexer training and SFT is the objective. A stage puts one of the
`ObjectiveSpec` models into its RankSpec; the rank turns it into an `Objective` through the
static table below. Objectives live next to their losses (the DSA ones in training.dsa_loss);
adding one means adding its spec to the union and its class to the table, never importing a
stage module on the rank.

An objective may change the model before the DeepSpeed engine is built (freeze all but the
indexer, wrap linears for QAT) and computes a micro-batch's loss. It reports floats under
"loss", "lm", "mtp" and "balance" (zero where they do not apply) so step logs, curves and stage
summaries read the same for every stage, plus any extra metrics of its own (e.g. "kl").
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import torch
from pydantic import BaseModel, ConfigDict, Field

from quant.qat import QATConfig, prepare_qat
from training.dsa_loss import IndexerWarmup, SparseAdaptation

BASE_METRICS = ("loss", "lm", "mtp", "balance")


# ---------------------------------------------------------------- specs (what a stage asks for)
class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LMSpec(_Spec):
    """Next-token LM + MTP + sequence-wise balance: pretraining and context extension."""

    name: Literal["lm"] = "lm"


class DsaWarmupSpec(_Spec):
    """KL of the indexer against dense attention; every other weight frozen."""

    name: Literal["dsa_warmup"] = "dsa_warmup"


class DsaSparseSpec(_Spec):
    """Top-k attention: LM for the trunk + coeff x KL on the selected set for the indexer."""

    name: Literal["dsa_sparse"] = "dsa_sparse"
    indexer_loss_coeff: float = Field(1.0, gt=0)


class SFTSpec(_Spec):
    """The LM loss on masked (assistant) labels, with INT4 fake quantization from a step on."""

    name: Literal["sft"] = "sft"
    qat: QATConfig | None = None
    qat_start_step: int = Field(0, ge=0)


ObjectiveSpec = Annotated[Union[LMSpec, DsaWarmupSpec, DsaSparseSpec, SFTSpec], Field(discriminator="name")]


# ---------------------------------------------------------------- objectives (run on a rank)
class Objective:
    """The model's own loss: next-token LM + MTP + sequence-wise balance (pretraining)."""

    def prepare(self, model: torch.nn.Module) -> None:
        """Change the model before the optimizer sees it (default: nothing)."""

    def begin_step(self, model: torch.nn.Module, step: int) -> None:
        """Called before optimizer step `step` (0-based), also for the first step after a
        resume; for changes that follow the step count (default: nothing)."""

    def loss(self, engine: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        out = engine(batch["input_ids"], labels=batch["labels"], doc_ids=batch["doc_ids"])
        return out.loss, {"loss": out.loss.item(), **{k: item(out.losses.get(k)) for k in BASE_METRICS[1:]}}


def item(t: torch.Tensor | None) -> float:
    return 0.0 if t is None else float(t.item())


class SFTObjective(Objective):
    """The LM + MTP (+ balance) loss on masked labels (the data masks all but assistant tokens),
    with the weights QATConfig selects fake-quantized from `qat_start_step` on."""

    def __init__(self, spec: SFTSpec):
        self.spec = spec
        self._qat_on = False

    def prepare(self, model: torch.nn.Module) -> None:
        self.begin_step(model, 0)

    def begin_step(self, model: torch.nn.Module, step: int) -> None:
        # Fake quantization swaps module classes and keeps the parameters, so turning it on
        # mid-run leaves the optimizer state valid; a resumed run turns it on at its first step.
        if self.spec.qat is not None and not self._qat_on and step >= self.spec.qat_start_step:
            prepare_qat(model, self.spec.qat)
            self._qat_on = True


def build_objective(spec: LMSpec | DsaWarmupSpec | DsaSparseSpec | SFTSpec) -> Objective:
    if isinstance(spec, LMSpec):
        return Objective()
    if isinstance(spec, DsaWarmupSpec):
        return IndexerWarmup()
    if isinstance(spec, DsaSparseSpec):
        return SparseAdaptation(spec.indexer_loss_coeff)
    if isinstance(spec, SFTSpec):
        return SFTObjective(spec)
    raise TypeError(f"no objective for {type(spec).__name__}")
