"""Evaluation gates: tolerances, the chain table, a broken gate failing the stage."""
from __future__ import annotations

import json

import pytest

from rl import gates
from rl.gates import GateConfig, GateError


def test_tolerances_are_absolute_for_accuracy_and_relative_for_perplexity():
    before = {"arithmetic_acc": 0.5, "heldout_ppl": 100.0}
    ok = gates.gate(before, {"arithmetic_acc": 0.45, "heldout_ppl": 109.0}, {"arithmetic_acc": 0.05, "heldout_ppl": 0.1})
    assert ok["arithmetic_acc"]["passed"] and ok["heldout_ppl"]["passed"]
    bad = gates.gate(before, {"arithmetic_acc": 0.44, "heldout_ppl": 111.0}, {"arithmetic_acc": 0.05, "heldout_ppl": 0.1})
    assert not bad["arithmetic_acc"]["passed"] and not bad["heldout_ppl"]["passed"]
    # no tolerance: recorded, not gated
    free = gates.gate(before, {"arithmetic_acc": 0.0, "heldout_ppl": 1e9}, {})
    assert free["arithmetic_acc"] == {"before": 0.5, "after": 0.0, "tolerance": None, "passed": True}


def test_an_accuracy_drop_within_the_evals_noise_does_not_fail():
    # 8 prompts: 0.5 -> 0.25 is two flips, within 2 SE (0.47); over 100 prompts the same drop fails
    small, large = gates.counts(gates.GateEvalConfig(tool=8)), gates.counts(gates.GateEvalConfig(tool=100))
    before, after, tol = {"tool_call_validity": 0.5}, {"tool_call_validity": 0.25}, {"tool_call_validity": 0.2}
    g8 = gates.gate(before, after, tol, small)["tool_call_validity"]
    assert g8["passed"] and g8["noise"] == pytest.approx(2 * ((0.25 + 0.1875) / 8) ** 0.5, abs=1e-4)
    assert g8["detects"] is False                      # 8 prompts cannot see a 0.2 drop: gates.json says so
    g100 = gates.gate(before, after, tol, large)["tool_call_validity"]
    assert not g100["passed"] and g100["noise"] == pytest.approx(2 * ((0.25 + 0.1875) / 100) ** 0.5, abs=1e-4)
    assert g100["detects"] is True
    data = gates.extend(None, "sft", "rl-general", before, after, {"tool_call_validity": g8})
    assert "noise 0.47, cannot detect it" in gates.table(data)
    # a share of 0 or 1 still has one flip's noise; perplexity has no binomial noise
    assert gates.noise(1.0, 1.0, 100) == pytest.approx(2 * (2 * 0.01 * 0.99 / 100) ** 0.5)
    assert "noise" not in gates.gate({"heldout_ppl": 10.0}, {"heldout_ppl": 20.0}, {"heldout_ppl": 0.5}, large)["heldout_ppl"]
    from domains import arithmetic
    assert gates.counts(gates.GateEvalConfig(arithmetic=5000))["arithmetic_acc"] == len(arithmetic.pairs("heldout"))


def test_unknown_eval_in_tolerances_is_refused():
    with pytest.raises(ValueError, match="unknown evals"):
        GateConfig(tolerances={"mmlu": 0.1})


def test_chain_extends_parent_and_failing_gate_raises_with_the_table(tmp_path):
    parent = tmp_path / "parent"
    gates.finish("rl-reasoning", parent, None, "sft", {"arithmetic_acc": 0.3}, {"arithmetic_acc": 0.6},
                 {"arithmetic_acc": 0.1})
    data = json.loads((parent / "gates.json").read_text())
    assert [c["stage"] for c in data["chain"]] == ["sft", "rl-reasoning"]
    with pytest.raises(GateError) as e:
        gates.finish("rl-general", tmp_path / "out", gates.read_chain(parent), "rl-agentic",
                     {"arithmetic_acc": 0.6}, {"arithmetic_acc": 0.2}, {"arithmetic_acc": 0.1})
    assert "| arithmetic_acc | 0.3 | 0.6 | 0.2 | 0.1 | **NO** |" in str(e.value)
    out = tmp_path / "out"
    assert (out / "gates.png").exists() and "**NO**" in (out / "gates.md").read_text()
    g = json.loads((out / "gates.json").read_text())["gates"]
    assert g["rl-general"]["arithmetic_acc"] == {"before": 0.6, "after": 0.2, "tolerance": 0.1, "passed": False}
    assert g["rl-reasoning"]["arithmetic_acc"]["passed"] is True


def test_measure_returns_every_eval_in_range():
    from tests.posttrain._chain import make_tokenizer
    from tests.rl.conftest import small_model

    tok = make_tokenizer()
    ev = gates.measure(small_model(tok.get_vocab_size()), tok,
                       gates.GateEvalConfig(arithmetic=4, gsm8k=2, gsm8k_max_new_tokens=4, tool_max_new_tokens=4))
    assert set(ev) == set(gates.EVALS)
    assert all(0 <= ev[k] <= 1 for k in ("arithmetic_acc", "gsm8k_acc", "tool_call_validity"))
    assert 1 < ev["heldout_ppl"] < 10 * tok.get_vocab_size()     # a random model: about the vocab size


def test_a_stage_takes_its_input_models_evals_from_that_artifact_when_measured_the_same_way(tmp_path, monkeypatch):
    from model.hf import load_state, save_state
    from rl import trainer
    from tests.posttrain._chain import make_tokenizer
    from tests.rl.conftest import small_model

    tok = make_tokenizer()
    cfg = GateConfig(evals=gates.GateEvalConfig(arithmetic=4, gsm8k=2, tool=2, gsm8k_max_new_tokens=4,
                                                tool_max_new_tokens=4))
    model = small_model(tok.get_vocab_size())
    after = gates.measure(model, tok, cfg.evals, seed=5)
    out = tmp_path / "rl-reasoning"
    gates.finish("rl-reasoning", out, None, "sft", after, after, {}, measured=gates.spec(cfg.evals, 5))
    save_state(model, out / "consolidated.safetensors")
    reloaded = load_state(out / "consolidated.safetensors")
    assert gates.measure(reloaded, tok, cfg.evals, seed=5) == after     # the premise: same weights, same evals

    monkeypatch.setattr(gates, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert trainer.measure_gates(reloaded, tok, cfg, 5, (out, "rl-reasoning")) == after
    measured = []
    monkeypatch.setattr(gates, "measure", lambda m, t, c, seed: measured.append((c, seed)) or {"arithmetic_acc": 0.0})
    trainer.measure_gates(reloaded, tok, cfg, 6, (out, "rl-reasoning"))                 # another seed
    other = GateConfig(evals=cfg.evals.model_copy(update={"arithmetic": 8}))
    trainer.measure_gates(reloaded, tok, other, 5, (out, "rl-reasoning"))               # other settings
    trainer.measure_gates(reloaded, tok, cfg, 5, (tmp_path / "sft", "sft"))             # no gates.json
    assert [s for _, s in measured] == [6, 5, 5]
    monkeypatch.setattr(gates, "MEASURE_VERSION", gates.MEASURE_VERSION + 1)          # measure() changed
    trainer.measure_gates(reloaded, tok, cfg, 5, (out, "rl-reasoning"))
    assert len(measured) == 4
