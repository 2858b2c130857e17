"""Checkpoints move between rank counts: a run written on 2 CPU ranks (gloo) resumes on 1 and on
4 ranks with the same global batch, and its next steps' losses match the uninterrupted 2-rank
run within float tolerance (the per-rank reductions are summed in another order).

ZeRO 2 (AdamW; converted with DeepSpeed's ds_to_universal and loaded as a universal checkpoint,
which cuts the optimizer partitions for the new rank count) and ZeRO 0 (Muon Split, the whole
state on rank 0) are both covered; a changed global batch is refused."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from runtime.stage import Workdir
from tests.training.conftest import MODEL_OVERRIDES
from training import checkpoint, metrics
from training.config import PretrainConfig
from training.launch import TrainingFailed
from training.drivers import run_pretrain

STEPS, AT = 4, 2     # reference runs 4 steps, checkpoints at 2 and 4; resumes start from step 2


def config(ranks: int, micro: int, accum: int, **kw) -> PretrainConfig:
    base = dict(model_overrides=MODEL_OVERRIDES, micro_batch_size=micro, grad_accum=accum, max_steps=STEPS,
                checkpoint_every=AT, keep_last=5, lr=0.02, eval_sequences=8, launch={"nproc_per_node": ranks})
    return PretrainConfig(**{**base, **kw})


def losses(wd: Workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics.read(wd.checkpoint / "metrics.jsonl")}


def resume_from(ref: Workdir, root: Path) -> Workdir:
    """A fresh workdir holding the reference's step-AT checkpoint (and its first AT logged steps)."""
    wd = Workdir.at(root, seed=7)
    wd.persist_checkpoint = lambda: None
    wd.checkpoint.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ref.checkpoint / checkpoint.tag_for(AT), wd.checkpoint / checkpoint.tag_for(AT))
    (wd.checkpoint / checkpoint.LATEST).write_text(checkpoint.tag_for(AT))
    shutil.copy(ref.checkpoint / "metrics.jsonl", wd.checkpoint / "metrics.jsonl")
    return wd


def reference_run(packed, root: Path, **kw) -> Workdir:
    wd = Workdir.at(root, seed=7)
    wd.persist_checkpoint = lambda: None
    run_pretrain(config(2, 4, 1, **kw), packed, wd)
    assert checkpoint.select_resume(wd.checkpoint)[1]["world_size"] == 2
    return wd


@pytest.fixture(scope="module")
def zero2(packed, tmp_path_factory):
    return reference_run(packed, tmp_path_factory.mktemp("zero2"), optimizer="adamw", zero_stage=2)


@pytest.mark.parametrize("ranks,micro,accum", [(1, 4, 2), (4, 2, 1)])
def test_zero2_checkpoint_from_2_ranks_resumes_on_other_counts(zero2, packed, tmp_path, ranks, micro, accum):
    wd = resume_from(zero2, tmp_path)
    result = run_pretrain(config(ranks, micro, accum, optimizer="adamw", zero_stage=2), packed, wd)
    assert result["resumed_from_step"] == AT and result["world_size"] == ranks
    ref, got = losses(zero2), losses(wd)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(AT + 1, STEPS + 1):
        assert got[step] == pytest.approx(ref[step], rel=1e-4, abs=1e-5), f"step {step}"
    # not vacuous: the resumed steps moved away from where the checkpoint stood
    assert got[STEPS] != pytest.approx(ref[AT], rel=1e-3)


def test_zero0_muon_checkpoint_from_2_ranks_resumes_on_1(packed, tmp_path):
    ref = reference_run(packed, tmp_path / "ref", optimizer="muon_split", zero_stage=0)
    wd = resume_from(ref, tmp_path / "one")
    run_pretrain(config(1, 4, 2, optimizer="muon_split", zero_stage=0), packed, wd)
    a, b = losses(ref), losses(wd)
    for step in range(AT + 1, STEPS + 1):
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-5), f"step {step}"


def test_changed_global_batch_is_refused_naming_the_fix(zero2, packed, tmp_path):
    wd = resume_from(zero2, tmp_path)
    with pytest.raises(TrainingFailed, match=r"global batch was 4 \(micro_batch_size\) x 1 \(grad_accum\) x 2 "
                                             r"ranks = 8 sequences.*grad_accum 2"):
        run_pretrain(config(1, 4, 1, optimizer="adamw", zero_stage=2), packed, wd)


def test_reshard_unit_rules():
    meta = {"world_size": 2, "step": 6, "loader": {"epoch": 1, "index": 12, "seed": 3, "world": 2},
            "rng": ["r0", "r1"], "train": {"zero_stage": 2, "micro_batch_size": 4, "grad_accum": 1,
                                           "optimizer": "deepspeed_muon"}}
    with pytest.raises(ValueError, match="not Muon's momentum_buffer"):
        checkpoint.reshard(meta, meta["train"], 4)
    assert checkpoint.reshard(meta, meta["train"], 2) == (meta["loader"], meta["rng"])   # same count: as saved
    meta["train"]["optimizer"] = "adamw"
    loader, rngs = checkpoint.reshard(meta, {"zero_stage": 2, "micro_batch_size": 2, "grad_accum": 1}, 4)
    assert loader == {"epoch": 1, "index": 6, "seed": 3, "world": 4} and rngs == ["r0", "r1", "r0", "r1"]
    loader, rngs = checkpoint.reshard(meta, {"zero_stage": 2, "micro_batch_size": 4, "grad_accum": 2}, 1)
    assert loader["index"] == 24 and rngs == ["r0"]
    with pytest.raises(ValueError, match="change rank count or ZeRO stage, not both"):
        checkpoint.reshard(meta, {"zero_stage": 1, "micro_batch_size": 4, "grad_accum": 2}, 1)
    meta["loader"]["index"] = 3        # 6 sequences consumed cannot be dealt to 4 ranks
    with pytest.raises(ValueError, match="not divisible by 4 ranks"):
        checkpoint.reshard(meta, {"zero_stage": 2, "micro_batch_size": 2, "grad_accum": 1}, 4)
