"""On-policy distillation: the per-token advantage by hand, tokenizer checks, recovery of a forced
regression, and the stage end to end (gate chain, INT4 export of the distilled model)."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from chat.template import STOP_TOKENS
from domains import arithmetic
from domains.task import Task
from runtime.stage import Workdir
from posttrain.distill import (
    DistillConfig,
    check_teacher,
    distill_step,
    recovery,
    run_distill,
    teacher_logprobs,
)
from rl.update import UpdateParams
from rl.opd import opd_loss, token_advantages
from rl.rollout import RolloutEngine, SamplingParams, prompt_ids
from rl.sample import Sample
from tests.posttrain._chain import artifacts, make_tokenizer
from tests.rl.conftest import small_model


def test_token_advantage_against_hand_computed_values():
    teacher = torch.tensor([[-1.0, -2.0, -0.1, 0.0]])
    student = torch.tensor([[-1.5, -1.0, -3.1, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    a = token_advantages(teacher, student, mask)
    assert torch.allclose(a, torch.tensor([[0.5, -1.0, 3.0, 0.0]]))
    assert torch.allclose(token_advantages(teacher, student, mask, clip=0.6), torch.tensor([[0.5, -0.6, 0.6, 0.0]]))
    # sg: no gradient flows into either log-prob
    s = student.clone().requires_grad_(True)
    assert not token_advantages(teacher, s, mask).requires_grad


def test_opd_loss_value_gradient_and_icepop_mask_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    logp = old.clone().requires_grad_(True)              # ratio 1: loss = -sum(w A) / |y|
    adv = torch.tensor([[0.5, -1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, st = opd_loss(logp, old, old, adv, mask, beta=2.0)
    assert loss.item() == pytest.approx(-(0.5 - 1.0) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, 0.5, 0.0]]))   # -w A / |y| (d ratio / d logp = 1)
    # token 0's rollout log-prob makes rho = e^2 > beta: IcePop masks it (w = 0), |y| unchanged
    rollout = torch.tensor([[-3.0, -2.0, -0.5]])
    loss, st = opd_loss(old.clone(), old, rollout, adv, mask, beta=2.0)
    assert loss.item() == pytest.approx(-(-1.0) / 2) and st["icepop_masked_fraction"] == 0.5


def test_teacher_scores_the_students_exact_token_ids():
    tok = make_tokenizer()
    teacher = small_model(tok.get_vocab_size(), seed=4).eval()
    s = Sample(Task("x", "", ""), 0, [5, 6, 7], response_ids=[8, 9], loss_mask=[1, 1], rollout_logprobs=[0.0, 0.0])
    (lp,) = teacher_logprobs(teacher, [s], tok.token_to_id("<|pad|>"))
    with torch.no_grad():
        ref = teacher(torch.tensor([[5, 6, 7, 8]])).logits.float().log_softmax(-1)[0]
    assert lp == pytest.approx([ref[2, 8].item(), ref[3, 9].item()], abs=1e-5)


def test_teacher_with_another_tokenizer_or_vocab_is_refused(tmp_path):
    tok = make_tokenizer()
    student = small_model(tok.get_vocab_size())
    other = make_tokenizer(["completely different words here and there"] * 50 + ["x y z"] * 50, vocab=290)
    (tmp_path / "t" / "hf").mkdir(parents=True)
    other.save(str(tmp_path / "t" / "hf" / "tokenizer.json"))
    teacher = small_model(tok.get_vocab_size(), seed=1)
    with pytest.raises(ValueError, match="teacher 'sft'.s tokenizer .* differs from the student's"):
        check_teacher("sft", tmp_path / "t", teacher, tok, student)
    with pytest.raises(ValueError, match="teacher 'rl-agentic' .* vocab_size 299"):
        check_teacher("rl-agentic", tmp_path / "u", small_model(299), tok, student)
    tok.save(str(tmp_path / "t" / "hf" / "tokenizer.json"))
    check_teacher("sft", tmp_path / "t", teacher, tok, student)          # same tokenizer: accepted


def _greedy(model, tok, prefixes, n):
    stop = [tok.token_to_id(t) for t in STOP_TOKENS]
    eng = RolloutEngine(model, tok, stop, tok.token_to_id("<|pad|>"))
    return [t for t, *_ in eng.complete(prefixes, SamplingParams(0.0, 1.0, n), torch.Generator())]


def test_distillation_recovers_a_forced_regression():
    """The forced regression: the student is the teacher with a perturbed output head. The
    domain's accuracy is teacher-forced top-1 agreement with the teacher's greedy answers on
    held-out addition prompts (the teacher scores 1 by construction; its head is scaled up so its
    choices are confident, not near-ties of a random model); on-policy distillation on train
    prompts must win back at least half of what the perturbation cost."""
    tok = make_tokenizer()
    pad = tok.token_to_id("<|pad|>")
    teacher = small_model(tok.get_vocab_size(), seed=0).eval()
    with torch.no_grad():
        teacher.lm_head.weight.mul_(20.0)
    student = copy.deepcopy(teacher)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w = student.lm_head.weight
        w.add_(torch.randn(w.shape, generator=g) * w.std())
    held = [prompt_ids(tok, t) for t in arithmetic.tasks(16, "heldout", 0)]
    ref = _greedy(teacher, tok, held, 4)

    @torch.no_grad()
    def acc(m):
        hit = n = 0
        for p, r in zip(held, ref):
            am = m(torch.tensor([p + r])).logits[0].argmax(-1)
            hit += sum(int(am[len(p) - 1 + k] == t) for k, t in enumerate(r))
            n += len(r)
        return hit / n

    before = acc(student)
    assert before < 0.5
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3, weight_decay=0.0)
    stop = [tok.token_to_id(t) for t in STOP_TOKENS]
    engine = RolloutEngine(student, tok, stop, pad)
    gen = torch.Generator().manual_seed(1)
    train = arithmetic.tasks(400, "train", 1)
    for step in range(1, 31):
        prompts = {"rl-reasoning": [prompt_ids(tok, t) for t in train[(step - 1) * 12: step * 12]]}
        distill_step(engine, student, opt, {"rl-reasoning": teacher}, prompts, pad, SamplingParams(1.0, 1.0, 4),
                     UpdateParams(minibatches=1, policy_loss="opd", adv_clip=5.0), gen, step)
    after = acc(student)
    r = recovery({"arithmetic_acc": 1.0}, {"arithmetic_acc": before}, {"arithmetic_acc": after}, ("arithmetic_acc",))
    assert r["arithmetic_acc"]["recovered"] >= 0.5, (before, after)


def test_distill_stage_chain_table_and_int4_export(tmp_path):
    tok = make_tokenizer()
    inputs = artifacts(tmp_path / "in", tok, {"sft": 0, "rl-reasoning": 1, "rl-agentic": 2, "rl-general": 3})
    cfg = DistillConfig(steps=2, prompts_per_teacher=2, optim={"lr": 1e-3}, max_new_tokens=4, checkpoint_every=1,
                        qat={"group_size": 16}, gates={"evals": {"arithmetic": 4, "gsm8k": 2, "gsm8k_max_new_tokens": 4,
                                                                  "tool": 2, "tool_max_new_tokens": 4}, "tolerances": {}})
    m = run_distill(cfg, inputs, Workdir.at(tmp_path / "w", seed=0))
    assert m["steps"] == 2 and set(m["reverse_kl_per_teacher"]) == {"sft", "rl-reasoning", "rl-agentic"}
    assert set(m["domain_accuracy"]["rl-reasoning"]["arithmetic_acc"]) == {"teacher", "before", "after", "recovered"}
    out = tmp_path / "w" / "out"
    chain = json.loads((out / "gates.json").read_text())["chain"]
    assert [c["stage"] for c in chain] == ["sft", "rl-reasoning", "rl-agentic", "rl-general", "distill"]
    assert "distill" in m["gates"]
    for f in ("consolidated.safetensors", "int4/model_int4.safetensors", "export/int4/config.json", "gates.png",
              "gates.md", "distill.png"):
        assert (out / f).exists(), f


def test_distill_takes_the_evals_its_inputs_recorded_and_measures_the_rest(tmp_path, monkeypatch):
    """rl-general's gates.json records rl-reasoning, rl-agentic and rl-general measured the same way:
    distill measures only the sft teacher (no gates.json) and its own result (full and INT4)."""
    from rl import gates

    tok = make_tokenizer()
    inputs = artifacts(tmp_path / "in", tok, {"sft": 0, "rl-reasoning": 1, "rl-agentic": 2, "rl-general": 3})
    evals = {"arithmetic": 4, "gsm8k": 2, "gsm8k_max_new_tokens": 4, "tool": 2, "tool_max_new_tokens": 4}
    cfg = DistillConfig(steps=1, prompts_per_teacher=2, optim={"lr": 1e-3}, max_new_tokens=4, checkpoint_every=1,
                        qat={"group_size": 16}, gates={"evals": evals, "tolerances": {}})
    spec = gates.spec(cfg.gates.evals, 0)
    planted = {n: {"arithmetic_acc": i / 10, "gsm8k_acc": 0.0, "heldout_ppl": 100.0 + i, "tool_call_validity": 0.5}
               for i, n in enumerate(("sft", "rl-reasoning", "rl-agentic", "rl-general"))}
    chain = None
    for parent, stage in (("sft", "rl-reasoning"), ("rl-reasoning", "rl-agentic"), ("rl-agentic", "rl-general")):
        gates.finish(stage, inputs[stage], chain, parent, planted[parent], planted[stage], {}, measured=spec)
        chain = gates.read_chain(inputs[stage])
    real, calls = gates.measure, []
    monkeypatch.setattr(gates, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = run_distill(cfg, inputs, Workdir.at(tmp_path / "w", seed=0))
    assert len(calls) == 3                                    # the sft teacher, after, INT4 after
    got = {c["stage"]: c["evals"] for c in json.loads((tmp_path / "w" / "out" / "gates.json").read_text())["chain"]}
    assert {n: got[n] for n in ("rl-reasoning", "rl-agentic", "rl-general")} == \
           {n: planted[n] for n in ("rl-reasoning", "rl-agentic", "rl-general")}
    assert m["gates"]["distill"]["arithmetic_acc"]["before"] == planted["rl-general"]["arithmetic_acc"]
