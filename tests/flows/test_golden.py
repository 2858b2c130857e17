"""Golden losses of the tiny preset (with the FAST cuts of tests/flows/conftest.py): the first
and last step of pretrain and sft. A refactor that changes what the pipeline computes (data,
tokenizer, model, loss, optimizer, seeds) moves them; a change that should not, does not.

Tolerance: relative 1e-3, wide enough for float summation order on another x86 CPU, far
narrower than any real change (one optimizer step moves the loss by more than 1e-2). When a
change is meant to move them, update the numbers here and say why in the commit."""
from __future__ import annotations

import json

import pytest

from runtime.store import LocalStore

GOLDEN = {
    # stage: (loss of step 1, loss of the last step)
    "pretrain": (9.013957977294922, 8.33001708984375),
    # sft moved with the long-context mix cap (context phases train on other sequences)
    "sft": (8.284055709838867, 8.100546836853027),
}


@pytest.mark.parametrize("stage", sorted(GOLDEN))
def test_first_and_last_step_losses_are_the_recorded_ones(tiny_run, stage):
    store = LocalStore(tiny_run.home / "store")
    manifest = store.manifest(stage, tiny_run.keys[stage])
    local = store.materialize(manifest, tiny_run.home / "golden-cache")
    steps = [json.loads(line) for line in (local / "metrics.jsonl").read_text().splitlines() if line.strip()]
    got = (steps[0]["loss"], steps[-1]["loss"])
    print(f"\n{stage}: {got!r}")
    assert got == pytest.approx(GOLDEN[stage], rel=1e-3), f"{stage} losses moved: {got!r}"
