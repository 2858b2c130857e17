"""glmforge.effects: each effect read from stage metrics shaped as the stages publish them."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from glmforge import effects


def _metrics(**over) -> dict:
    m = {
        "dsa-adapt": {"long_context_accuracy": {"full": {"256": 1.0, "512": 0.98}, "dsa": {"256": 0.99, "512": 0.98},
                                                "swa": {"256": 0.2, "512": 0.1}}},
        "sft": {"qat_recovery_facts_ppl": 0.8},
        "rl-reasoning": {"reward": {"first": 0.3, "last": 0.6},
                         "heldout_accuracy": {"before": 0.5, "after": 0.8, "gain_in_stderr": 6.0},
                         "heldout_sampled_accuracy": {"before": 0.4, "after": 0.7, "gain_in_stderr": 9.0,
                                                      "stderr_after": 0.02}},
        "rl-reasoning@2": {"heldout_sampled_accuracy": {"after": 0.8, "stderr_after": 0.02}},
        "rl-agentic": {"reward": {"first": 0.5, "last": 0.8},
                       "heldout_accuracy": {"calc": {"before": 0.4, "after": 0.6, "n": 100}},
                       "heldout_sampled_accuracy": {"calc": {"before": 0.5, "after": 0.7, "gain_in_stderr": 4.0}}},
        "reward-model": {"heldout_pairwise_accuracy": {"n": 64, "before": 0.5, "after": 0.75}},
        "rl-general": {"verified_accuracy": {"arith": {"first": 0.5, "last": 0.6}, "tool": {"first": 0.3, "last": 0.3}},
                       "gates": {"rl-general": {"arithmetic_acc": {"passed": True},
                                                "tool_call_validity": {"passed": True}}}},
        "distill": {"domain_accuracy": {"rl-reasoning": {"arithmetic_acc": {"recovered": 0.5}},
                                        "rl-agentic": {"tool_call_validity": {"recovered": None}}}},
    }
    for stage, v in over.items():
        m[stage.replace("_", "-")] = v
    return m


def test_every_effect_of_a_good_run_is_measured_and_passes():
    got = effects.measure(_metrics())
    assert set(got) == {e.name for e in effects.EFFECTS}
    assert {k: v["passed"] for k, v in got.items()} == {k: True for k in got}
    assert got["long_context_full"]["value"] == pytest.approx(0.99)
    assert got["long_context_dsa_gap"]["value"] == pytest.approx(-0.005)
    assert got["long_context_swa_gap"]["value"] == pytest.approx(0.15 - 0.99)
    assert got["reasoning_reward_gain"]["value"] == pytest.approx(0.3)
    assert got["general_verified_gain"]["value"] == pytest.approx(0.05)
    assert got["distill_recovered"]["value"] == pytest.approx(0.5)   # None (not behind) is left out


@pytest.mark.parametrize("stage, metrics, effect", [
    ("dsa-adapt", {"long_context_accuracy": {"full": {"256": 1.0}, "dsa": {"256": 0.97}, "swa": {"256": 0.2}}},
     "long_context_dsa_gap"),
    ("dsa-adapt", {"long_context_accuracy": {"full": {"256": 1.0}, "dsa": {"256": 1.0}, "swa": {"256": 0.8}}},
     "long_context_swa_gap"),
    ("sft", {"qat_recovery_facts_ppl": 0.5}, "qat_recovery_facts"),
    ("rl-reasoning", {"reward": {"first": 0.3, "last": 0.4}, "heldout_accuracy": {"gain_in_stderr": 6.0},
                      "heldout_sampled_accuracy": {"gain_in_stderr": 6.0}}, "reasoning_reward_gain"),
    ("rl-reasoning", {"reward": {"first": 0.3, "last": 0.6}, "heldout_accuracy": {"gain_in_stderr": 6.0},
                      "heldout_sampled_accuracy": {"gain_in_stderr": 1.5}}, "reasoning_heldout_gain"),
    ("rl-reasoning", {"reward": {"first": 0.3, "last": 0.6},
                      "heldout_accuracy": {"before": 0.5, "after": 0.55, "gain_in_stderr": 1.5},
                      "heldout_sampled_accuracy": {"gain_in_stderr": 6.0}}, "reasoning_heldout_greedy"),
    ("rl-agentic", {"reward": {"first": 0.5, "last": 0.8},
                    "heldout_accuracy": {"calc": {"before": 0.4, "after": 0.6}, "swe": {"before": 0.1, "after": 0.2}},
                    "heldout_sampled_accuracy": {"calc": {"gain_in_stderr": 4.0}, "swe": {"gain_in_stderr": 1.5}}},
     "agentic_heldout_sampled"),                       # the least over the environments counts
    ("reward-model", {"heldout_pairwise_accuracy": {"after": 0.65}}, "reward_model_accuracy"),
    ("distill", {"domain_accuracy": {"rl-reasoning": {"arithmetic_acc": {"recovered": -0.2}}}}, "distill_recovered"),
])
def test_a_missed_target_fails_its_row(stage, metrics, effect):
    got = effects.measure(_metrics(**{stage: metrics}))
    assert got[effect]["passed"] is False
    assert all(v["passed"] is not False for k, v in got.items() if k != effect)   # no other row fails


@pytest.mark.parametrize("before, gain, passed", [(1.0, 0.0, True), (0.96, -1.9, True), (0.96, -2.5, False),
                                                  (0.9, 1.0, False)])
def test_greedy_reasoning_accuracy_may_sit_at_its_ceiling(before, gain, passed):
    rl = {"reward": {"first": 0.8, "last": 0.95}, "heldout_sampled_accuracy": {"gain_in_stderr": 5.0},
          "heldout_accuracy": {"before": before, "after": before, "gain_in_stderr": gain}}
    assert effects.measure(_metrics(rl_reasoning=rl))["reasoning_heldout_greedy"]["passed"] is passed


def test_rl_general_needs_its_gates_and_agentic_may_sit_at_its_ceiling():
    failed_gate = _metrics(rl_general={"verified_accuracy": {"a": {"first": 0.1, "last": 0.5}},
                                       "gates": {"rl-general": {"arithmetic_acc": {"passed": True},
                                                                "tool_call_validity": {"passed": False}}}})
    assert effects.measure(failed_gate)["general_verified_gain"]["passed"] is False
    ceiling = {"reward": {"first": 0.5, "last": 0.7}, "heldout_accuracy": {"calc": {"before": 1.0, "after": 1.0}},
               "heldout_sampled_accuracy": {"calc": {"gain_in_stderr": 3.0}}}
    assert effects.measure(_metrics(rl_agentic=ceiling))["agentic_heldout_gain"]["passed"] is True
    flat = {**ceiling, "reward": {"first": 0.7, "last": 0.6}}
    assert effects.measure(_metrics(rl_agentic=flat))["agentic_heldout_gain"]["passed"] is False


def test_a_stage_that_did_not_run_is_not_measured():
    got = effects.measure({"sft": {"qat_recovery_facts_ppl": 0.9}})
    assert got["qat_recovery_facts"]["passed"] is True
    assert got["long_context_full"] == {"value": None, "passed": None, "stage": "dsa-adapt", "target": ">= 0.8"}
    record = {"stages": [{"name": "sft", "state": "done", "metrics": {"a": 1}},
                         {"name": "distill", "state": "failed", "metrics": {"b": 2}}]}
    assert effects.stage_metrics(record) == {"sft": {"a": 1}}


def test_spread_over_seeds_and_its_table():
    runs = {"seed 0": effects.measure(_metrics()),
            "seed 1": effects.measure(_metrics(sft={"qat_recovery_facts_ppl": 0.4})),
            "seed 2": effects.measure(_metrics(sft={}))}
    s = effects.spread(runs)["qat_recovery_facts"]
    assert s["mean"] == pytest.approx(0.6) and s["std"] == pytest.approx(0.2828, abs=1e-4)
    assert (s["passed"], s["measured"]) == (1, 2)
    table = effects.markdown(runs)
    row = next(line for line in table.splitlines() if line.startswith("| qat_recovery_facts "))
    assert "0.800 | 0.400 ✗ | — | 0.600 ± 0.283 | 1/2" in row


def test_sweep_refuses_bad_seeds_before_any_run(tmp_path):
    env = {**os.environ, "GLMFORGE_HOME": str(tmp_path)}
    for seeds, says in (("0,x", "expected integers"), ("1,1", "each seed once")):
        out = subprocess.run([sys.executable, "-m", "glmforge.cli", "sweep", "--seeds", seeds], capture_output=True, text=True, env=env,
                             timeout=60)
        assert out.returncode == 2 and says in out.stderr
    out = subprocess.run([sys.executable, "-m", "glmforge.cli", "sweep", "--seeds", "0", "--set", "run.seed=3"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 2 and "the sweep sets it" in out.stderr
    assert not (tmp_path / "store").exists()


def _fake_runs(store_uri: str, outcomes: dict[int, str]):
    """A stand-in for the sweep's `glmforge run` subprocess: records a run of the seed in the
    store whose rl-general ends as `outcomes[seed]` ("done", "failed" or "interrupted") and
    returns the exit status such a run has."""
    from runtime.runner import RunRecord
    from runtime.store import open_store

    def call(argv):
        seed = int(next(a for a in argv if a.startswith("run.seed=")).split("=")[1])
        outcome = outcomes[seed]
        rec = RunRecord(id=f"run{seed:09d}", config={"run": {"seed": seed}}, source={},
                        state={"done": "completed"}.get(outcome, outcome))
        m = _metrics()
        rec.stages = [{"name": n, "key": "k", "state": "done", "metrics": m[n], "artifact": None, "error": None}
                      for n in ("rl-reasoning", "reward-model")]
        rec.stages.append({"name": "rl-general", "key": "k", "state": outcome if outcome != "interrupted" else "not run",
                           "metrics": m["rl-general"] if outcome == "done" else {}, "artifact": None,
                           "error": "GateError: tool_call_validity" if outcome == "failed" else None})
        rec.save(open_store(store_uri))
        return {"done": 0, "failed": 1, "interrupted": 143}[outcome]
    return call


def test_sweep_tabulates_a_seed_whose_stage_failed_and_exits_nonzero(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from glmforge.cli import app

    store = str(tmp_path / "store")
    monkeypatch.setenv("GLMFORGE_HOME", str(tmp_path))
    monkeypatch.setattr(subprocess, "call", _fake_runs(store, {0: "done", 1: "failed", 2: "done"}))
    out = CliRunner().invoke(app, ["sweep", "--preset", "tiny", "--seeds", "0,1,2", "--store", store,
                                                   "--out", str(tmp_path / "out")])
    assert out.exit_code == 1, out.output
    assert "seed 1: rl-general failed in run run000000001" in out.stderr
    saved = json.loads((tmp_path / "out" / "sweep-tiny-seeds-0-1-2.json").read_text())
    assert list(saved["runs"]) == ["seed 0 (run000000000)", "seed 1 (run000000001, rl-general failed)",
                                   "seed 2 (run000000002)"]
    assert saved["failed"] == {"1": "rl-general failed in run run000000001"}
    general = saved["spread"]["general_verified_gain"]   # the failed stage's row: no value, not met
    assert (general["passed"], general["measured"]) == (2, 3)
    assert general["values"]["seed 1 (run000000001, rl-general failed)"] is None
    assert saved["spread"]["reasoning_reward_gain"]["passed"] == 3   # the stages before it count


def test_sweep_stops_at_a_run_that_was_interrupted(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from glmforge.cli import app

    store = str(tmp_path / "store")
    monkeypatch.setenv("GLMFORGE_HOME", str(tmp_path))
    monkeypatch.setattr(subprocess, "call", _fake_runs(store, {0: "interrupted", 1: "done"}))
    out = CliRunner().invoke(app, ["sweep", "--preset", "tiny", "--seeds", "0,1", "--store", store,
                                                   "--out", str(tmp_path / "out")])
    assert out.exit_code == 143 and "rerun the sweep to continue" in out.stderr
    assert not (tmp_path / "out").exists()


def test_the_second_rounds_gain_is_in_standard_errors_and_absent_without_a_second_round():
    from glmforge.effects import measure

    one = {"rl-reasoning": {"heldout_sampled_accuracy": {"after": 0.5, "stderr_after": 0.03}}}
    assert measure(one)["self_distill_round_gain"] == {"value": None, "passed": None, "stage": "rl-reasoning@2",
                                                       "target": "> 2"}
    two = {**one, "rl-reasoning@2": {"heldout_sampled_accuracy": {"after": 0.62, "stderr_after": 0.04}}}
    row = measure(two)["self_distill_round_gain"]
    assert row["value"] == pytest.approx(0.12 / 0.05) and row["passed"] is True
    assert measure(two, {"rl-reasoning@2"})["self_distill_round_gain"]["passed"] is False
