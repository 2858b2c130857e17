"""Checkpoint completeness: marker + digests, the `latest` pointer, fallback past broken ones."""
from __future__ import annotations

import logging
import random

import numpy as np
import torch

from training import checkpoint as ck


def _save(root, step, keep_last=5):
    d = root / ck.tag_for(step)
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(bytes([step % 256]) * 1000)
    (d / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"optimizer" * 100)
    ck.finalize(root, ck.tag_for(step), {"step": step}, keep_last)


def test_finalize_writes_marker_then_latest_and_prunes(tmp_path):
    for s in (10, 20, 30):
        _save(tmp_path, s, keep_last=2)
    assert ck.tags(tmp_path) == ["step_00000020", "step_00000030"]
    assert (tmp_path / ck.LATEST).read_text() == "step_00000030"
    assert ck.verify(tmp_path, "step_00000030") is None
    tag, meta = ck.select_resume(tmp_path)
    assert tag == "step_00000030" and meta["step"] == 30


def test_corrupt_newest_is_detected_and_previous_used(tmp_path, caplog):
    for s in (10, 20):
        _save(tmp_path, s)
    f = tmp_path / "step_00000020" / "mp_rank_00_model_states.pt"
    data = bytearray(f.read_bytes())
    data[500] ^= 0xFF                                              # one flipped byte
    f.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="glmforge"):
        tag, meta = ck.select_resume(tmp_path)
    assert tag == "step_00000010" and meta["step"] == 10
    assert "step_00000020" in caplog.text and "digest mismatch" in caplog.text
    assert ck.tags(tmp_path) == ["step_00000010"]                # the broken one is gone
    assert (tmp_path / ck.LATEST).read_text() == "step_00000010"


def test_partial_newest_without_marker_is_skipped(tmp_path, caplog):
    _save(tmp_path, 10)
    partial = tmp_path / "step_00000020"                           # killed while saving
    partial.mkdir()
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"half")
    with caplog.at_level(logging.WARNING, logger="glmforge"):
        tag, _ = ck.select_resume(tmp_path)
    assert tag == "step_00000010"
    assert "no COMPLETE marker" in caplog.text


def test_missing_file_and_nothing_usable(tmp_path, caplog):
    _save(tmp_path, 10)
    (tmp_path / "step_00000010" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    assert ck.verify(tmp_path, "step_00000010").startswith("files differ")
    with caplog.at_level(logging.WARNING, logger="glmforge"):
        assert ck.select_resume(tmp_path) is None
    assert not (tmp_path / ck.LATEST).exists()
    assert ck.select_resume(tmp_path / "nothing-here") is None


def test_rng_state_roundtrips_through_json():
    import json

    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    state = json.loads(json.dumps(ck.rng_state()))
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    ck.set_rng_state(state)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]


def test_branch_copies_a_checkpoint_and_its_metrics_into_a_fresh_run(tmp_path):
    import json

    import pytest

    src, dst = tmp_path / "baseline", tmp_path / "qat"
    for s in (2, 4):
        _save(src, s)
    (src / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3, 4)))
    ck.branch(src, dst, ck.tag_for(2))
    tag, meta = ck.select_resume(dst)
    assert tag == ck.tag_for(2) and meta["step"] == 2 and ck.tags(dst) == [tag]
    assert [json.loads(line)["step"] for line in (dst / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert ck.tags(src) == [ck.tag_for(2), ck.tag_for(4)]            # the source is left as it was
    # a damaged source is refused, and nothing lands in the destination
    (src / ck.tag_for(4) / "mp_rank_00_model_states.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="digest mismatch"):
        ck.branch(src, tmp_path / "other", ck.tag_for(4))
    assert ck.select_resume(tmp_path / "other") is None
