"""Expert parallelism inside the DeepSpeed loop (training.expert_parallel): the pretrain stage on 2
gloo ranks with expert_parallel 2 (each rank holds 2 of the 4 experts, tokens dispatched by
all-to-all) logs the losses, gradient norms and expert loads of the same run with every expert on
every rank, within float tolerance, and so do 4 ranks in two expert-parallel groups; its
checkpoint resumes bit-exactly on 2 ranks; its export is the full model. Runs and checkpoint copies are test_reshard's (4 steps, checkpoints at 2 and 4)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from model.hf import STATE_FILE, load_state
from model.moe import MoE
from tests.training.conftest import MODEL_OVERRIDES
from tests.training.test_reshard import AT, STEPS, config, losses, reference_run, resume_from
from training import checkpoint, metrics
from training.expert_parallel import SHARD_FILE
from training.stages import run_pretrain

LOGGED = ("loss", "lm", "mtp", "balance", "grad_norm", "expert_load_max_mean")
CLIP = 0.5   # below the first steps' gradient norms: clipping (over every rank's experts) acts
E = MODEL_OVERRIDES["n_routed_experts"]


@pytest.fixture(scope="module")
def replicated(packed, tmp_path_factory):
    return reference_run(packed, tmp_path_factory.mktemp("ep1"), grad_clip=CLIP)       # Muon Split, ZeRO 0


@pytest.fixture(scope="module")
def sharded(packed, tmp_path_factory):
    return reference_run(packed, tmp_path_factory.mktemp("ep2"), grad_clip=CLIP, expert_parallel=2)


def test_expert_parallel_2_trains_like_every_expert_on_every_rank(replicated, sharded):
    want, got = metrics.read(replicated.checkpoint / "metrics.jsonl"), metrics.read(sharded.checkpoint / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(want, got):
        for k in LOGGED:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), f"step {a['step']} {k}"
    assert want[-1]["loss"] < want[0]["loss"] - 0.1                         # it trained: not vacuous
    assert max(r["grad_norm"] for r in want) > CLIP
    ev_want, ev_got = (json.loads((wd.out / "eval.json").read_text()) for wd in (replicated, sharded))
    assert ev_got["val_loss_after"] == pytest.approx(ev_want["val_loss_after"], rel=1e-4)
    # the checkpoint holds both shards, each with its experts' optimizer state
    tag = sharded.checkpoint / checkpoint.tag_for(STEPS)
    for k in range(2):
        shard = torch.load(tag / SHARD_FILE.format(k), weights_only=True)
        assert (shard["ep_rank"], shard["ep_size"]) == (k, 2)
        assert {n.rsplit(".", 1)[-1] for n in shard["params"]} == {"gate_up_proj", "down_proj"}
        assert all(t.shape[0] == E // 2 for t in shard["params"].values())
        assert all(shard["optimizer"][n] for n in shard["params"])


def test_two_expert_parallel_groups_on_4_ranks_train_alike(replicated, packed, tmp_path):
    """4 ranks, expert_parallel 2: EP groups {0,1} {2,3}, each shard's gradient summed over its
    expert-data-parallel group {0,2} or {1,3}; the same global batch as 2 ranks x 4 sequences, here
    4 ranks x 2 micro-batches of 1 (gradients accumulated before the reduction). 5 held-out
    sequences: rank 0 scores 2, rank 1 one, and makes an unscored forward to keep in step."""
    from glmforge.stage import Workdir

    wd = Workdir.at(tmp_path, seed=7)
    result = run_pretrain(config(4, 1, 2, grad_clip=CLIP, expert_parallel=2, checkpoint_every=STEPS,
                                 eval_sequences=5), packed, wd)
    assert result["val_loss_after"] < result["val_loss_before"]
    want, got = metrics.read(replicated.checkpoint / "metrics.jsonl"), metrics.read(wd.checkpoint / "metrics.jsonl")
    for a, b in zip(want, got, strict=True):
        for k in LOGGED:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), f"step {a['step']} {k}"
    assert sorted(p.name for p in (wd.checkpoint / checkpoint.tag_for(STEPS)).glob("expert_shard_*")) == \
        [SHARD_FILE.format(0), SHARD_FILE.format(1)]                         # one file per shard


def test_export_holds_every_expert_and_loads_as_the_full_model(replicated, sharded):
    want, got = load_file(replicated.out / STATE_FILE), load_file(sharded.out / STATE_FILE)
    assert got.keys() == want.keys()
    experts = [k for k in want if ".experts.gate_up_proj" in k or ".experts.down_proj" in k]
    assert experts and all(want[k].shape[0] == E for k in experts)
    for k in want:
        assert got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], rtol=1e-3, atol=1e-4, msg=k)
    model = load_state(sharded.out / STATE_FILE)
    assert all(m.ep_group is None and m.experts.gate_up_proj.shape[0] == E
               for m in model.modules() if isinstance(m, MoE))
    assert (sharded.out / "hf" / "model.safetensors").is_file()


def test_expert_parallel_checkpoint_resumes_exactly_on_the_same_ranks(sharded, packed, tmp_path):
    wd = resume_from(sharded, tmp_path)
    result = run_pretrain(config(2, 4, 1, grad_clip=CLIP, expert_parallel=2), packed, wd)
    assert result["resumed_from_step"] == AT and result["expert_parallel"] == 2
    want, got = metrics.read(sharded.checkpoint / "metrics.jsonl"), metrics.read(wd.checkpoint / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(want, got):
        assert {k: a[k] for k in ("tokens", "lr", *LOGGED)} == {k: b[k] for k in ("tokens", "lr", *LOGGED)}, a["step"]
    assert losses(wd)[STEPS] != losses(wd)[AT]
    w_want, w_got = load_file(sharded.out / STATE_FILE), load_file(wd.out / STATE_FILE)
    assert w_want.keys() == w_got.keys() and all(torch.equal(w_want[k], w_got[k]) for k in w_want)


def test_expert_parallel_checkpoint_needs_the_same_expert_parallel_and_rank_count():
    train = {"zero_stage": 0, "micro_batch_size": 4, "grad_accum": 1, "optimizer": "muon_split", "expert_parallel": 2}
    meta = {"world_size": 2, "step": 2, "loader": {"epoch": 0, "index": 8, "seed": 7, "world": 2},
            "rng": ["r0", "r1"], "train": train}
    assert checkpoint.reshard(meta, train, 2) == (meta["loader"], meta["rng"])
    with pytest.raises(ValueError, match="written by 2 ranks: an expert-parallel checkpoint resumes only on "
                                         "the same number of ranks, not 4"):
        checkpoint.reshard(meta, {**train, "micro_batch_size": 2}, 4)
    with pytest.raises(ValueError, match="written with expert_parallel 2, this run has 1.*resume with "
                                         "expert_parallel 2"):
        checkpoint.reshard(meta, {**train, "expert_parallel": 1}, 2)
    with pytest.raises(ValueError, match="written with expert_parallel 1, this run has 2"):
        checkpoint.reshard({**meta, "train": {**train, "expert_parallel": 1}}, train, 2)
