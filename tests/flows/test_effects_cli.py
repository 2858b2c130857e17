"""`glmforge effects` and `glmforge sweep` on the session's tiny run (a copy of its home: the
sweep records runs of its own). The run with seed 1234 (tiny's run.seed) is the tiny run's config, so the sweep finds
every stage published and records it without Prefect; the tiny run's stages give the numbers."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from glmforge import effects

from .conftest import FAST

GLMFORGE = [sys.executable, "-m", "glmforge.cli"]


def test_sweep_tabulates_each_seeds_run(tiny_run, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(tiny_run.home, home, symlinks=True)
    env = {**os.environ, "GLMFORGE_HOME": str(home)}
    args = [a for s in FAST for a in ("--set", s)]
    out = subprocess.run([*GLMFORGE, "sweep", "--preset", "tiny", "--seeds", "1234", *args, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "every stage already published; Prefect not started" in out.stdout
    saved = json.loads((tmp_path / "sweep-tiny-seeds-1234.json").read_text())
    (label, measured), = saved["runs"].items()
    assert label.startswith("seed 1234 (")
    # what the tiny run measures: every RL stage's effect (tiny has no long-context or QAT
    # comparison: dsa-adapt without baselines, sft without the PTQ baseline)
    # (the held-out rows of rl-reasoning are None when its 2 held-out prompts' accuracies sit at 0
    # or 1 before and after: no standard error)
    for name in ("reasoning_reward_gain", "agentic_heldout_gain", "reward_model_accuracy", "general_verified_gain"):
        assert isinstance(measured[name]["value"], float), name
    assert measured["long_context_swa_gap"]["value"] is None and measured["qat_recovery_facts"]["value"] is None
    assert saved["spread"]["reasoning_reward_gain"]["mean"] == measured["reasoning_reward_gain"]["value"]
    assert (tmp_path / "sweep-tiny-seeds-1234.md").read_text() in out.stdout

    # `effects` on the original run: the same numbers as the sweep's record of it
    shown = subprocess.run([*GLMFORGE, "effects", "--run", tiny_run.run_id, "--json"], capture_output=True,
                           text=True, timeout=120, env=env)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["runs"][tiny_run.run_id] == measured
    assert {e.name for e in effects.EFFECTS} == set(measured)

    # the sweep is recorded in the store: the report of its run shows the spread
    page = subprocess.run([*GLMFORGE, "report", "--run", saved["run_ids"]["1234"], "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert page.returncode == 0, page.stderr
    html = open(page.stdout.strip()).read()
    assert "Seed sweep: seeds 1234" in html and 'data-metric="sweep.reasoning_reward_gain.seed1234"' in html
    assert f'data-metric="sweep.reasoning_reward_gain.mean">{measured["reasoning_reward_gain"]["value"]:.3f}' in html

