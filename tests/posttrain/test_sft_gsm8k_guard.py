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
