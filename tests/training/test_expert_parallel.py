"""Expert parallelism inside the DeepSpeed loop (training.expert_parallel): the pretrain stage on 2
gloo ranks with expert_parallel 2 (each rank holds 2 of the 4 experts, tokens dispatched by
all-to-all) logs the losses, gradient norms and expert loads of the same run with every expert on
every rank, within float tolerance, and so do 4 ranks in two expert-parallel groups; its
checkpoint resumes bit-exactly on 2 ranks; its export is the full model. All of it at ZeRO 0
(Muon Split; the loop reduces and clips) and at ZeRO 2 with AdamW (DeepSpeed's ZeRO optimizer
partitions and reduces the experts over their expert-data-parallel group), plus ZeRO 1 and
DeepSpeed's Muon at ZeRO 2 against expert_parallel 1. Runs and checkpoint copies are
test_reshard's (4 steps, checkpoints at 2 and 4)."""
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
from training.drivers import run_pretrain

LOGGED = ("loss", "lm", "mtp", "balance", "grad_norm", "expert_load_max_mean")
CLIP = 0.5   # below the first steps' gradient norms: clipping (over every rank's experts) acts
E = MODEL_OVERRIDES["n_routed_experts"]


@pytest.fixture(scope="module")
def replicated(packed, tmp_path_factory):
    return reference_run(packed, tmp_path_factory.mktemp("ep1"), grad_clip=CLIP)       # Muon Split, ZeRO 0


@pytest.fixture(scope="module")
def sharded(packed, tmp_path_factory):
    return reference_run(packed, tmp_path_factory.mktemp("ep2"), grad_clip=CLIP, expert_parallel=2)


ZERO2 = dict(optimizer="adamw", zero_stage=2, grad_clip=CLIP)


@pytest.fixture(scope="module")
def zero2_replicated(packed, tmp_path_factory):
    return reference_run(packed, tmp_path_factory.mktemp("z2ep1"), **ZERO2)


@pytest.fixture(scope="module")
def zero2_sharded(packed, tmp_path_factory):
    return reference_run(packed, tmp_path_factory.mktemp("z2ep2"), **ZERO2, expert_parallel=2)


def assert_trains_alike(want_wd, got_wd, logged=LOGGED, rel=1e-4) -> None:
    """got_wd logged want_wd's steps and metrics within `rel`, and the same held-out loss."""
    want, got = metrics.read(want_wd.checkpoint / "metrics.jsonl"), metrics.read(got_wd.checkpoint / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b in zip(want, got):
        for k in logged:
            assert b[k] == pytest.approx(a[k], rel=rel, abs=1e-6), f"step {a['step']} {k}"
    assert want[-1]["loss"] < want[0]["loss"] - 0.1                         # it trained: not vacuous
    ev_want, ev_got = (json.loads((wd.out / "eval.json").read_text()) for wd in (want_wd, got_wd))
    assert ev_got["val_loss_after"] == pytest.approx(ev_want["val_loss_after"], rel=1e-4)


def zero_partitions(wd, rank: int) -> dict:
    """Rank `rank`'s ZeRO optimizer partitions in the last checkpoint (DeepSpeed's file)."""
    path = wd.checkpoint / checkpoint.tag_for(STEPS) / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    return torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]


def test_expert_parallel_2_trains_like_every_expert_on_every_rank(replicated, sharded):
    assert_trains_alike(replicated, sharded)
    assert max(r["grad_norm"] for r in metrics.read(replicated.checkpoint / "metrics.jsonl")) > CLIP
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
    from runtime.stage import Workdir

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


