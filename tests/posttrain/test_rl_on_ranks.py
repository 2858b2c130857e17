"""rl-reasoning with its trainer on 2 gloo ranks (rl.launch under torchrun): the stage's result
and artifact, kill -9 of a rank then resume bit-identical to the uninterrupted 2-rank run; a
checkpoint of another rank count is refused by name. SIGTERM on ranks (every rank checkpoints
and stops, the resume is bit-identical) is the distillation test's: the same trainer.

The random model here earns no reward, so its policy gradient is zero: weight decay moves the
weights every step instead (the rollouts, and so the metrics, depend on them). That the update on
ranks equals the one-rank update, and that its optimizer state survives a checkpoint on ranks, is
tests/rl/test_ranks.py's."""
from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from runtime import shutdown
from runtime.stage import Workdir
from posttrain.rl_reasoning import run_rl_reasoning
from tests._processes import descendants_running
from tests.posttrain.test_rl_reasoning import _cfg, inputs  # noqa: F401 (fixture)
from training import checkpoint
from training.launch import TrainingFailed

RANKS = {"launch": {"nproc_per_node": 2}}


def _cfg2(**kw):
    return _cfg(parallel=RANKS, prompts_per_step=3, optim={"lr": 1e-2, "weight_decay": 0.5}, **kw)


def _weights(root):
    return load_file(root / "out" / "consolidated.safetensors")


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rank_pids() -> list[int]:
    return descendants_running(b"rl.launch")


