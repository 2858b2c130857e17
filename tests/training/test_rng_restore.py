"""RNG restore on resume. The LM objective draws no random numbers, so step-exact resume tests
pass even with training.checkpoint.set_rng_state doing nothing. Here an objective that draws
from every RNG a checkpoint saves (torch, numpy, Python) scales the loss by those draws: a
resumed run reproduces the uninterrupted one only when all three streams are restored.

The objective is not one a stage can ask for (the rank builds only training.objectives'
table), so the rank loop runs in this process, one rank, with the objective passed in."""
from __future__ import annotations

import multiprocessing
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from runtime.stage import Workdir
from tests.training.conftest import MODEL_OVERRIDES, SEQ_LEN
from training import checkpoint, metrics
from training.config import PretrainConfig
from tests.conftest import free_port
from training import loop
from training.objectives import LMSpec, Objective
from training.rank_spec import RankSpec
from training.drivers import model_config_for, publish, rank_spec
from data_processing.tokenizer import load_tokenizer

STEPS, EVERY = 4, 2


class RngNoise(Objective):
    """The LM loss times 1 + 0.05 * (a torch, a numpy and a Python draw): every step's loss,
    gradients and weights depend on the state of all three generators."""

    def loss(self, engine, batch):
        loss, parts = super().loss(engine, batch)
        draws = float(torch.rand(())) + float(np.random.rand()) + random.random()
        loss = loss * (1.0 + 0.05 * draws)
        return loss, {**parts, "loss": loss.item()}


def test_rng_state_round_trip_restores_every_generator():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    saved = checkpoint.rng_state()
    want = (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)])
    random.seed(2), np.random.seed(2), torch.manual_seed(2)   # what a fresh rank process does
    checkpoint.set_rng_state(saved)
    got = (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)])
    assert got[0] == want[0], "torch RNG not restored"
    assert got[1] == want[1], "numpy RNG not restored"
    assert got[2] == want[2], "python RNG not restored"


def _rank(spec_json: str) -> None:
    import os

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())})
    torch.set_num_threads(1)
    loop.train(RankSpec.model_validate_json(spec_json), objective=RngNoise())


def _train(packed: dict[str, Path], wd: Workdir) -> dict:
    cfg = PretrainConfig(model_overrides=MODEL_OVERRIDES, micro_batch_size=4, max_steps=STEPS,
                         checkpoint_every=EVERY, keep_last=2, lr=0.02, warmup_steps=1, eval_sequences=4,
                         launch={"nproc_per_node": 1})
    model_cfg = model_config_for(cfg, load_tokenizer(packed["tokenize"]).get_vocab_size())
    resume = checkpoint.select_resume(wd.checkpoint)
    if resume:   # as train_stage: the steps after the checkpoint are logged again
        metrics.truncate(wd.checkpoint / "metrics.jsonl", resume[1]["step"])
    spec = rank_spec(cfg, model_cfg, wd, STEPS, packed["pack"], packed["tokenize"], None,
                     resume[0] if resume else None, LMSpec())
    # a process of its own, as a rank: a process group cannot be set up twice in one process
    proc = multiprocessing.get_context("spawn").Process(target=_rank, args=(spec.model_dump_json(),))
    proc.start()
    proc.join(timeout=300)
    assert proc.exitcode == 0, f"rank exited with {proc.exitcode}"
    return publish("pretrain", wd, model_cfg, cfg, SEQ_LEN, resume)


def test_resumed_training_draws_the_same_random_numbers(packed, tmp_path):
    ref = Workdir.at(tmp_path / "ref", seed=7)
    ref_result = _train(packed, ref)
    assert [r["step"] for r in metrics.read(ref.checkpoint / "metrics.jsonl")] == list(range(1, STEPS + 1))

    # The same run stopped after its first checkpoint: its checkpoint folder minus the newest one.
    resumed = Workdir.at(tmp_path / "resumed", seed=7)
    shutil.rmtree(resumed.checkpoint)
    shutil.copytree(ref.checkpoint, resumed.checkpoint)
    shutil.rmtree(resumed.checkpoint / checkpoint.tag_for(STEPS))
    result = _train(packed, resumed)
    assert result["resumed_from_step"] == EVERY

    want, got = metrics.read(ref.checkpoint / "metrics.jsonl"), metrics.read(resumed.checkpoint / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(want[EVERY:], got[EVERY:]):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), f"step {a['step']} differs after resume"
    assert result["val_loss_after"] == ref_result["val_loss_after"]
    w_ref = load_file(ref.out / "consolidated.safetensors")
    w_got = load_file(resumed.out / "consolidated.safetensors")
    assert all(torch.equal(w_ref[k], w_got[k]) for k in w_ref)


def test_noise_objective_makes_the_loss_depend_on_the_rng():
    """The check above is only meaningful if the draws move the loss."""
    class Out:
        loss = torch.tensor(2.0)
        losses = {}

    obj = RngNoise()
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    a = obj.loss(lambda *a, **k: Out(), {"input_ids": None, "labels": None, "doc_ids": None})[0]
    b = obj.loss(lambda *a, **k: Out(), {"input_ids": None, "labels": None, "doc_ids": None})[0]
    assert a != b and float(a) > 2.0


def test_seed_everything_turns_on_deterministic_algorithms_without_importing_inductor():
    """What torch.use_deterministic_algorithms(True, warn_only=True) sets, without its import of
    torch._inductor (2 s of every rank's start-up); checked in a fresh interpreter."""
    import subprocess
    import sys

    code = ("import sys, torch; from training.loop import seed_everything; seed_everything(3, True); "
            "print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(), "
            "'torch._inductor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["True", "True", "False"]
