"""Iterative self-distillation: a round's rejection-sampled SFT data (self-distill@R) and SFT on it."""
from __future__ import annotations

import json

import pytest

from domains.task import Task
from posttrain.self_distill import SelfDistillConfig, kept, run
from posttrain.sft_data import DISTILLED, DISTILLED_META, SFTDataConfig, build_samples, build_sft_data
from rl.sample import Sample, Status
from runtime.stage import Workdir
from tests.posttrain.conftest import Killed, kill_at
from tests.posttrain.test_rl_reasoning import inputs  # noqa: F401 (fixture)


def _sample(response: list[int], reward: float, status: Status = Status.OK) -> Sample:
    return Sample(Task("arithmetic", "1 + 2 =", "3"), 0, [5, 6], response_ids=response, reward=reward, status=status)


def test_only_verified_distinct_stopped_responses_are_kept_up_to_the_cap():
    group = [_sample([1, 2], 0.0), _sample([3, 4], 1.0), _sample([3, 4], 1.0),           # a repeat
             _sample([7, 8], 1.0, Status.TRUNCATED), _sample([9], 1.0), _sample([10], 1.0)]
    assert kept(group, 2) == [{"prompt_ids": [5, 6], "response_ids": [3, 4]},
                              {"prompt_ids": [5, 6], "response_ids": [9]}]
    assert kept(group, 5) == [{"prompt_ids": [5, 6], "response_ids": r} for r in ([3, 4], [9], [10])]
    assert kept(group[:1], 2) == []


@pytest.fixture(scope="module")
def tokenizer(inputs):  # noqa: F811
    from data_processing.tokenizer import load_tokenizer

    return load_tokenizer(inputs["tokenize"])


def _distilled(tmp_path, examples, replace=True):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / DISTILLED).write_text("".join(json.dumps(e) + "\n" for e in examples))
    (tmp_path / DISTILLED_META).write_text(json.dumps({"replace": replace, "examples": len(examples)}))
    return tmp_path


def test_distilled_examples_replace_the_direct_demonstrations_and_keep_the_tool_calls(tokenizer, tmp_path):
    data = SFTDataConfig(reasoning=4, tool_calc=2, tool_docs=2, code=2, arithmetic=40, arithmetic_tool_calls=0.25,
                         val_per_kind=2)
    original = build_samples(data)["train"]
    direct = [s for s in original if s.kind == "arithmetic" and not any(m.tool_calls for m in s.messages)]
    calls = [s for s in original if s.kind == "arithmetic" and s not in direct]
    assert direct and calls
    examples = [{"domain": "arithmetic", "prompt": "p", "prompt_ids": [11, 12, 13], "response_ids": [21, 22]}] * 3
    plain = build_sft_data(data, tokenizer, tmp_path / "plain", 2048)
    swapped = build_sft_data(data, tokenizer, tmp_path / "swapped", 2048, _distilled(tmp_path / "a", examples))
    added = build_sft_data(data, tokenizer, tmp_path / "added", 2048, _distilled(tmp_path / "b", examples, False))
    s = swapped["samples"]
    assert s["replaced_by_self_distill"] == len(direct) and s["train/self_distill"] == 3, s
    assert s["train/arithmetic/turn"] == len(calls)          # the calculator demonstrations stay
    assert plain["samples"]["train/arithmetic/turn"] == len(direct) + len(calls)
    assert added["samples"]["train/arithmetic/turn"] == len(direct) + len(calls)
    assert added["samples"]["train/self_distill"] == 3 and "replaced_by_self_distill" not in added["samples"]
    # the held-out split is the same in every round: the rounds' evaluations compare
    assert {k: v for k, v in swapped["samples"].items() if k.startswith("val/")} == \
           {k: v for k, v in plain["samples"].items() if k.startswith("val/")}


def test_a_distilled_example_trains_only_its_response_tokens(tokenizer, tmp_path):
    from data_processing.packing import PackedDataset

    data = SFTDataConfig(reasoning=1, tool_calc=0, tool_docs=0, code=0, arithmetic=0, val_per_kind=1)
    examples = [{"domain": "math", "prompt": "p", "prompt_ids": [11, 12, 13], "response_ids": [21, 22, 23, 24]}]
    build_sft_data(data, tokenizer, tmp_path / "out", 2048, _distilled(tmp_path / "a", examples))
    rows = [(r["input_ids"].tolist(), r["loss_mask"].tolist()) for r in PackedDataset(tmp_path / "out", "train")]
    found = [mask[i:i + 7] for tokens, mask in rows for i in range(len(tokens))
             if tokens[i:i + 7] == [11, 12, 13, 21, 22, 23, 24]]
    assert found == [[0, 0, 0, 1, 1, 1, 1]]


def _cfg(**kw) -> SelfDistillConfig:
    return SelfDistillConfig(**{"candidates": 8, "samples": 3, "max_new_tokens": 4, "chunk": 3, "reward_timeout_s": 30,
                                "min_examples": 0, **kw})


def test_a_killed_stage_goes_on_after_its_last_chunk(inputs, tmp_path):  # noqa: F811
    round_inputs = {"rl-reasoning": inputs["sft"], "tokenize": inputs["tokenize"]}
    clean = run(_cfg(), round_inputs, Workdir.at(tmp_path / "clean", seed=3))

    with pytest.raises(Killed):
        run(_cfg(), round_inputs, Workdir.at(tmp_path / "killed", seed=3, progress=kill_at(3)))
    again = run(_cfg(), round_inputs, Workdir.at(tmp_path / "killed", seed=3))
    assert again == clean and clean["prompts"] == 8 and clean["samples_per_prompt"] == 3
    assert (tmp_path / "clean" / "out" / DISTILLED).read_text() == (tmp_path / "killed" / "out" / DISTILLED).read_text()
    with pytest.raises(ValueError, match="fewer than min_examples=100"):
        run(_cfg(min_examples=100), round_inputs, Workdir.at(tmp_path / "strict", seed=3))


def test_the_prompts_are_rl_prompts_choice():
    from posttrain.rl_prompts import RLPromptsConfig, candidates

    assert [t.prompt for t in candidates(_cfg(candidates=5), 4)] == \
           [t.prompt for t in candidates(RLPromptsConfig(candidates=5), 4)]
