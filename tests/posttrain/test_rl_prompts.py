"""rl-prompts (prompts measured by the SFT model's pass rate) and rl-reasoning drawing from it."""
from __future__ import annotations

import json

import pytest
import torch

from domains import arithmetic
from runtime.stage import Workdir
from posttrain.rl_prompts import POOL, RLPromptsConfig, measure, run
from posttrain.rl_reasoning import run_rl_reasoning
from rl.prompts import PromptPoolConfig, draw_tasks, group_size, histogram, pool_tasks
from rl.rewards import RewardWorker
from rl.rollout import SamplingParams
from rl.sample import Status
from tests.posttrain.conftest import Killed, kill_at
from tests.posttrain.test_rl_reasoning import _cfg, inputs  # noqa: F401 (fixture)


class Scripted:
    """An engine whose i-th prompt gets the right answer on its first right[i] samples."""

    def __init__(self, right: list[int]):
        self.right = right

    def generate(self, samples, params, generator):
        seen: dict[int, int] = {}
        for s in samples:
            n = seen[s.group] = seen.get(s.group, 0) + 1
            s.text = s.task.answer if n <= self.right[s.group] else "1 2 3"
            s.response_ids, s.status = [1], Status.OK


def test_pass_rates_are_the_share_of_samples_the_verifier_rewards(tokenizer_for_pool):
    tasks = arithmetic.tasks(5, "train", seed=0)
    right = [0, 1, 2, 3, 4]
    with RewardWorker() as worker:
        rows = measure(Scripted(right), worker, tokenizer_for_pool, tasks, 4, SamplingParams(), torch.Generator(), 30)
    assert [r["pass_rate"] for r in rows] == [n / 4 for n in right]            # the direct count
    assert [r["rewards"] for r in rows][2] == [1.0, 1.0, 0.0, 0.0]
    assert [r["prompt"] for r in rows] == [t.prompt for t in tasks]
    assert histogram([r["pass_rate"] for r in rows]) == {"0": 1, "(0,1/4]": 1, "(1/4,1/2]": 1, "(1/2,3/4]": 1,
                                                          "(3/4,1)": 0, "1": 1}


@pytest.fixture(scope="module")
def tokenizer_for_pool(inputs):  # noqa: F811
    from data_processing.tokenizer import load_tokenizer

    return load_tokenizer(inputs["tokenize"])


def _pool_cfg(**kw) -> RLPromptsConfig:
    return RLPromptsConfig(**{"candidates": 12, "samples": 3, "max_new_tokens": 4, "chunk": 5, "reward_timeout_s": 30,
                              **kw})


def test_killed_stage_resumes_to_the_uninterrupted_pool(inputs, tmp_path):  # noqa: F811
    clean = run(_pool_cfg(), inputs, Workdir.at(tmp_path / "clean", seed=1))

    with pytest.raises(Killed):
        run(_pool_cfg(), inputs, Workdir.at(tmp_path / "killed", seed=1, progress=kill_at(5)))
    assert len((tmp_path / "killed" / "checkpoint" / POOL).read_text().splitlines()) == 5
    again = run(_pool_cfg(), inputs, Workdir.at(tmp_path / "killed", seed=1))
    assert again == clean and clean["prompts"] == 12
    assert (tmp_path / "clean" / "out" / POOL).read_text() == (tmp_path / "killed" / "out" / POOL).read_text()
    rows = [json.loads(x) for x in (tmp_path / "clean" / "out" / POOL).read_text().splitlines()]
    for r in rows:
        assert r["pass_rate"] == sum(x >= 1 for x in r["rewards"]) / 3 and len(r["rewards"]) == 3
    assert sum(clean["domains"]["arithmetic"]["histogram"].values()) == 12


