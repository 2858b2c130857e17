"""SFT never trains on GSM8K's test split: a test-split path is refused when the config is built."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from posttrain.sft_data import SFTDataConfig, read_gsm8k


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
    from posttrain.sft_data import CALCULATOR, arithmetic_samples

    plain = arithmetic_samples(400, "train", seed=3, corrupt=0.0)
    mixed = arithmetic_samples(400, "train", seed=3, corrupt=0.0, with_tools=0.25)
    assert all(s.tools is None for s in plain)
    offered = [s for s in mixed if s.tools]
    assert 70 <= len(offered) <= 130 and all(s.tools == (CALCULATOR,) for s in offered)
    # the same questions and answers either way: only the offer differs, never a tool call
    assert [s.messages for s in mixed] == [s.messages for s in plain]
    assert all(len(s.messages) == 2 and s.messages[1].role == "assistant" and not s.messages[1].tool_calls
               for s in offered)
