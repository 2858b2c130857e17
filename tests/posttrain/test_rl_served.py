"""The RL-side stages with trainer ranks that only train: 2 gloo ranks with the experts sharded over
them (expert_parallel 2), rollouts and evaluations from 2 native server replicas (rl.served),
rl-general's judges and distill's teachers on server pools of their own. The same stage in one
process with the same servers is the reference: the update on ranks equals the one-rank update
(tests/rl/test_ranks.py), and each group's request is seeded alike, so the two runs sample the
same tokens. On rl-reasoning: kill -9 of a rank, then resume: bit for bit the uninterrupted run;
kill -9 of a server replica: replaced, the stage finishes; SIGTERM: a checkpoint, Preempted, no
rank or server left."""
from __future__ import annotations

import json
import os
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

PLACED = {"launch": {"nproc_per_node": 2}, "expert_parallel": 2}
SERVED = {"backend": "served", "servers": {"replicas": 2, "full_every": 2}}


def _cfg_served(parallel=PLACED, **kw):
    return _cfg(parallel=parallel, rollout=SERVED, prompts_per_step=3, optim={"lr": 1e-2, "weight_decay": 0.5}, **kw)


def _weights(root):
    return load_file(root / "out" / "consolidated.safetensors")


def _records(root):
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "sync/seconds"))}
            for x in (root / "out" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def placed(inputs, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("placed")
    return root, run_rl_reasoning(_cfg_served(), inputs, Workdir.at(root, seed=3))


def test_ranks_that_only_train_match_one_process_on_the_same_servers(inputs, placed, tmp_path):  # noqa: F811
    root, m = placed
    assert m["placement"] == {"trainer_ranks": 2, "expert_parallel": 2, "rollout": "served", "servers": 2}
    assert m["steps"] == 3 and m["heldout_accuracy"]["n"] == 8
    ws = m["weight_sync"]
    assert ws["versions"] == 3 and ws["deltas"] >= 1 and ws["bytes_per_delta"] < ws["full_bytes"]
    recs = _records(root)
    assert all(r["trainer_ranks"] == 2 and r["sync/bytes"] > 0 for r in recs)
    sft, out = load_file(inputs["sft"] / "consolidated.safetensors"), _weights(root)
    assert out.keys() == sft.keys()                 # the export is the whole model: every expert gathered
    assert any(not torch.equal(sft[k], out[k]) for k in sft if ".experts." in k)
    one = run_rl_reasoning(_cfg_served(parallel={}), inputs, Workdir.at(tmp_path, seed=3))
    assert one["placement"]["trainer_ranks"] == 1
    a, b = _records(root), _records(tmp_path)
    for key in ("reward", "response_length"):      # the same tokens sampled
        assert [r[key] for r in a] == [r[key] for r in b], key
    # DeepSpeed's AdamW (no decay on norm gains and biases) and expert reductions vs torch's, in fp32.
    # The weights themselves are not compared: a random model earns no reward, so its gradient is
    # rounding noise that Adam turns into steps of up to lr (tests/rl/test_ranks.py compares updates)
    for key in ("entropy", "loss"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-3, abs=1e-4), key


def _kill_9_after(step: int, module: bytes, which: int):
    """A progress callback: after `step`, SIGKILL the `which`-th of the two processes running `module`."""
    def progress(done, total, desc):
        if done == step:
            pids = descendants_running(module)
            assert len(pids) == 2, pids
            os.kill(pids[which], signal.SIGKILL)
    return progress


def test_kill_9_of_a_trainer_rank_then_resume_is_bit_identical(inputs, placed, tmp_path):  # noqa: F811
    with pytest.raises(TrainingFailed, match="failed"):
        run_rl_reasoning(_cfg_served(), inputs, Workdir.at(tmp_path, seed=3, progress=_kill_9_after(2, b"rl.launch", 1)))
    assert checkpoint.select_resume(tmp_path / "checkpoint" / "ckpt")[1]["step"] in (1, 2)
    assert not descendants_running(b"rl.launch") and not descendants_running(b"rl.native_server")
    run_rl_reasoning(_cfg_served(), inputs, Workdir.at(tmp_path, seed=3))
    a, b = _weights(placed[0]), _weights(tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _same_records(_records(placed[0]), _records(tmp_path))


# What the rollout servers' own log-probs feed: a native server batches the requests queued at
# once, and which requests share a batch depends on when the ranks' requests arrive, so these
# move in the last bits from run to run (the trainer's recompute, and so the weights, do not).
ROLLOUT_LOGP_STATS = ("mismatch/", "ratio_mean")
# How a version reached the servers: after a kill the restarted servers may lack the version a
# delta builds on, so the first sync of the resumed run can be whole (more bytes, delta 0).
TRANSPORT = ("sync/bytes", "sync/delta")


def _same_records(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), step
        differ = [k for k in x if x[k] != y[k] and k not in TRANSPORT]
        exact = [k for k in differ if not k.startswith(ROLLOUT_LOGP_STATS)]
        assert not exact, (step, {k: (x[k], y[k]) for k in exact})
        for k in differ:
            assert x[k] == pytest.approx(y[k], rel=1e-3, abs=1e-6), (step, k, x[k], y[k])


def test_a_killed_server_replica_is_replaced_and_the_stage_finishes(inputs, placed, tmp_path):  # noqa: F811
    m = run_rl_reasoning(_cfg_served(), inputs,
                         Workdir.at(tmp_path, seed=3, progress=_kill_9_after(1, b"rl.native_server", 0)))
    assert m["weight_sync"]["server_restarts"] >= 1
    # the replacement took the current version: the run is the uninterrupted one
    a, b = _weights(placed[0]), _weights(tmp_path)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_checkpoints_and_leaves_no_rank_or_server(inputs, tmp_path):  # noqa: F811
    def sigterm_at_1(done, total, desc):
        if done == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    shutdown.reset()
    try:
        # the ranks may be in step 2 by the time step 1's line reaches the stage: they finish it
        with pytest.raises(shutdown.Preempted, match=r"checkpoint at step [12] of 3"):
            run_rl_reasoning(_cfg_served(), inputs, Workdir.at(tmp_path, seed=3, progress=sigterm_at_1))
    finally:
        shutdown.reset()
    assert not descendants_running(b"rl.launch") and not descendants_running(b"rl.native_server")


def test_a_placement_that_cannot_run_is_refused_before_anything_starts(inputs, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="expert_parallel=2 needs rollout.backend=served"):
        _cfg(parallel=PLACED)
    with pytest.raises(ValueError, match=r"expert_parallel=4 must divide the trainer's rank count"):
        _cfg(parallel={"launch": {"nproc_per_node": 2}, "expert_parallel": 4}, rollout=SERVED)
    from posttrain.rl_general import RLGeneralConfig

    with pytest.raises(ValueError, match="rl-general: parallel.expert_parallel=2 needs rollout.backend=served"):
        RLGeneralConfig(parallel=PLACED)
    # a server URL that does not answer: one line naming it, no rank started
    bad = {"backend": "served", "servers": {"urls": ["http://127.0.0.1:9"], "startup_timeout_s": 2}}
    with pytest.raises(Exception, match=r"native server 0 \(http://127.0.0.1:9\) not healthy"):
        run_rl_reasoning(_cfg(rollout=bad), inputs, Workdir.at(tmp_path, seed=3))


def test_distill_on_ranks_that_only_train_with_served_teachers_matches_one_process(tmp_path):
    """The student's rollouts from 2 servers, each teacher a server pool of its own scoring the
    student's tokens (prefill log-probs), the student expert-sharded over 2 trainer ranks: the same
    samples and losses as the stage in one process with the same servers."""
    from posttrain.distill import DistillConfig, run_distill
    from tests.posttrain._chain import artifacts, make_tokenizer

    chain = artifacts(tmp_path / "in", make_tokenizer(), {"sft": 0, "rl-reasoning": 1, "rl-agentic": 2,
                                                            "rl-general": 3})

    def cfg(parallel):
        return DistillConfig(steps=3, prompts_per_teacher=3, optim={"lr": 1e-3}, max_new_tokens=4,
                             checkpoint_every=10, qat={"group_size": 16}, export_hf=False, parallel=parallel,
                             rollout=SERVED, teacher_servers={"replicas": 1},
                             gates={"evals": {"arithmetic": 2, "gsm8k": 1, "gsm8k_max_new_tokens": 2, "tool": 1,
                                              "tool_max_new_tokens": 2}, "tolerances": {}})

    m = run_distill(cfg(PLACED), chain, Workdir.at(tmp_path / "placed", seed=0))
    assert m["placement"] == {"trainer_ranks": 2, "expert_parallel": 2, "rollout": "served",
                              "teachers_served": True}
    for name in ("sft", "rl-reasoning", "rl-agentic"):
        assert (tmp_path / "placed" / "checkpoint" / "teachers" / name / "server-0.log").exists()
    # a teacher artifact without its weights: one line naming it, no rank and no server started
    (chain["rl-agentic"] / "consolidated.safetensors").rename(tmp_path / "moved.safetensors")
    with pytest.raises(ValueError, match=r"rl-agentic's artifact .* has no consolidated.safetensors"):
        run_distill(cfg(PLACED), chain, Workdir.at(tmp_path / "missing", seed=0))
    assert not (tmp_path / "missing" / "checkpoint" / "teachers").exists()
    (tmp_path / "moved.safetensors").rename(chain["rl-agentic"] / "consolidated.safetensors")
    one = run_distill(cfg({}), chain, Workdir.at(tmp_path / "one", seed=0))
    a, b = _records(tmp_path / "placed"), _records(tmp_path / "one")
    assert [r["response_length"] for r in a] == [r["response_length"] for r in b]
    # the same tokens sampled and scored; the updates differ by DeepSpeed's AdamW and the expert-parallel
    # reductions against torch's in one process (fp32), which after two steps moves the student's
    # log-probs by up to ~1.5% of the small reverse KL
    for key in ("reverse_kl/sft", "reverse_kl/rl-reasoning", "loss"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=3e-2, abs=1e-4), key
    assert one["steps"] == m["steps"] == 3


def test_rl_general_on_ranks_that_only_train_with_served_judges_matches_one_process(tmp_path):
    """The policy's rollouts, the GRM (the SFT weights, "expected" scoring over the first token) and
    the ORM each on server pools, the policy expert-sharded over 2 trainer ranks: the same samples
    and the same judged rewards as the stage in one process on the same servers."""
    from posttrain.rl_general import RLGeneralConfig, run_rl_general
    from rl.orm import RewardModel, save_reward_model
    from tests.posttrain._chain import artifacts, make_tokenizer
    from tests.rl.conftest import small_model

    tok = make_tokenizer()
    chain = artifacts(tmp_path / "in", tok, {"sft": 0, "rl-agentic": 1})
    orm = RewardModel(small_model(tok.get_vocab_size(), seed=2), tok.token_to_id("<|pad|>"))
    with torch.no_grad():
        orm.head.weight.normal_()
    save_reward_model(orm, tmp_path / "in" / "reward-model", {"max_len": 48, "score_mean": 0.0, "score_std": 1.0,
                                                               "heldout_pairwise_accuracy": 0.5})
    chain["reward-model"] = tmp_path / "in" / "reward-model"

    def cfg(parallel):
        return RLGeneralConfig(steps=2, prompts_per_step=3, group_size=3, optim={"lr": 1e-3}, max_new_tokens=6,
                               length_target=4, checkpoint_every=1, weights={"rule": 1.0, "orm": 1.0, "grm": 1.0},
                               grm_scoring="expected", grm_min_number_mass=0.0, parallel=parallel, rollout=SERVED,
                               gates={"evals": {"arithmetic": 2, "gsm8k": 1, "gsm8k_max_new_tokens": 2, "tool": 1,
                                                "tool_max_new_tokens": 2}, "tolerances": {}})

    m = run_rl_general(cfg(PLACED), chain, Workdir.at(tmp_path / "placed", seed=2))
    assert m["placement"] == {"trainer_ranks": 2, "expert_parallel": 2, "rollout": "served",
                              "judges_served": True}
    assert {"rule", "orm", "grm"} <= set(m["reward_per_component"])
    for judge in ("orm", "grm"):
        assert (tmp_path / "placed" / "checkpoint" / "judges" / judge / "server-0.log").exists()
    run_rl_general(cfg({}), chain, Workdir.at(tmp_path / "one", seed=2))
    a, b = _records(tmp_path / "placed"), _records(tmp_path / "one")
    assert [r["response_length"] for r in a] == [r["response_length"] for r in b]
    for key in ("reward/rule", "reward/orm", "reward/grm"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], abs=1e-5), key


def test_reward_model_with_its_experts_sharded_equals_one_process(tmp_path):
    """The reward model generates nothing: its trainer ranks only train, with the backbone's experts
    sharded over them (expert_parallel 2); 5 pairs a step (shares of 3 and 2), as in one process."""
    from posttrain.reward_model import RewardModelConfig, run_reward_model
    from tests.posttrain._chain import artifacts, make_tokenizer

    chain = artifacts(tmp_path / "in", make_tokenizer(), {"rl-reasoning": 3})
    kw = dict(steps=3, batch_pairs=5, optim={"lr": 1e-3}, max_len=48, gsm8k_pairs=20, mbpp_pairs=10,
              arithmetic_pairs=20, heldout_percent=25, checkpoint_every=2)
    one = run_reward_model(RewardModelConfig(**kw), chain, Workdir.at(tmp_path / "one", seed=1))
    two = run_reward_model(RewardModelConfig(**kw, parallel=PLACED), chain, Workdir.at(tmp_path / "two", seed=1))
    assert two["placement"] == {"trainer_ranks": 2, "expert_parallel": 2}
    assert two["heldout_pairwise_accuracy"]["before"] == one["heldout_pairwise_accuracy"]["before"]
    a = [json.loads(x) for x in (tmp_path / "one" / "out" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "two" / "out" / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "train_pair_accuracy", "margin"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], abs=1e-4), key
    wa, wb = load_file(tmp_path / "one" / "out" / "backbone.safetensors"), \
        load_file(tmp_path / "two" / "out" / "backbone.safetensors")
    assert wa.keys() == wb.keys()                   # the whole backbone: every expert gathered
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa if ".experts." in k) < 1e-4


def test_rl_agentic_workers_on_served_rollouts_with_sharded_experts_match_one_process(tmp_path):
    """tau 0, K 1, one worker: the asynchronous stage, its worker sending every turn to the native
    servers and the policy expert-sharded over 2 trainer ranks, reproduces the synchronous run in
    one process on the same servers (every rank publishes its part of each version; a version
    the servers loaded wrongly would change the episodes that follow)."""
    from posttrain.rl_agentic import run_rl_agentic
    from tests.posttrain._chain import artifacts, make_tokenizer
    from tests.posttrain.test_rl_agentic import _cfg as agentic_cfg

    chain = artifacts(tmp_path / "in", make_tokenizer(), {"rl-reasoning": 0})
    run_rl_agentic(agentic_cfg(synchronous=True, rollout=SERVED), chain, Workdir.at(tmp_path / "sync", seed=5))
    m = run_rl_agentic(agentic_cfg(parallel=PLACED, rollout=SERVED), chain, Workdir.at(tmp_path / "placed", seed=5))
    assert m["placement"] == {"trainer_ranks": 2, "expert_parallel": 2, "rollout": "served"}
    a, b = _records(tmp_path / "sync"), _records(tmp_path / "placed")
    assert [r["groups"] for r in a] == [r["groups"] for r in b] == [[0, 1], [2, 3], [4, 5]]
    assert [r["reward"] for r in a] == [r["reward"] for r in b]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-3, abs=1e-4)
    assert all(r["sync/bytes"] > 0 for r in b)
    assert not descendants_running(b"rl.native_server") and not descendants_running(b"rl.rollout_worker")
