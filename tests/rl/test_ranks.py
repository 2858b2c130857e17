"""The RL update on DeepSpeed ranks (gloo, CPU) equals the one-process update on the whole batch.

For GRPO + IcePop, double-sided IS and on-policy distillation: 2 ranks at ZeRO 0 and ZeRO 2, and
4 ranks with expert parallelism 2, against rl.update on one rank with a torch AdamW. The batch
divides unevenly (9 samples, minibatches of 3: shares of 2 and 1 on 2 ranks, one rank with none
on 4), so the checks would see a per-rank normalisation or a dropped share; the 2-rank workers
also run those two faults and the test checks that they are seen. The 2-rank workers also
checkpoint on the ranks (ZeRO 0 and 2) and resume a fresh engine to the same next step."""
from __future__ import annotations

import copy
import os
import socket
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp

from domains import arithmetic
from rl.ranks import SINGLE, Ranks
from rl.sample import Sample
from rl.trainer import OptimConfig, build_optimizer
from rl.update import UpdateParams, assign_advantages, recompute_old_logprobs, update
from tests.rl.conftest import small_model

VOCAB, PAD, TOL = 64, 0, 1e-4
LOSSES = ("icepop", "double_sided_is", "opd")


def samples() -> list[Sample]:
    """3 groups of 3: random prompts and responses, rollout log-probs = the model's + noise (some
    tokens outside IcePop's band), a teacher's = the model's + other noise, rewards random."""
    g = torch.Generator().manual_seed(3)
    model = small_model(VOCAB)
    tasks = arithmetic.tasks(3, "train", seed=0)
    out = []
    for i in range(9):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        resp = torch.randint(1, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(tasks[i // 3], i // 3, prompt, resp, rollout_logprobs=[0.0] * len(resp),
                          versions=[0] * len(resp), loss_mask=[1] * len(resp),
                          reward=float(torch.rand((), generator=g) > 0.5)))
    recompute_old_logprobs(model, out, PAD, 1.0)
    for s in out:
        n = len(s.response_ids)
        s.rollout_logprobs = [t + 0.4 * float(e) for t, e in zip(s.train_logprobs, torch.randn(n, generator=g))]
        s.teacher_logprobs = [t + float(e) for t, e in zip(s.train_logprobs, torch.randn(n, generator=g))]
        s.train_logprobs = None
    assign_advantages(out, std_normalize=False)
    return out


def params(loss: str) -> UpdateParams:
    return UpdateParams(minibatches=3, epochs=1, policy_loss=loss, adv_clip=2.0 if loss == "opd" else None)


OPTIM = OptimConfig(lr=1e-2)


def one_rank(loss: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    model = small_model(VOCAB)
    stats = update(model, build_optimizer(model, OPTIM), copy.deepcopy(samples()), PAD, params(loss),
                   torch.Generator().manual_seed(0))
    return model.state_dict(), stats


def _on_ranks(loss: str, zero: int, ep: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    from model.moe import gathered_state_dict
    from rl.ranks import build_engine
    from training import expert_parallel

    model = small_model(VOCAB)
    shards = expert_parallel.setup(model, ep) if ep > 1 else None
    engine = build_engine(model, OPTIM, zero_stage=zero, expert_parallel=ep)
    ranks = Ranks.current(shards)
    stats = update(engine.module, engine, copy.deepcopy(samples()), PAD, params(loss),
                   torch.Generator().manual_seed(0), ranks)
    state = gathered_state_dict(engine.module) if shards else engine.module.state_dict()
    return state, stats


def _resume_gap(zero: int, root: str) -> float:
    """Three steps, a checkpoint on the ranks (rl.trainer.save: DeepSpeed's files, each rank's RNG),
    one more step; then a fresh engine resumed from the checkpoint takes the same step: the
    largest weight difference (0 when the optimizer state came back whole)."""
    from pathlib import Path

    from rl import trainer
    from rl.ranks import build_engine

    def policy():
        model = small_model(VOCAB)
        engine = build_engine(model, OPTIM, zero_stage=zero)
        ranks = Ranks.current()
        return trainer.Policy(model, engine, torch.Generator().manual_seed(0), ranks=ranks,
                              rank_rng=torch.Generator().manual_seed(ranks.rank))

    def step(p):
        update(p.model, p.optimizer, copy.deepcopy(samples()), PAD, params("icepop"), p.rng, p.ranks)

    ckpt = Path(root) / f"ckpt-zero{zero}"
    a = policy()
    step(a)
    trainer.save(ckpt, 1, a, {}, keep_last=2)
    step(a)
    b = policy()
    assert trainer.load_latest(ckpt, b, Path(root) / f"metrics-{zero}.jsonl", "test")[0] == 1
    step(b)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


def _gap(state, stats, ref_state, ref_stats) -> tuple[float, float]:
    w = max(float((state[k].float() - v.float()).abs().max()) for k, v in ref_state.items())
    return w, abs(stats["loss"] - ref_stats["loss"])


def _worker(rank: int, world: int, port: int, configs: list[tuple[int, int]], out: str) -> None:
    import deepspeed

    from training.loop import skip_shm_comm_op

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for loss in LOSSES:
        ref_state, ref_stats = one_rank(loss)
        for zero, ep in configs:
            state, stats = _on_ranks(loss, zero, ep)
            results[(loss, zero, ep)] = _gap(state, stats, ref_state, ref_stats) + (stats["optimizer_steps"],)
        if world != 2:
            continue
        # the faults the checks must see (2 ranks, ZeRO 0; shares of 2 and 1): a per-rank mean,
        # and rank 1's share dropped. (On 4 ranks the shares are 1, 1, 1 and none: a per-rank mean
        # only rescales the gradient there, which AdamW does not see.)
        real = Ranks.share

        def per_rank(self, items):
            mine, scale = real(self, items)
            return mine, float(scale > 0)

        def dropped(self, items):
            mine, scale = real(self, items)
            return mine, 0.0 if self.rank == 1 else scale

        for name, fault in (("per_rank", per_rank), ("dropped", dropped)):
            with mock.patch.object(Ranks, "share", fault):
                state, stats = _on_ranks(loss, 0, 1)
            results[(loss, name)] = _gap(state, stats, ref_state, ref_stats)
    if world == 2:
        for zero in (0, 2):
            results[("resume", zero)] = _resume_gap(zero, out)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    import torch.distributed as dist

    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world,configs", [(2, [(0, 1), (2, 1)]), (4, [(0, 2)])],
                         ids=["2-ranks-zero0-zero2", "4-ranks-ep2"])
def test_an_rl_step_on_ranks_equals_the_one_rank_step(world, configs, tmp_path):
    mp.start_processes(_worker, args=(world, _free_port(), configs, str(tmp_path)), nprocs=world,
                       start_method="fork")
    for r in range(world):
        res = torch.load(tmp_path / f"rank{r}.pt")
        for loss in LOSSES:
            for zero, ep in configs:
                w, l, steps = res[(loss, zero, ep)]
                assert steps == 3
                assert w < TOL and l < TOL, f"rank {r} {loss} zero {zero} ep {ep}: weights {w:.2e}, loss {l:.2e}"
            for fault in ("per_rank", "dropped") if world == 2 else ():
                w, l = res[(loss, fault)]
                assert w > 10 * TOL, f"rank {r} {loss}: the {fault} fault changed the weights by only {w:.2e}"
        for zero in (0, 2) if world == 2 else ():
            assert res[("resume", zero)] == 0.0, f"rank {r} zero {zero}: resumed step differs"


def test_shares_cover_a_minibatch_once_and_their_scaled_means_average_to_its_mean():
    losses = [0.3, -1.2, 2.0, 0.7, 5.1, -0.4, 1.1]        # per-sample losses of one minibatch
    for world in (1, 2, 3, 4, 8):
        shares = [Ranks(r, world).share(losses) for r in range(world)]
        assert [x for mine, scale in shares if scale > 0 for x in mine] == losses
        # DeepSpeed averages the ranks' gradients: the scaled share means average to the minibatch mean
        assert sum(s * sum(m) / len(m) for m, s in shares) / world == pytest.approx(sum(losses) / len(losses))
        assert all(s == 0.0 and len(m) == 1 for m, s in shares[len(losses):])
    assert SINGLE.share(losses) == (losses, 1.0)
