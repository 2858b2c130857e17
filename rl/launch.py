"""An RL stage on N trainer ranks: the stage's process starts them, each rank runs the stage.

Parent side (the stage's process, when the stage's `parallel.launch` names more than one rank):
`run_on_ranks(stage, cfg, inputs, workdir)` writes an RLRankSpec next to the checkpoints and
starts `python -m rl.launch SPEC` under torchrun or the DeepSpeed launcher (training.launch:
streaming, failures named by rank, SIGTERM passed to the ranks, Preempted after a checkpoint),
turns the ranks' protocol lines into progress and checkpoint persistence, and returns the result
rank 0 wrote.

Rank side: every rank runs the stage's `train(cfg, inputs, workdir, ranks)` (RANK_STAGES) with a
workdir whose progress and checkpoint hooks print those lines from rank 0. Each rank generates
and scores its share of the step's groups, the samples are gathered to every rank, and the
update runs data-parallel (rl.ranks); rank 0 evaluates, writes metrics and checkpoints' meta,
gates and exports.

    GLMFORGE_RL_PROGRESS {"step": k, "total": n, "message": ...}
    GLMFORGE_RL_CHECKPOINT {}
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from runtime import shutdown
from runtime.stage import Workdir, resolve
from training.config import LaunchConfig

log = logging.getLogger("glmforge")
PROGRESS, CHECKPOINT = "GLMFORGE_RL_PROGRESS", "GLMFORGE_RL_CHECKPOINT"
RESULT = "result-on-ranks.json"
# the stages that run on ranks: their train(cfg, inputs, workdir, ranks) and config type
RANK_STAGES = {"rl-reasoning": ("posttrain.rl_reasoning:train", "posttrain.rl_reasoning:RLReasoningConfig"),
               "rl-agentic": ("posttrain.rl_agentic:train", "posttrain.rl_agentic:RLAgenticConfig"),
               "reward-model": ("posttrain.reward_model:train", "posttrain.reward_model:RewardModelConfig"),
               "rl-general": ("posttrain.rl_general:train", "posttrain.rl_general:RLGeneralConfig"),
               "distill": ("posttrain.distill:train", "posttrain.distill:DistillConfig")}


class RLRankSpec(BaseModel):
    """What every rank of an RL stage is told (JSON next to the stage's checkpoints)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: str
    config: dict[str, Any]          # the stage's section, validated again on the rank
    inputs: dict[str, Path]
    out: Path
    checkpoint: Path
    seed: int | None
    backend: str = "auto"           # the launch's: auto (nccl on CUDA, gloo on CPU), gloo or nccl
    preempt_grace_s: float = Field(60.0, gt=0)

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=1))

    @classmethod
    def read(cls, path: Path) -> "RLRankSpec":
        return cls.model_validate_json(Path(path).read_text())


def run_on_ranks(stage: str, cfg: BaseModel, inputs: dict[str, Path], workdir: Workdir,
                 launch: LaunchConfig, preempt_grace_s: float = 60.0) -> dict[str, Any]:
    from rl.trainer import CHECKPOINTS, refuse_other_world
    from training.launch import run_ranks

    parallel = getattr(cfg, "parallel", None)
    refuse_other_world(workdir.checkpoint / CHECKPOINTS, launch.world_size, stage,     # before any rank starts
                       expert_parallel=parallel.expert_parallel if parallel is not None else None)
    result = workdir.checkpoint / RESULT
    result.unlink(missing_ok=True)
    spec = RLRankSpec(stage=stage, config=cfg.model_dump(mode="json"), inputs=inputs, out=workdir.out,
                      checkpoint=workdir.checkpoint, seed=workdir.seed, backend=launch.backend,
                      preempt_grace_s=preempt_grace_s)

    def on_line(line: str) -> None:
        if line.startswith(PROGRESS + " "):
            p = json.loads(line[len(PROGRESS) + 1:])
            workdir.progress(p["step"], p["total"], p["message"])
            log.info("%s: step %d/%d %s", stage, p["step"], p["total"], p["message"])
        elif line.startswith(CHECKPOINT + " "):
            workdir.persist_checkpoint()
        elif line.strip():
            log.info("%s: %s", stage, line)

    log.info("%s: the trainer on %d ranks", stage, launch.world_size)
    run_ranks(spec, launch, workdir.checkpoint / "rl-launch.json", on_line, module="rl.launch")
    return json.loads(result.read_text())


def _say(kind: str, payload: dict[str, Any]) -> None:
    print(f"{kind} {json.dumps(payload)}", flush=True)


def main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m rl.launch")
    p.add_argument("spec", type=Path)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    spec = RLRankSpec.read(args.spec)

    import deepspeed
    import torch
    import torch.distributed as dist

    from rl.ranks import Ranks
    from training.loop import skip_shm_comm_op

    cuda = torch.cuda.is_available()
    if not cuda:
        skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend=spec.backend if spec.backend != "auto" else ("nccl" if cuda else "gloo"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    ranks = Ranks.current()
    lead = ranks.rank == 0
    train_ref, config_ref = RANK_STAGES[spec.stage]
    cfg = resolve(config_ref).model_validate(spec.config)

    def progress(k: int, n: int, message: str) -> None:
        if lead:
            _say(PROGRESS, {"step": k, "total": n, "message": message})

    def persist_checkpoint() -> None:
        if lead:                   # the stage's process mirrors the checkpoint to the store
            _say(CHECKPOINT, {})

    workdir = Workdir(out=spec.out, checkpoint=spec.checkpoint, seed=spec.seed, progress=progress,
                      persist_checkpoint=persist_checkpoint)
    shutdown.install()
    try:
        result = resolve(train_ref)(cfg, spec.inputs, workdir, ranks)
        if lead:
            (spec.checkpoint / RESULT).write_text(json.dumps(result))
        dist.barrier()        # the others wait for rank 0's evaluation, gate and export
    except shutdown.Preempted as e:
        if lead:
            print(f"preempted: {str(e).split(': ', 1)[-1]}", flush=True)
        raise SystemExit(shutdown.EXIT_PREEMPTED)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    shutdown.leave_finished_rank()


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main(sys.argv[1:])
