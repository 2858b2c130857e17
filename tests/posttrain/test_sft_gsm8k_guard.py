"""SFT never trains on GSM8K's test split: a test-split path is refused when the config is built."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from domains.gsm8k import read_gsm8k
from posttrain.sft_data import SFTDataConfig


@pytest.mark.parametrize("path", ["{samples}/gsm8k/test.jsonl", "s3://bucket/evals/gsm8k-test.jsonl", "/d/TEST.jsonl"])
def test_test_split_path_is_refused(path):
    with pytest.raises(ValidationError, match="names a test split.*evaluation only"):
        SFTDataConfig(gsm8k_path=path)


@pytest.mark.parametrize("path", ["{samples}/gsm8k/train.jsonl", "/data/latest.jsonl", "/data/contest_problems.jsonl"])
def test_other_paths_are_accepted(path):
    assert SFTDataConfig(gsm8k_path=path).gsm8k_path == path


def test_shipped_test_split_reads_for_evaluation():
    # the file itself is fine to read (evaluation, decontamination); only training is refused
    probs = read_gsm8k("{samples}/gsm8k/test.jsonl")
    assert len(probs) == 1319 and all(p.answer for p in probs)


def test_arithmetic_demos_offer_the_calculator_to_a_share_and_answer_directly():
    from domains.tools import CALCULATOR
    from posttrain.sft_data import arithmetic_samples

    plain = arithmetic_samples(400, "train", seed=3, corrupt=0.0)
    mixed = arithmetic_samples(400, "train", seed=3, corrupt=0.0, with_tools=0.25)
    assert all(s.tools is None for s in plain)
    offered = [s for s in mixed if s.tools]
    assert 70 <= len(offered) <= 130 and all(s.tools == (CALCULATOR,) for s in offered)
    # the same questions and answers either way: only the offer differs, never a tool call
    assert [s.messages for s in mixed] == [s.messages for s in plain]
    assert all(len(s.messages) == 2 and s.messages[1].role == "assistant" and not s.messages[1].tool_calls
               for s in offered)


def test_arithmetic_tool_call_demos_are_what_calc_arith_returns():
    # the demonstration's call, run through the agentic environment, prints exactly the observation
    # the demonstration shows; the final answer copies it (one wrong digit where corrupted)
    from domains.task import Task
    from domains.tools import CALCULATOR
    from posttrain.sft_data import arithmetic_samples
    from rl.envs import make_env

    demos = [s for s in arithmetic_samples(400, "train", seed=3, corrupt=0.3, tool_calls=0.25) if s.tools]
    assert 70 <= len(demos) <= 130 and all(s.tools == (CALCULATOR,) for s in demos)
    # without the schema in the prompt: the same conversations, nothing offered in the system turn
    bare = arithmetic_samples(400, "train", seed=3, corrupt=0.3, tool_calls=0.25, tool_schema=False)
    assert [s.messages for s in bare if len(s.messages) == 4] == [s.messages for s in demos]
    assert all(s.tools is None for s in bare)
    env = make_env("calc_arith", reverse_digits=True)
    copied = 0
    for s in demos:
        user, call, tool, final = s.messages
        (tc,) = call.tool_calls
        assert " " in tc.arguments["expression"] and "=" not in tc.arguments["expression"]
        env.reset(Task("calc_arith", user.content, tool.content, {}))
        assert env.step([tc]).observations == [tool.content]
        assert env.final_reward(tool.content).score == 1.0
        copied += final.content == tool.content
        assert sum(a != b for a, b in zip(final.content.split(), tool.content.split())) <= 1
    assert 0.5 * len(demos) < copied < len(demos)           # corrupt=0.3: most copies exact, some not
    # three-digit operands for calc_arith3: sums beyond the direct (two-digit) demonstrations
    wide = [s for s in arithmetic_samples(200, "train", seed=3, corrupt=0.0, tool_calls=0.25, tool_digits=3)
            if len(s.messages) == 4]
    env3 = make_env("calc_arith3", reverse_digits=True, schema_in_prompt=False)
    for s in wide:
        user, call, tool, final = s.messages
        assert len(user.content.split()) == 8 and final.content == tool.content     # " 1 2 3 + 4 5 6 ="
        env3.reset(Task("calc_arith3", user.content, tool.content, {}))
        assert env3.step(list(call.tool_calls)).observations == [tool.content]
    # four-digit operands for calc_arith4: sampled from the split (not listed), same checks
    wide4 = [s for s in arithmetic_samples(200, "train", seed=3, corrupt=0.0, tool_calls=0.25, tool_digits=4)
             if len(s.messages) == 4]
    env4 = make_env("calc_arith4", reverse_digits=True, schema_in_prompt=False)
    assert len(wide4) > 20
    for s in wide4:
        user, call, tool, final = s.messages
        assert len(user.content.split()) == 10 and final.content == tool.content
        env4.reset(Task("calc_arith4", user.content, tool.content, {}))
        assert env4.step(list(call.tool_calls)).observations == [tool.content]
