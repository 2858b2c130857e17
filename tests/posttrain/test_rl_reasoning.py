"""The rl-reasoning stage on a tiny random model: metrics, artifact, exact resume, lr-0 control."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from domains.task import Task
from runtime.stage import Workdir
from model.hf import save_state
from posttrain.rl_reasoning import RLReasoningConfig, draw_tasks, run_rl_reasoning
from tests.posttrain.conftest import Killed, kill_at
from tests.rl.conftest import small_model


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from data_processing.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("rl_inputs")
    tok = train_tokenizer([" 1 2 + 3 4 = 6 4 0", " 9 9 + 9 9 = 8 9 1", "The answer is 7."] * 40,
                          vocab_size=300, min_frequency=2)
    (root / "tokenize").mkdir()
    tok.save(str(root / "tokenize" / "tokenizer.json"))
    save_state(small_model(tok.get_vocab_size()), root / "sft" / "consolidated.safetensors")
    return {"tokenize": root / "tokenize", "sft": root / "sft"}


def _cfg(**kw) -> RLReasoningConfig:
    base = dict(steps=3, prompts_per_step=2, group_size=4, optim={"lr": 1e-3}, max_new_tokens=4, heldout=8,
                gsm8k_test=2, gsm8k_max_new_tokens=4, checkpoint_every=1, rollout_int4={"group_size": 16},
                reward_timeout_s=30,
                gates={"evals": {"arithmetic": 4, "gsm8k": 2, "gsm8k_max_new_tokens": 4, "tool": 2, "tool_max_new_tokens": 4}})
    return RLReasoningConfig(**{**base, **kw})


def test_stage_reports_rewards_heldout_and_icepop(inputs, tmp_path):
    m = run_rl_reasoning(_cfg(), inputs, Workdir.at(tmp_path, seed=3))
    assert m["steps"] == 3
    assert set(m["reward"]) == {"first", "last"} and set(m["reward_per_domain"]) == {"arithmetic"}
    h = m["heldout_accuracy"]
    assert h["n"] == 8 and 0 <= h["before"] <= 1 and h["stderr_after"] >= 0
    hs = m["heldout_sampled_accuracy"]   # 8 samples of each of the 8 held-out prompts
    assert hs["n"] == 8 and hs["samples"] == 8 and 0 <= hs["after"] <= 1 and hs["stderr_after"] >= 0
    assert m["gsm8k_test_accuracy"]["n"] == 2
    assert 0 <= m["icepop_masked_fraction"] <= 1 and m["rollout_int4"] is True
    assert {"arithmetic_acc", "heldout_ppl"} <= set(m["gates"]["rl-reasoning"])
    out = tmp_path / "out"
    for f in ("consolidated.safetensors", "reward.png", "metrics.jsonl", "samples.jsonl", "eval.json", "gates.md"):
        assert (out / f).exists(), f
    rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rec] == [1, 2, 3]
    for key in ("reward/arithmetic", "icepop_masked_fraction", "clip_fraction", "entropy", "response_length",
                "zero_variance_groups", "reward_failures", "time/generate"):
        assert key in rec[0], key
    assert list((out / "tensorboard").iterdir())


@pytest.mark.parametrize("shaping", [{}, {"dynamic_sampling": {"max_extra_groups": 3}, "overlong": {"mode": "filter"}}],
                         ids=["plain", "dynamic-sampling"])
def test_killed_stage_resumes_to_the_uninterrupted_result(inputs, tmp_path, shaping):
    cfg = _cfg(**shaping)
    run_rl_reasoning(cfg, inputs, Workdir.at(tmp_path / "clean", seed=3))

    with pytest.raises(Killed):
        run_rl_reasoning(cfg, inputs, Workdir.at(tmp_path / "killed", seed=3, progress=kill_at(3)))
    # the step-3 record was written before the kill; the resumed run must drop and redo it
    assert len((tmp_path / "killed" / "checkpoint" / "metrics.jsonl").read_text().splitlines()) == 3
    resumed = run_rl_reasoning(cfg, inputs, Workdir.at(tmp_path / "killed", seed=3))
    a = load_file(tmp_path / "clean" / "out" / "consolidated.safetensors")
    b = load_file(tmp_path / "killed" / "out" / "consolidated.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    clean = [json.loads(x) for x in (tmp_path / "clean" / "out" / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(x) for x in (tmp_path / "killed" / "out" / "metrics.jsonl").read_text().splitlines()]
    drop_time = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]
    assert drop_time(clean) == drop_time(again)
    assert resumed["reward"] == {"first": clean[0]["reward"], "last": clean[-1]["reward"]}


def test_dynamic_sampling_refills_within_its_bound(inputs, tmp_path):
    m = run_rl_reasoning(_cfg(dynamic_sampling={"max_extra_groups": 3}, overlong={"mode": "penalty", "buffer": 2}),
                         inputs, Workdir.at(tmp_path, seed=3))
    rec = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    for r in rec:
        assert 0 <= r["dynamic/extra_groups"] <= 3
        # a refill round runs while a flat group is left and the bound is not spent
        assert r["dynamic/flat_trained"] == 0 or r["dynamic/extra_groups"] == 3
        assert r["dynamic/replaced"] <= r["dynamic/flat_drawn"] <= 2
        assert r["overlong/penalised"] >= r["overlong/truncated"]
    totals = m["batch_shaping"]
    assert totals["dynamic/extra_groups"] == sum(r["dynamic/extra_groups"] for r in rec)


def test_learning_rate_zero_control_stays_flat(inputs, tmp_path):
    m = run_rl_reasoning(_cfg(optim={"lr": 0.0}), inputs, Workdir.at(tmp_path, seed=3))
    before = load_file(inputs["sft"] / "consolidated.safetensors")
    after = load_file(tmp_path / "out" / "consolidated.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert m["heldout_accuracy"]["before"] == m["heldout_accuracy"]["after"]
    # the sampled evaluation has its own seeded generator: the same weights sample the same
    assert m["heldout_sampled_accuracy"]["before"] == m["heldout_sampled_accuracy"]["after"]


def test_prompts_of_a_step_depend_only_on_seed_and_step():
    pools = {"arithmetic": [Task("arithmetic", str(i), "") for i in range(50)],
             "math": [Task("math", f"m{i}", "") for i in range(50)]}
    w = {"arithmetic": 1.0, "math": 1.0}
    assert draw_tasks(pools, w, 8, 1, 5) == draw_tasks(pools, w, 8, 1, 5)
    assert draw_tasks(pools, w, 8, 1, 5) != draw_tasks(pools, w, 8, 1, 6)
    only = draw_tasks(pools, {"arithmetic": 1.0, "math": 0.0}, 20, 1, 5)
    assert {t.domain for t in only} == {"arithmetic"}


def test_config_refuses_unknown_domains_and_all_zero_weights():
    with pytest.raises(ValueError, match="unknown domains"):
        RLReasoningConfig(domains={"poetry": 1.0})
    with pytest.raises(ValueError, match="at least one"):
        RLReasoningConfig(domains={"arithmetic": 0.0})
