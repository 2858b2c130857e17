"""The post-training loop's rounds in the stage registry: names, parents, and refusals."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from glmforge.config import load_config
from glmforge.pipeline import ROUND_STAGES, STAGES, get_stage, iterations, stage_round, stages_for, stages_until
from runtime.runner import Runner
from runtime.stage import StageSpec, Workdir
from runtime.store import LocalStore

REPO = Path(__file__).resolve().parents[2]


def test_one_iteration_is_the_registry_and_each_round_repeats_post_training_on_its_own_parents():
    assert [s.name for s in stages_for(1)] == [s.name for s in STAGES]
    three = {s.name: s for s in stages_for(3)}
    assert len(three) == len(STAGES) + 2 * (1 + len(ROUND_STAGES))
    assert three["self-distill@2"].parents == ("rl-reasoning", "tokenize")
    assert three["self-distill@3"].parents == ("rl-reasoning@2", "tokenize")
    assert three["sft@3"].parents == ("dsa-adapt", "tokenize", "self-distill@3")     # the same base model
    assert three["rl-agentic@2"].parents == ("rl-reasoning@2", "tokenize", "swe-envs")  # swe-envs runs once
    assert three["distill@3"].parents == ("rl-general@3", "sft@3", "rl-reasoning@3", "rl-agentic@3", "tokenize")
    assert three["sft@2"].section == "sft" and three["sft@2"].runner == three["sft"].runner
    names = list(three)
    for spec in three.values():                   # parents first
        assert all(names.index(p) < names.index(spec.name) for p in spec.parents)


def test_until_a_round_stage_runs_what_it_needs_and_no_more():
    names = [s.name for s in stages_until("rl-prompts@2", 3)]
    assert names[-4:] == ["rl-reasoning", "self-distill@2", "sft@2", "rl-prompts@2"]
    assert "rl-agentic" not in names and "rl-reasoning@2" not in names
    assert [s.name for s in stages_until(None, 2)][-1] == "distill@2"


@pytest.mark.parametrize("name,says", [("ingest@2", "only self-distill, sft"), ("sft@1", "R >= 2"),
                                       ("sft@two", "R >= 2"), ("self-distill", "unknown stage")])
def test_names_that_are_no_stage_are_refused(name, says):
    with pytest.raises(ValueError, match=says):
        get_stage(name)


def test_a_round_past_the_configs_iterations_is_refused():
    assert get_stage("sft@3").name == "sft@3" and stage_round("sft@3") == ("sft", 3)
    with pytest.raises(ValueError, match=r"round 3, and the config has 2 \(self_distill.iterations=2\)"):
        get_stage("sft@3", 2)
    assert iterations(load_config("tiny", None, ["self_distill.iterations=3"])) == 3


def test_an_iteration_count_below_one_is_one_line_before_anything_starts(tmp_path):
    env = {"GLMFORGE_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "glmforge.cli", "run", "--set", "self_distill.iterations=0"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "self_distill.iterations" in out.stderr and "greater than or equal to 1" in out.stderr
    assert not (tmp_path / "home").exists()
    out = subprocess.run([sys.executable, "-m", "glmforge.cli", "run", "--until", "sft@3", "--set",
                          "self_distill.iterations=2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "round 3, and the config has 2" in out.stderr
    assert not (tmp_path / "home").exists()


def test_a_round_stage_reads_its_parents_by_their_base_names(tmp_path):
    seen = {}

    def first(cfg, inputs, workdir: Workdir):
        (workdir.out / "x").write_text("a")
        return {}

    def second(cfg, inputs, workdir: Workdir):
        seen.update({k: (v / "x").read_text() for k, v in inputs.items()})
        return {}

    cfg = load_config("tiny")
    specs = [StageSpec("a@2", "run", dict, first), StageSpec("b@2", "run", dict, second, parents=("a@2",))]
    runner = Runner(cfg, LocalStore(tmp_path / "store"), specs, home=tmp_path / "home")
    a = runner.run_stage(specs[0], {})
    runner.run_stage(specs[1], {"a@2": a.manifest})
    assert seen == {"a": "a"}