@pytest.fixture(scope="module")
def clean(inputs, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("clean2")
    result = run_rl_reasoning(_cfg2(), inputs, Workdir.at(root, seed=3))
    return root, result


def test_the_stage_trains_on_two_ranks_and_publishes(inputs, clean):  # noqa: F811
    root, m = clean
    assert m["trainer_ranks"] == 2 and m["steps"] == 3
    recs = [json.loads(x) for x in (root / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    # all 3 prompts x 4 samples of a step are trained, gathered from both ranks' shares
    assert all(r["trainer_ranks"] == 2 and r["optimizer_steps"] == 2 for r in recs)
    assert all("mismatch/k3" in r and r["mismatch/abs_logp"] > 0 for r in recs)   # fake-INT4 rollouts
    assert m["mismatch"]["k3"]["first"] >= 0
    assert not _same(load_file(inputs["sft"] / "consolidated.safetensors"), _weights(root))
    meta = checkpoint.select_resume(root / "checkpoint" / "ckpt")[1]
    assert meta["world_size"] == 2 and meta["step"] == 3


def test_kill_9_of_a_rank_then_resume_is_bit_identical(inputs, clean, tmp_path):  # noqa: F811
    def kill_rank_1_after_step_2(done, total, desc):
        if done == 2:
            pids = _rank_pids()
            assert len(pids) == 2, pids
            os.kill(pids[1], signal.SIGKILL)

    with pytest.raises(TrainingFailed, match="failed"):
        run_rl_reasoning(_cfg2(), inputs, Workdir.at(tmp_path, seed=3, progress=kill_rank_1_after_step_2))
    assert checkpoint.select_resume(tmp_path / "checkpoint" / "ckpt")[1]["step"] in (1, 2)
    assert not _rank_pids()
    run_rl_reasoning(_cfg2(), inputs, Workdir.at(tmp_path, seed=3))
    assert _same(_weights(clean[0]), _weights(tmp_path))
    drop_time = lambda root: [{k: v for k, v in json.loads(x).items() if not k.startswith("time/")}  # noqa: E731
                              for x in (root / "out" / "metrics.jsonl").read_text().splitlines()]
    assert drop_time(clean[0]) == drop_time(tmp_path)


def test_a_checkpoint_of_another_rank_count_is_refused(inputs, clean, tmp_path):  # noqa: F811
    run_rl_reasoning(_cfg(steps=1), inputs, Workdir.at(tmp_path, seed=3))            # one process, step 1
    with pytest.raises(ValueError, match="written by 1 trainer rank"):               # before any rank starts
        run_rl_reasoning(_cfg2(steps=2), inputs, Workdir.at(tmp_path, seed=3))
    assert not (tmp_path / "checkpoint" / "rl-launch.json").exists()
    # and the 2-rank run's checkpoint in one process
    shutil.copytree(clean[0] / "checkpoint" / "ckpt", tmp_path / "two" / "checkpoint" / "ckpt")
    with pytest.raises(ValueError, match="written by 2 trainer rank"):
        run_rl_reasoning(_cfg(steps=3), inputs, Workdir.at(tmp_path / "two", seed=3))


def test_distill_on_two_ranks_trains_and_a_sigterm_resume_is_bit_identical(tmp_path):
    """Distillation has a learning signal even on random models (the teachers' log-probs): the
    optimizer state on the ranks must come back whole for the resumed run to match."""
    from posttrain.distill import DistillConfig, run_distill
    from tests.posttrain._chain import artifacts, make_tokenizer

    inputs = artifacts(tmp_path / "in", make_tokenizer(), {"sft": 0, "rl-reasoning": 1, "rl-agentic": 2,
                                                            "rl-general": 3})
    cfg = DistillConfig(steps=3, prompts_per_teacher=3, optim={"lr": 1e-3}, max_new_tokens=4, checkpoint_every=10,
                        qat={"group_size": 16}, export_hf=False, parallel=RANKS,
                        gates={"evals": {"arithmetic": 2, "gsm8k": 1, "gsm8k_max_new_tokens": 2, "tool": 1,
                                         "tool_max_new_tokens": 2}, "tolerances": {}})
    m = run_distill(cfg, inputs, Workdir.at(tmp_path / "clean", seed=0))
    assert m["trainer_ranks"] == 2 and m["steps"] == 3
    assert not _same(load_file(inputs["rl-general"] / "consolidated.safetensors"), _weights(tmp_path / "clean"))

    def sigterm_at_1(done, total, desc):
        if done == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    shutdown.reset()
    try:
        # the ranks may be in step 2 by the time step 1's line reaches the stage: they finish it
        with pytest.raises(shutdown.Preempted, match=r"checkpoint at step [12] of 3") as stopped:
            run_distill(cfg, inputs, Workdir.at(tmp_path / "stopped", seed=0, progress=sigterm_at_1))
    finally:
        shutdown.reset()
    step = checkpoint.select_resume(tmp_path / "stopped" / "checkpoint" / "ckpt")[1]["step"]
    assert f"checkpoint at step {step} of 3" in str(stopped.value)
    assert not _rank_pids()                       # every rank stopped after the checkpoint
    run_distill(cfg, inputs, Workdir.at(tmp_path / "stopped", seed=0))
    assert _same(_weights(tmp_path / "clean"), _weights(tmp_path / "stopped"))


def test_rl_general_on_two_ranks_judges_every_share_and_trains(tmp_path):
    from posttrain.rl_general import RLGeneralConfig, run_rl_general
    from tests.posttrain._chain import artifacts, make_tokenizer

    inputs = artifacts(tmp_path / "in", make_tokenizer(), {"sft": 0, "rl-agentic": 1})
    cfg = RLGeneralConfig(steps=2, prompts_per_step=3, group_size=3, optim={"lr": 1e-3}, max_new_tokens=6,
                          length_target=4, checkpoint_every=1, weights={"rule": 1.0, "orm": 0.0, "grm": 1.0},
                          grm_max_new_tokens=2, parallel=RANKS,
                          gates={"evals": {"arithmetic": 2, "gsm8k": 1, "gsm8k_max_new_tokens": 2, "tool": 1,
                                           "tool_max_new_tokens": 2}, "tolerances": {}})
    m = run_rl_general(cfg, inputs, Workdir.at(tmp_path / "w", seed=2))
    assert m["trainer_ranks"] == 2 and m["steps"] == 2
    assert {"rule", "length"} <= set(m["reward_per_component"])
    assert m["grm_unparsed_fraction"] > 0          # the GRM (a random model) judged both ranks' samples
    recs = [json.loads(x) for x in (tmp_path / "w" / "out" / "metrics.jsonl").read_text().splitlines()]
    # every rank's groups were judged and trained: 3 prompts x 3 samples
    assert all(r["trainer_ranks"] == 2 and r["optimizer_steps"] >= 1 for r in recs)
    with pytest.raises(ValueError, match="builds its judges"):
        run_rl_general(cfg, inputs, Workdir.at(tmp_path / "x", seed=2), judges={})


def test_rl_agentic_on_two_ranks_matches_one_process_through_the_workers(tmp_path):
    """tau 0, K 1, one worker: the asynchronous stage on 2 trainer ranks reproduces the synchronous
    one-process run. Its worker samples from the versions both ranks published, each its share of
    the tensors (rl.weight_sync): a version loaded wrongly would change the rollouts that follow."""
    from posttrain.rl_agentic import run_rl_agentic
    from tests.posttrain._chain import artifacts, make_tokenizer
    from tests.posttrain.test_rl_agentic import _cfg as agentic_cfg
    from tests.posttrain.test_rl_agentic import _records

    inputs = artifacts(tmp_path / "in", make_tokenizer(), {"rl-reasoning": 0})
    run_rl_agentic(agentic_cfg(synchronous=True), inputs, Workdir.at(tmp_path / "sync", seed=5))
    m = run_rl_agentic(agentic_cfg(parallel=RANKS), inputs, Workdir.at(tmp_path / "ranks", seed=5))
    assert m["trainer_ranks"] == 2
    a, b = _records(tmp_path / "sync"), _records(tmp_path / "ranks")
    assert [r["groups"] for r in a] == [r["groups"] for r in b] == [[0, 1], [2, 3], [4, 5]]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], abs=1e-4)
    assert all(r["weight_sync/buckets"] >= 2 for r in b)             # both ranks wrote a part
    wa, wb = _weights(tmp_path / "sync"), _weights(tmp_path / "ranks")
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4


def test_reward_model_on_two_ranks_equals_one_process(tmp_path):
    """5 pairs a step on 2 ranks (shares of 3 and 2): the Bradley-Terry mean of the whole batch."""
    from posttrain.reward_model import RewardModelConfig, run_reward_model
    from tests.posttrain._chain import artifacts, make_tokenizer

    inputs = artifacts(tmp_path / "in", make_tokenizer(), {"rl-reasoning": 3})
    kw = dict(steps=3, batch_pairs=5, optim={"lr": 1e-3}, max_len=48, gsm8k_pairs=20, mbpp_pairs=10,
              arithmetic_pairs=20, heldout_percent=25, checkpoint_every=2)
    one = run_reward_model(RewardModelConfig(**kw), inputs, Workdir.at(tmp_path / "one", seed=1))
    two = run_reward_model(RewardModelConfig(**kw, parallel=RANKS), inputs, Workdir.at(tmp_path / "two", seed=1))
    assert (one["trainer_ranks"], two["trainer_ranks"]) == (1, 2)
    a = [json.loads(x) for x in (tmp_path / "one" / "out" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "two" / "out" / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "train_pair_accuracy", "margin", "grad_norm"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], abs=1e-4), key
    for f in ("backbone.safetensors", "head.safetensors"):
        wa, wb = load_file(tmp_path / "one" / "out" / f), load_file(tmp_path / "two" / "out" / f)
        # the head's bias cancels in r_chosen - r_rejected: its gradient is rounding noise on both
        # sides, which Adam turns into steps of up to lr; every other weight must agree
        assert max(float((wa[k] - wb[k]).abs().max()) for k in wa if k != "head.bias") < 1e-4, f
