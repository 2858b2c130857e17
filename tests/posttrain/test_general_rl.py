"""rl-general and reward-model on tiny random models: ORM accuracy, judge deadlines, hybrid
rewards, the stage's metrics and a broken gate failing it."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from chat.template import Message, encode, reply_ids
from domains.task import Task
from runtime.stage import Workdir
from rl import gates
from rl.orm import RewardModel, load_reward_model
from posttrain.reward_model import RewardModelConfig, mutate_code, pairwise_accuracy, plain, run_reward_model, tool_pairs
from posttrain.rl_general import RLGeneralConfig, calls_step, hybrid_rewards, run_rl_general, tool_tasks, verified_accuracy
from rl.judges import (
    JudgeService,
    combine,
    disagreement,
    grm_judge,
    judge_view,
    orm_judge,
    parse_grm_score,
    rule_reward,
    score_token_ids,
    tool_rule,
)
from rl.sample import Sample
from tests.posttrain._chain import artifacts, make_tokenizer

EVALS = {"arithmetic": 4, "gsm8k": 2, "gsm8k_max_new_tokens": 4, "tool": 2, "tool_max_new_tokens": 4}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return artifacts(tmp_path_factory.mktemp("general"), make_tokenizer(), {"sft": 0, "rl-reasoning": 3, "rl-agentic": 1})


def test_pairwise_accuracy_on_a_fixture():
    chosen = torch.tensor([2.0, 1.0, 0.5, -1.0])
    rejected = torch.tensor([1.0, 1.0, 0.7, -3.0])
    # wins: 2>1, -1>-3; tie 1==1 counts 1/2; 0.5<0.7 loses -> 2.5 / 4
    assert pairwise_accuracy(chosen, rejected) == 0.625
    with pytest.raises(ValueError):
        pairwise_accuracy(chosen, rejected[:3])


def test_code_mutation_changes_the_code():
    import random

    code = "def f(a, b):\n    return a + b == 3\n"
    assert mutate_code(code, random.Random(0)) != code


def test_hung_judge_times_out_without_stalling_the_step():
    release = threading.Event()

    def hung(items):
        release.wait(30)              # a judge that never answers in time
        return [1.0] * len(items)

    svc = JudgeService("grm", hung, timeout_s=0.3, chunk=2)
    t0 = time.perf_counter()
    res = svc.score([(Task("general", "q", ""), "a")] * 5)
    took = time.perf_counter() - t0
    release.set()
    assert took < 2.0, took
    assert res.failed == [True] * 5 and "timed out" in res.reason and svc.timeouts == 1

    def flaky(items):
        if items[0][1] == "boom":
            raise RuntimeError("judge crashed")
        return [0.5] * len(items)

    res = JudgeService("orm", flaky, timeout_s=5, chunk=1).score([(Task("g", "q", ""), "ok"), (Task("g", "q", ""), "boom")])
    assert res.failed == [False, True] and res.scores[0] == 0.5 and "crashed" in res.reason


def test_rules_grm_parsing_combination_and_disagreement():
    assert rule_reward("The answer is 7.<|user|>")["format"] == 1.0
    assert rule_reward("<think>never closed")["format"] == 0.0
    assert rule_reward("Ответ 7")["language"] == 0.0
    assert parse_grm_score("Score: 7/10") == 0.7 and parse_grm_score("eleven") is None and parse_grm_score("42") is None
    w = {"rule": 1.0, "orm": 1.0, "grm": 2.0}
    assert combine({"rule": 1.0, "orm": 0.5, "grm": None}, w, -0.5, 0.2) == pytest.approx(0.75 - 0.1)
    d = disagreement([{"rule": 1.0, "orm": 0.9, "grm": 0.1}, {"rule": 0.0, "orm": 0.2, "grm": 0.3}])
    assert d["rule_orm"] == 0.0 and d["rule_grm"] == 0.5 and d["any"] == 0.5


def test_reward_model_stage_trains_and_reports_heldout_accuracy(inputs, tmp_path):
    cfg = RewardModelConfig(steps=3, batch_pairs=4, optim={"lr": 1e-3}, max_len=48, gsm8k_pairs=20, mbpp_pairs=10,
                            arithmetic_pairs=20, heldout_percent=25, checkpoint_every=2)
    m = run_reward_model(cfg, inputs, Workdir.at(tmp_path, seed=1))
    h = m["heldout_pairwise_accuracy"]
    assert m["steps"] == 3 and h["before"] == 0.5      # zero-initialised head: every pair a tie
    assert 0 <= h["after"] <= 1 and h["n"] == m["pairs"]["heldout"] > 0
    assert set(m["pairs"]["by_kind"]) >= {"gsm8k/wrong_number", "gsm8k/truncated", "mbpp/mutated", "arithmetic/digit"}
    info = json.loads((tmp_path / "out" / "orm.json").read_text())
    assert info["heldout_pairwise_accuracy"] == h["after"] and info["score_std"] > 0
    assert set(info["score_scales"]) <= {"plain", "tools"} and info["score_scales"]["plain"]["std"] > 0
    rm, _ = load_reward_model(tmp_path / "out", inputs_pad(inputs))
    assert rm.likelihood.weight.abs().sum() > 0          # the likelihood weights were trained and saved
    for f in ("backbone.safetensors", "head.safetensors", "loss.png", "metrics.jsonl"):
        assert (tmp_path / "out" / f).exists(), f


def inputs_pad(inputs) -> int:
    from data_processing.tokenizer import load_tokenizer

    return load_tokenizer(inputs["tokenize"]).token_to_id("<|pad|>")


def test_reward_model_likelihood_term_is_the_replys_mean_and_min_logprob(inputs):
    from data_processing.tokenizer import load_tokenizer
    from model.hf import load_state

    tok = load_tokenizer(inputs["tokenize"])
    ids, start = reply_ids(tok, "1 + 2 =", plain(" 3"), max_len=64)
    assert tok.decode(ids[start:], skip_special_tokens=True).strip() == "3"
    rm = RewardModel(load_state(inputs["sft"] / "consolidated.safetensors"), inputs_pad(inputs)).eval()
    with torch.no_grad():
        rm.likelihood.weight.copy_(torch.tensor([[1.0, 10.0]]))       # head zero: r = mean + 10 min
        x = torch.tensor([ids])
        lp = torch.log_softmax(rm.backbone(x).logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None])[:, 0]
        reply = lp[start - 1:]
        want = float(reply.mean() + 10 * reply.min())
        # padding a second, longer conversation beside it changes nothing
        other = reply_ids(tok, "a longer question about 4 + 5 here", plain(" 9 and more words"), max_len=64)
        got = rm.score_ids([(ids, start), other])
    assert float(got[0]) == pytest.approx(want, abs=1e-4)


def test_orm_judge_standardises_and_grm_reads_the_expected_verdict(inputs):
    from data_processing.tokenizer import load_tokenizer

    tok = load_tokenizer(inputs["tokenize"])

    class FixedORM:
        def score_ids(self, ids):
            return torch.tensor([3.0, 1.0][: len(ids)])

    j = orm_judge(FixedORM(), tok, 32, mean=1.0, std=2.0)
    assert j([(Task("g", "q", ""), "a"), (Task("g", "q", ""), "b")]) == pytest.approx([1 / (1 + 2.718281828 ** -1), 0.5])
    # each family of prompts on its own scale: a prompt with tools by the tool replies' spread
    from domains.tools import CALCULATOR

    j = orm_judge(FixedORM(), tok, 32, mean=1.0, std=2.0, scales={"plain": {"mean": 1.0, "std": 1.0},
                                                                 "tools": {"mean": 3.0, "std": 8.0}})
    got = j([(Task("g", "q", ""), "a"), (Task("g", "q", "", {"tools": [CALCULATOR]}), "b")])
    assert got == pytest.approx([1 / (1 + 2.718281828 ** -2), 1 / (1 + 2.718281828 ** 0.25)])

    numbers = score_token_ids(tok)
    seven, three = numbers[7][0], numbers[3][0]

    class Engine:                     # the judge puts 0.3 on "7", 0.1 on "3", the rest on words
        def __init__(self, number_mass):
            self.m = number_mass

        def next_token_logprobs(self, prefixes):
            p = torch.full((len(prefixes), tok.get_vocab_size()), 1e-12)
            p[:, seven], p[:, three] = 0.75 * self.m, 0.25 * self.m
            p[:, 0] += 1 - self.m
            return p.log()

    items = [(Task("g", "q", ""), "reply")]
    assert grm_judge(Engine(0.4), tok, "expected")(items)[0] == pytest.approx(0.75 * 0.7 + 0.25 * 0.3, abs=1e-4)
    assert grm_judge(Engine(0.01), tok, "expected", min_number_mass=0.05)(items) == [None]
    with pytest.raises(ValueError, match="scoring"):
        grm_judge(Engine(0.4), tok, "vote")


CALL = "<tool_call>calculator<arg_key>expression</arg_key><arg_value>{}</arg_value></tool_call><|observation|>"


def test_verified_accuracy_checks_only_sources_with_a_safe_checker(inputs):
    from data_processing.tokenizer import load_tokenizer
    from domains.tools import CALCULATOR

    tok = load_tokenizer(inputs["tokenize"])

    def sample(src, answer, text, tools=None):
        meta = {"source": src, **({"tools": tools, "steps": ["24", "72"]} if tools else {})}
        s = Sample(Task("general", "p", answer, meta), 0, [])
        s.text, s.response_ids = text, tok.encode(text).ids
        return s

    call = CALL.format("48 / 2")
    got = verified_accuracy([sample("arithmetic", " 1 9 0", " 1 9 0"), sample("arithmetic", " 1 9 0", " 1 8 0"),
                             sample("gsm8k", "72", "72"), sample("mbpp", "", "def f(): pass"),
                             sample("tool", "72", call, [CALCULATOR]), sample("tool", "72", "It is 72.<|user|>", [CALCULATOR]),
                             sample("tool", "72", call.replace("calculator", "search"), [CALCULATOR]),
                             sample("tool", "72", CALL.format("48 / 3"), [CALCULATOR])], tok)
    # the tool prompts' outcome: a call that computes a step of the solution (48 / 2 = 24 is one;
    # a plain right answer, an undeclared tool and a call computing 16 are not)
    assert got == {"arithmetic": 0.5, "tool_step": pytest.approx(1 / 4)}


def test_tool_rule_pays_a_working_call_above_a_plain_reply_above_a_broken_call():
    from domains.tools import CALCULATOR

    tools = [CALCULATOR]
    assert tool_rule(CALL.format("48 / 2"), tools) == 1.0
    assert tool_rule("It is 24.<|endoftext|>", tools) == 0.5
    assert tool_rule(CALL.format("48 / 2").replace("</arg_value>", ""), tools) == 0.0      # malformed markup
    assert tool_rule(CALL.format("48 / 2").replace("calculator", "calc"), tools) == 0.0    # undeclared tool
    assert tool_rule(CALL.format("48 / 2").replace(">expression<", ">expr<"), tools) == 0.0  # the tool refuses it
    assert tool_rule(CALL.format("48 / (2 - 2)"), tools) == 0.0                           # division by zero
    assert tool_rule(CALL.format("48 / 2"), None) is None
    r = rule_reward(CALL.format("48 / 2"), tools)
    assert r["tool"] == 1.0 and r["rule"] == pytest.approx((r["format"] + r["language"] + 1.0) / 3)
    assert "tool" not in rule_reward("It is 24.<|endoftext|>", None)


def test_a_call_built_to_crash_the_judges_scores_zero():
    """A policy's call whose expression nests past the parser's depth (thousands of chained terms)
    is a call the tool refuses: 0 from the rule, no step, and no exception out of the judges."""
    from domains.tools import CALCULATOR, calculator

    deep = "+".join(["1"] * 5000)
    with pytest.raises(ValueError, match="nested too deeply"):
        calculator(deep)
    assert tool_rule(CALL.format(deep), [CALCULATOR]) == 0.0
    assert not calls_step(CALL.format(deep), [CALCULATOR], ["5000"])


def test_reproduced_steps_keep_only_problems_whose_annotations_the_calculator_reproduces():
    from domains.gsm8k import Problem, calculator_results, reproduced_steps
    from domains.tools import same_number

    ok = Problem("q", "r", "10", (("", "2*5", "10"), ("", "10/4", "2.5")))
    assert reproduced_steps(ok) == ["10", "2.5"]
    wrong = Problem("q", "r", "10", (("", "2*5", "11"),))
    bad = Problem("q", "r", "10", (("", "2 apples", "2"), ("", "3+4", "7")))
    assert reproduced_steps(wrong) is None and reproduced_steps(bad) is None
    assert calculator_results(bad) == [None, "7"]
    assert same_number("1,000", "1000.0000001") and not same_number("10", "11") and not same_number("x", "1")


def test_judge_view_writes_calls_out_for_the_grm():
    from domains.tools import CALCULATOR

    assert judge_view("Let me compute." + CALL.format("48 / 2"), [CALCULATOR]) == \
        'Let me compute.\n[tool call] calculator({"expression": "48 / 2"})'
    assert judge_view(CALL.format("48 / 2").replace("calculator", "calc"), [CALCULATOR]) == "[malformed tool call]"
    assert judge_view("It is 24.<|endoftext|>", [CALCULATOR]) == "It is 24."


def test_judges_see_the_declared_tools_and_the_raw_call(inputs):
    from data_processing.tokenizer import load_tokenizer
    from domains.tools import CALCULATOR
    from rl.rollout import prompt_ids

    tok = load_tokenizer(inputs["tokenize"])
    task = Task("general", "What is 48 / 2?", "24", {"tools": [CALCULATOR]})
    seen = []

    class RecordingORM:
        def score_ids(self, ids):
            seen.extend(ids)
            return torch.zeros(len(ids))

    orm_judge(RecordingORM(), tok, 4096)([(task, CALL.format("48 / 2"))])
    ids, start = seen[0]
    # the ORM reads what the policy saw (its prompt, tools declared) and the call's own tokens
    assert ids[:start] == prompt_ids(tok, task, [CALCULATOR])
    assert ids[start:] == tok.encode(CALL.format("48 / 2"), add_special_tokens=False).ids
    assert tok.token_to_id("<tool_call>") in ids[start:]

    class RecordingEngine:
        def complete(self, prefixes, params, gen):
            seen.append(tok.decode(prefixes[0], skip_special_tokens=True))
            return [(tok.encode(" 7").ids,)] * len(prefixes)

    assert grm_judge(RecordingEngine(), tok)([(task, CALL.format("48 / 2"))]) == [0.7]
    assert "Tools offered: calculator(expression)" in seen[-1]
    assert '[tool call] calculator({"expression": "48 / 2"})' in seen[-1]


def test_reply_ids_is_the_conversation_the_template_encodes(inputs):
    from data_processing.tokenizer import load_tokenizer

    tok = load_tokenizer(inputs["tokenize"])
    user = Message("user", "1 + 2 =", thinking=False)
    whole = encode(tok, [user, Message("assistant", " 3")], thinking_mode="turn").ids
    ids, start = reply_ids(tok, "1 + 2 =", plain(" 3"), max_len=512)
    assert ids == whole and tok.decode(ids[start:], skip_special_tokens=True) == " 3"
    cut, cut_start = reply_ids(tok, "1 + 2 =", plain(" 3"), max_len=5)
    assert cut == whole[-5:] and cut[cut_start:] == whole[start:]


def test_tool_pairs_prefer_the_solutions_call(tmp_path):
    from domains.tools import CALCULATOR

    lines = [{"question": f"Q{i}: Tom has {i + 3} bags of 4 apples. How many?",
              "answer": f"He has {i + 3}*4=<<{i + 3}*4={(i + 3) * 4}>>{(i + 3) * 4} apples.\n#### {(i + 3) * 4}"}
             for i in range(12)]
    lines.insert(3, {"question": "No calls.", "answer": "Just 5.\n#### 5"})
    path = tmp_path / "g.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    pairs = tool_pairs(str(path), 0, 9, seed=0)
    assert len(pairs) == 9 and {p.kind for p in pairs} == {"tool/plain_wrong", "tool/malformed", "tool/wrong_step"}
    assert pairs == tool_pairs(str(path), 0, 9, seed=0)
    steps = {p.prompt: [t.meta["steps"] for t in tool_tasks(str(path), 0) if t.prompt == p.prompt][0] for p in pairs}
    for p in pairs:
        assert p.tools == (CALCULATOR,) and calls_step(p.chosen, [CALCULATOR], steps[p.prompt])
        assert not calls_step(p.rejected, [CALCULATOR], steps[p.prompt]), p
        assert tool_rule(p.rejected, [CALCULATOR]) == {"tool/plain_wrong": 0.5, "tool/malformed": 0.0,
                                                      "tool/wrong_step": 1.0}[p.kind]


def test_hybrid_rewards_give_the_judges_the_raw_reply(inputs):
    from data_processing.tokenizer import load_tokenizer
    from domains.tools import CALCULATOR

    tok = load_tokenizer(inputs["tokenize"])
    s = Sample(Task("general", "What is 48 / 2?", "24", {"tools": [CALCULATOR], "source": "tool", "steps": ["24"]}), 0, [])
    s.response_ids = tok.encode(CALL.format("48 / 2")).ids
    s.text = tok.decode(s.response_ids, skip_special_tokens=True)
    got = []
    judges = {"orm": JudgeService("orm", lambda items: got.extend(r for _, r in items) or [0.5] * len(items), 5.0)}
    hybrid_rewards([s], tok, judges, _cfg(weights={"rule": 1.0, "orm": 1.0}))
    assert "<tool_call>" in got[0] and s.rewards["tool"] == 1.0


def _fake_judges():
    """Deterministic: the ORM likes short replies, the GRM replies with a digit count."""
    return {"orm": lambda items: [1.0 / (1 + len(r)) for _, r in items],
            "grm": lambda items: [None if i % 3 == 0 else (sum(c.isdigit() for c in r) % 11) / 10
                                  for i, (_, r) in enumerate(items)]}


def _cfg(**kw):
    base = dict(steps=2, prompts_per_step=2, group_size=3, optim={"lr": 1e-3}, max_new_tokens=6, length_target=4,
                checkpoint_every=1, gates={"evals": EVALS, "tolerances": {}})
    return RLGeneralConfig(**{**base, **kw})


def test_rl_general_reports_components_disagreement_and_gates(inputs, tmp_path):
    m = run_rl_general(_cfg(), inputs, Workdir.at(tmp_path, seed=2), judges=_fake_judges())
    assert m["steps"] == 2
    assert {"rule", "orm", "grm", "length", "format", "language"} <= set(m["reward_per_component"])
    assert set(m["reward_per_component"]["orm"]) == {"first", "last"}
    assert 0 < m["grm_unparsed_fraction"] < 1 and "any" in m["disagreement"]
    assert set(m["gates"]) == {"rl-general"} and set(m["gates"]["rl-general"]) == set(gates.EVALS)
    out = tmp_path / "out"
    for f in ("consolidated.safetensors", "gates.md", "gates.png", "reward.png", "metrics.jsonl"):
        assert (out / f).exists(), f


def test_rl_general_dynamic_sampling_keeps_the_drawn_figures(inputs, tmp_path):
    m = run_rl_general(_cfg(dynamic_sampling={"max_extra_groups": 2}, overlong={"mode": "filter"}), inputs,
                       Workdir.at(tmp_path, seed=2), judges=_fake_judges())
    rec = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    for r in rec:
        assert 0 <= r["dynamic/extra_groups"] <= 2 and r["dynamic/replaced"] <= r["dynamic/flat_drawn"]
        assert r["overlong/filtered"] == r["overlong/truncated"]
    assert m["batch_shaping"]["dynamic/extra_groups"] == sum(r["dynamic/extra_groups"] for r in rec)


def test_hung_judge_fails_samples_not_the_stage(inputs, tmp_path):
    release = threading.Event()

    def hung(items):
        release.wait(30)
        return [0.5] * len(items)

    t0 = time.perf_counter()
    m = run_rl_general(_cfg(steps=1, grm_timeout_s=0.2), inputs, Workdir.at(tmp_path, seed=2),
                       judges={"orm": _fake_judges()["orm"], "grm": hung})
    release.set()
    assert m["reward_error_fraction"] == 1.0 and m["judge_failures"] == {"grm:timeout": 6}
    assert time.perf_counter() - t0 < 60


def test_broken_gate_fails_the_stage_with_the_table(inputs, tmp_path, monkeypatch):
    real = gates.measure
    calls = []

    def worse_after(model, tok, cfg, seed=0):
        ev = real(model, tok, cfg, seed)
        calls.append(1)
        return ev if len(calls) == 1 else {**ev, "heldout_ppl": ev["heldout_ppl"] * 2}

    monkeypatch.setattr(gates, "measure", worse_after)
    cfg = _cfg(steps=1, gates={"evals": EVALS, "tolerances": {"heldout_ppl": 0.1}})
    with pytest.raises(gates.GateError, match=r"heldout_ppl .*\*\*NO\*\*"):
        run_rl_general(cfg, inputs, Workdir.at(tmp_path, seed=2), judges=_fake_judges())
    assert not (tmp_path / "out" / "consolidated.safetensors").exists()   # no model published
    assert (tmp_path / "out" / "gates.md").exists()


def test_pairwise_agreement_counts_right_over_wrong_pairs_per_prompt():
    from posttrain.rl_general import pairwise_agreement
    from rl.sample import Sample

    samples = [Sample(Task("general", "p", "1"), g, [1]) for g in (0, 0, 0, 1, 1)]
    outcome = [1.0, 0.0, 0.0, 1.0, 1.0]               # prompt 1: both right, no pair
    acc, pairs = pairwise_agreement(samples, [0.9, 0.1, 0.9, 0.2, 0.3], outcome)
    assert pairs == 2 and acc == 0.75                  # one ordered right, one tie
    assert pairwise_agreement(samples, [None, 0.1, 0.9, 0.2, 0.3], outcome) == (pytest.approx(float("nan"), nan_ok=True), 0)


def test_rl_general_scores_its_judges_against_the_verified_outcome_before_training(inputs, tmp_path):
    m = run_rl_general(_cfg(steps=1, judge_eval=4, judge_eval_samples=3), inputs, Workdir.at(tmp_path, seed=2),
                       judges=_fake_judges())
    j = m["judge_accuracy"]
    assert j["prompts"] == 4 and j["samples"] == 3 and 0 <= j["verified_share"] <= 1
    assert set(j["judges"]) == {"rule", "orm", "grm", "reward"}
    for v in j["judges"].values():
        assert v["pairs"] >= 0 and (v["pairwise"] is None or 0 <= v["pairwise"] <= 1)
