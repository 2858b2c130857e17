"""RankSpec: everything a training rank is told, typed.

A training stage builds one (training.drivers.rank_spec), writes it as JSON next to its
checkpoints, and starts the ranks on it; each rank validates it back into the same models
before it touches anything. Nothing crosses this boundary as an untyped dict, and nothing on
the rank side imports a stage module: the objective is a spec from training.objectives.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from model.config import ModelConfig
from training.config import TrainConfig
from training.objectives import LMSpec, ObjectiveSpec


class RankSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    train: TrainConfig            # the shared training fields only (not a stage's data sections)
    model: ModelConfig
    seed: int                     # run seed + the stage's seed_offset: model init and data order
    total_steps: int = Field(ge=1)
    data_dir: Path                # packed train/val splits (data_processing.packing)
    tokenizer_dir: Path
    checkpoint_dir: Path
    out_dir: Path
    init_weights: Path | None = None   # a previous stage's consolidated.safetensors
    resume: str | None = None          # checkpoint tag to continue from
    objective: ObjectiveSpec = LMSpec()
    # stop with a checkpoint after this many steps, without the held-out score and export (the
    # lr schedule stays total_steps'): the shared prefix of two runs that then branch (sft)
    stop_at: int | None = Field(None, ge=1)

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=1))

    @classmethod
    def read(cls, path: Path) -> "RankSpec":
        return cls.model_validate_json(Path(path).read_text())