def test_a_stage_killed_after_its_last_chunk_publishes_without_loading_the_model(inputs, tmp_path, monkeypatch):  # noqa: F811
    from posttrain import rl_prompts

    with pytest.raises(Killed):            # every chunk measured, killed before publishing
        run(_pool_cfg(), inputs, Workdir.at(tmp_path / "killed", seed=1, progress=kill_at(12)))

    def no_model(*a, **k):
        raise AssertionError("the model was loaded (and its engine started) with nothing left to sample")

    monkeypatch.setattr(rl_prompts.trainer, "load_policy", no_model)
    again = run(_pool_cfg(), inputs, Workdir.at(tmp_path / "killed", seed=1))
    assert again["prompts"] == 12


def _rows(rates: list[float]) -> list[dict]:
    return [{"domain": "arithmetic", "prompt": f"p{i}", "answer": "1", "meta": {"a": i}, "pass_rate": p}
            for i, p in enumerate(rates)]


def test_the_policy_filters_weights_and_scales_groups():
    rows = _rows([0.0, 0.25, 0.5, 1.0])
    pools, within = pool_tasks(rows, {"arithmetic": 1.0}, PromptPoolConfig(measured=True), "rl-reasoning")
    assert [t.prompt for t in pools["arithmetic"]] == ["p0", "p1", "p2"] and within is None
    policy = PromptPoolConfig(measured=True, drop_unsolved=True, weighting="difficulty", hard_below=0.25,
                              hard_group_scale=4)
    pools, within = pool_tasks(rows, {"arithmetic": 1.0}, policy, "rl-reasoning")
    assert [t.prompt for t in pools["arithmetic"]] == ["p1", "p2"] and within == {"arithmetic": [0.75, 0.5]}
    assert [group_size(t, 8, policy) for t in pools["arithmetic"]] == [32, 8]
    drawn = draw_tasks(pools, {"arithmetic": 1.0}, 4000, seed=0, step=1, within=within)
    share = sum(t.prompt == "p1" for t in drawn) / len(drawn)
    assert share == pytest.approx(0.6, abs=0.03)                  # 0.75 / (0.75 + 0.5)


def test_a_policy_that_leaves_no_prompt_stops_rl_reasoning_before_any_work(inputs, tmp_path):  # noqa: F811
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / POOL).write_text("".join(json.dumps(r) + "\n" for r in _rows([1.0, 1.0])))
    cfg = _cfg(prompt_pool={"measured": True})
    with pytest.raises(ValueError, match=r"^rl-reasoning: prompt_pool leaves no prompt of domain 'arithmetic': "
                                         r"of 2 measured, 2 always solved"):
        run_rl_reasoning(cfg, {**inputs, "rl-prompts": tmp_path / "pool"}, Workdir.at(tmp_path / "w", seed=0))
    assert not any((tmp_path / "w" / "checkpoint").rglob("*"))         # nothing ran
    with pytest.raises(ValueError, match="'math', which rl-prompts did not measure"):
        run_rl_reasoning(_cfg(prompt_pool={"measured": True}, domains={"math": 1.0}),
                         {**inputs, "rl-prompts": tmp_path / "pool"}, Workdir.at(tmp_path / "w", seed=0))


def test_rl_reasoning_trains_on_the_measured_pool(inputs, tmp_path):  # noqa: F811
    pool = run(_pool_cfg(), inputs, Workdir.at(tmp_path / "pool", seed=1))
    assert pool["prompts"] == 12
    m = run_rl_reasoning(_cfg(steps=2, prompt_pool={"measured": True, "drop_solved": False, "hard_group_scale": 2}),
                         {**inputs, "rl-prompts": tmp_path / "pool" / "out"}, Workdir.at(tmp_path / "rl", seed=1))
    assert m["prompt_pool"]["prompts"] == {"arithmetic": 12} and m["prompt_pool"]["hard_group_scale"] == 2
    prompts = {json.loads(x)["prompt"] for x in (tmp_path / "pool" / "out" / POOL).read_text().splitlines()}
    shown = [json.loads(x) for x in (tmp_path / "rl" / "out" / "samples.jsonl").read_text().splitlines()]
    assert shown and all(s["prompt"] in prompts for s in shown)
