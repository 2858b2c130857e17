"""Expert parallelism on 2 and 4 CPU ranks (gloo): the tiny GLM model with its experts sharded
and tokens dispatched by all-to-all trains like one rank on the whole batch, and resumes exactly."""
from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from model.config import preset
from model.model import GLMModel
from model.moe import MoE, update_router_bias

BATCH, SEQ, STEPS, GAMMA = 4, 16, 3, 1e-2


def config():
    """The tiny preset cut down further (2 MoE layers, small vocab, 1 MTP layer): 4 ranks
    share 2 cores here."""
    return preset("tiny").model_copy(update={"vocab_size": 512, "num_layers": 2, "first_k_dense": 0, "mtp_depth": 1})


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config().vocab_size, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def make_model() -> GLMModel:
    torch.manual_seed(0)
    return GLMModel(config()).train()


def train(model, x, y, steps, sync=None, opt=None):
    """AdamW steps with the aux-loss-free bias update; returns losses and first-step grads."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], None
    for _ in range(steps):
        opt.zero_grad()
        out = model(x, labels=y)
        out.loss.backward()
        if sync:
            sync(model)
        losses.append(out.loss.detach())
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        update_router_bias(model, GAMMA)
    return losses, grads, opt


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from model.moe import shard_experts, sync_ep_gradients

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, y = batch()
    per = BATCH // world
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]

    model = make_model()
    shard_experts(model)
    losses, grads, opt = train(model, x, y, STEPS - 1, sync=sync_ep_gradients)
    state = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})  # what a checkpoint holds
    last, _, _ = train(model, x, y, 1, sync=sync_ep_gradients, opt=opt)
    # resume: a fresh sharded model and optimiser from this rank's saved state
    resumed = make_model()
    shard_experts(resumed)
    resumed.load_state_dict(state["model"])
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    opt2.load_state_dict(state["opt"])
    again, _, _ = train(resumed, x, y, 1, sync=sync_ep_gradients, opt=opt2)

    all_losses = torch.stack(losses + last + again)
    dist.all_reduce(all_losses)  # ranks' mean losses, averaged: the whole batch's loss
    bias = [m.gate.e_score_correction_bias.clone() for m in model.modules() if isinstance(m, MoE)]
    torch.save({"losses": all_losses / world, "grads": grads, "bias": bias}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference():
    x, y = batch()
    model = make_model()
    assert any(isinstance(m, MoE) for m in model.modules())
    losses, grads, _ = train(model, x, y, STEPS)
    bias = [m.gate.e_score_correction_bias.clone() for m in model.modules() if isinstance(m, MoE)]
    return torch.stack(losses), grads, bias


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_one_rank_and_resumes_exactly(world, reference, tmp_path):
    ref_losses, ref_grads, ref_bias = reference
    # fork: the ranks start with torch and the model code already imported (spawn re-imports
    # them, most of this test's time on a loaded 2-core machine)
    mp.start_processes(_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    losses = ranks[0]["losses"]
    # steps 1..3 equal the single-rank run, and the resumed step 3 equals the uninterrupted one bit for bit
    torch.testing.assert_close(losses[:STEPS], ref_losses, rtol=1e-5, atol=1e-6)
    assert torch.equal(losses[STEPS], losses[STEPS - 1])
    # gradients of step 1: replicated weights on every rank; each rank's expert slice
    n_exp = config().n_routed_experts // world
    for r, res in enumerate(ranks):
        assert res["grads"].keys() == ref_grads.keys()
        for name, g in res["grads"].items():
            want = ref_grads[name]
            if ".experts." in name:
                assert g.shape[0] == n_exp, name  # sharded: this rank holds E/world experts
                want = want[r * n_exp : (r + 1) * n_exp]
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=f"rank {r} {name}")
        # loads summed over the group: every rank moved the router bias like the single rank
        for b, rb in zip(res["bias"], ref_bias):
            torch.testing.assert_close(b, rb)


def test_shard_experts_rejects_an_indivisible_group():
    from unittest import mock

    from model.moe import shard_experts

    moe = MoE(preset("tiny").model_copy(update={"n_routed_experts": 7}))
    with mock.patch("torch.distributed.get_world_size", return_value=2), \
         mock.patch("torch.distributed.get_rank", return_value=0), \
         pytest.raises(ValueError, match="n_routed_experts=7 is not divisible by the expert-parallel size 2"):
        shard_experts(moe)