def test_zero2_expert_parallel_2_trains_like_every_expert_on_every_rank(zero2_replicated, zero2_sharded):
    """ZeRO 2 + AdamW: DeepSpeed reduces (experts over their expert-data-parallel group, here each
    rank alone, divided by the world size) and clips on its norm, which takes every shard once."""
    assert_trains_alike(zero2_replicated, zero2_sharded)
    assert max(r["grad_norm"] for r in metrics.read(zero2_replicated.checkpoint / "metrics.jsonl")) > CLIP
    for rank in range(2):
        # the experts are an optimizer group of their own, partitioned over 1 rank (the expert-data-
        # parallel group), the replicated weights' groups over both
        part = zero_partitions(zero2_sharded, rank)
        groups = part["base_optimizer_state"]["param_groups"]
        assert [(g.get("name"), g.get("moe", False)) for g in groups] == \
            [("decay", False), ("no_decay", False), ("ep_size_2", True)]
        assert part["partition_count"] == [2, 2, 1]
        assert part["single_partition_of_fp32_groups"][2].numel() == \
            sum(t.numel() for t in torch.load(zero2_sharded.checkpoint / checkpoint.tag_for(STEPS) /
                                              SHARD_FILE.format(rank), weights_only=True)["params"].values())
    # the shard files hold the experts' weights; their optimizer state is in the ZeRO partitions
    shard = torch.load(zero2_sharded.checkpoint / checkpoint.tag_for(STEPS) / SHARD_FILE.format(1), weights_only=True)
    assert (shard["ep_rank"], shard["ep_size"]) == (1, 2) and "optimizer" not in shard
    assert all(t.shape[0] == E // 2 for t in shard["params"].values())


def test_zero1_expert_parallel_2_trains_like_expert_parallel_1(zero2_replicated, packed, tmp_path):
    """Against ZeRO 2's expert_parallel 1 run: ZeRO 1 partitions the optimizer state only, so the
    two stages take the same steps (and one baseline run serves both)."""
    got = reference_run(packed, tmp_path / "ep2", **{**ZERO2, "zero_stage": 1}, expert_parallel=2)
    assert_trains_alike(zero2_replicated, got)
    assert zero_partitions(got, 1)["partition_count"] == [2, 2, 1]


def test_zero2_two_expert_parallel_groups_on_4_ranks_train_alike(zero2_replicated, packed, tmp_path):
    """4 ranks, expert_parallel 2 at ZeRO 2: each shard's optimizer state partitioned over its
    expert-data-parallel group {0,2} or {1,3}, its gradient reduce-scattered there."""
    from runtime.stage import Workdir

    wd = Workdir.at(tmp_path, seed=7)
    wd.persist_checkpoint = lambda: None
    run_pretrain(config(4, 1, 2, **ZERO2, expert_parallel=2, checkpoint_every=STEPS, eval_sequences=5), packed, wd)
    want, got = metrics.read(zero2_replicated.checkpoint / "metrics.jsonl"), metrics.read(wd.checkpoint / "metrics.jsonl")
    for a, b in zip(want, got, strict=True):
        for k in LOGGED:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), f"step {a['step']} {k}"
    assert zero_partitions(wd, 3)["partition_count"] == [4, 4, 2]


def test_deepspeed_muon_zero2_expert_parallel_2_trains_like_expert_parallel_1(packed, tmp_path):
    """DeepSpeed's Muon (the glm5 preset's optimizer) at ZeRO 2: each expert orthogonalised on its
    own either way. Its Newton-Schulz runs in bf16, so the logged norm (of the orthogonalised
    update) and the expert loads drift by more than the losses do."""
    muon = dict(optimizer="deepspeed_muon", zero_stage=2, grad_clip=0)
    want = reference_run(packed, tmp_path / "ep1", **muon)
    got = reference_run(packed, tmp_path / "ep2", **muon, expert_parallel=2)
    assert_trains_alike(want, got, logged=("loss", "lm", "mtp"))
    assert_trains_alike(want, got, logged=("grad_norm", "balance", "expert_load_max_mean"), rel=1e-2)
    assert zero_partitions(got, 0)["partition_count"][-1] == 1


@pytest.mark.parametrize("runs", [("replicated", "sharded"), ("zero2_replicated", "zero2_sharded")],
                         ids=["zero0", "zero2"])
def test_export_holds_every_expert_and_loads_as_the_full_model(runs, request):
    replicated, sharded = (request.getfixturevalue(name) for name in runs)
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


@pytest.mark.parametrize("run,kw", [("sharded", {}), ("zero2_sharded", ZERO2)], ids=["zero0", "zero2"])
def test_expert_parallel_checkpoint_resumes_exactly_on_the_same_ranks(run, kw, packed, tmp_path, request):
    sharded = request.getfixturevalue(run)
    wd = resume_from(sharded, tmp_path)
    result = run_pretrain(config(2, 4, 1, **{"grad_clip": CLIP, **kw}, expert_parallel=2), packed, wd)
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
    with pytest.raises(ValueError, match=r"\(expert_parallel 2\) is ZeRO 0, this run zero_stage 2: .*expert-shard "
                                         r"files; resume with zero_stage 0"):
        checkpoint.reshard(meta, {**train, "zero_stage": 2, "optimizer": "adamw"}, 2)
    with pytest.raises(ValueError, match="is ZeRO 2, this run zero_stage 1: .*ZeRO partition files"):
        checkpoint.reshard({**meta, "train": {**train, "zero_stage": 2}}, {**train, "zero_stage": 1}, 2)
