"""Each reward on hand-made right and wrong responses, and the worker's timeout/error/cleanup."""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest

from chat.template import ASSISTANT, EOS, OBSERVATION, Message, ToolCall, assistant_text
from domains.tools import DocIndex, calculator, stdlib_functions
from posttrain.sft_data import SFTDataConfig
from rl.rewards import REWARDS, RewardWorker, Task, equivalent, score_sample
from rl.sandbox import isolation

REPO = Path(__file__).resolve().parents[2]


def first_gsm8k() -> dict:
    return json.loads((REPO / "samples/gsm8k/train_first200.jsonl").read_text().splitlines()[0])


def mbpp(task_id: int) -> dict:
    for line in (REPO / "samples/mbpp/mbpp.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["task_id"] == task_id:
            return rec
    raise KeyError(task_id)


def code_task(rec: dict, **meta) -> Task:
    return Task("code", rec["text"], "", {"tests": rec["test_list"], "setup": rec["test_setup_code"],
                                          "task_id": rec["task_id"], **meta})


def score(text: str, task: Task):
    out = score_sample(text, task)
    assert out.status == "ok", out
    return out


def test_registry_has_every_domain():
    assert {"arithmetic", "math", "code", "tool"} <= set(REWARDS)


def test_arithmetic():
    t = Task("arithmetic", " 3 4 + 5 7 =", " 1 9 0", {})
    assert score(" 1 9 0<|endoftext|>", t).score == 1.0
    assert score("190", t).score == 1.0
    assert score(" 1 9 0 + junk", t).score == 1.0           # digits stop at the first other character
    assert score(" 1 9 1", t).reason == "wrong answer"
    assert score(" 1 9", t).score == 0.0                     # a prefix is not the answer
    assert score(" 1 9 0 5", t).score == 0.0
    assert score("abc 1 9 0", t).reason == "no answer found"


def test_math_gsm8k_line():
    rec = first_gsm8k()
    answer = rec["answer"].rpartition("####")[2].strip()
    t = Task("math", rec["question"], answer, {})
    assert answer == "72"
    assert score(rec["answer"], t).reason == "correct"                        # the reference itself
    assert score(rec["answer"].replace("#### 72", "#### 73"), t).score == 0.0
    assert score("<think>48/2 = 24, 48 + 24 = 72</think>So she sold \\boxed{72} clips.", t).score == 1.0
    assert score("<think>maybe 72</think>I am not sure.", t).reason == "no answer found"
    assert score("<think>the answer is 72, unterminated", t).reason == "no answer found"
    out = score("She sold 24 in May and 72 in total", t)
    assert (out.score, out.reason) == (1.0, "correct (no marked answer)")
    assert score("#### 72 clips\nthen a trailing 5", t).score == 1.0
    assert score("I think 71 and \\boxed{70}", t).score == 0.0


def test_math_normalisation_and_symbolic():
    assert score("#### $1,000.", Task("math", "", "1000", {})).score == 1.0
    assert score("#### 12.5%", Task("math", "", "12.5", {})).score == 1.0
    assert score("#### 0.3333333", Task("math", "", "0.33333333", {})).score == 1.0   # 1e-6 relative
    assert score("#### 0.333", Task("math", "", "0.33333333", {})).score == 0.0
    assert score("\\boxed{\\frac{1}{2}}", Task("math", "", "1/2", {})).score == 1.0
    assert score("\\boxed{2\\sqrt{2}}", Task("math", "", "sqrt(8)", {})).score == 1.0
    assert score("\\boxed{x^2 + 2x + 1}", Task("math", "", "(x+1)^2", {})).score == 1.0
    assert score("\\boxed{x^2 + 1}", Task("math", "", "(x+1)^2", {})).score == 0.0


def test_math_never_evaluates_code():
    marker = f"/tmp/0{uuid.uuid4().hex}"       # its first number is the answer, 0
    evil = f"__import__('os').system('touch {marker}')"
    assert not equivalent(evil, "0")
    assert score(f"\\boxed{{{evil}}}", Task("math", "", "0", {})).score == 0.0
    assert not os.path.exists(marker)


def test_math_takes_a_number_out_of_words_only():
    t = Task("math", "", "72", {})
    assert score("\\boxed{72 clips}", t).score == 1.0
    assert score("#### 72 hours per week.", t).score == 1.0
    assert score("\\boxed{f(72)}", t).score == 0.0
    assert score("\\boxed{72 or 80}", t).score == 0.0
    assert score("#### x = 72 - 1", t).score == 0.0


def test_code_mbpp_reference_passes_and_broken_fails():
    rec = mbpp(1)
    t = code_task(rec)
    ok = score(f"<think>dynamic programming</think>Here:\n```python\n{rec['code']}\n```\nDone.", t)
    assert (ok.score, ok.reason) == (1.0, f"all {len(rec['test_list'])} tests passed")
    broken = rec["code"].replace("min(", "max(")
    bad = score(f"```python\n{broken}\n```", t)
    assert bad.score == 0.0 and bad.reason.startswith("3 of 3 tests failed: assert min_cost("), bad
    assert "(returned " in bad.reason                       # the value the trusted side compared
    eight = score("def min_cost(cost, m, n):\n    return 8", t)   # the first test's answer only
    assert eight.score == 0.0 and eight.reason.startswith("2 of 3 tests failed: " + rec["test_list"][1][:30]), eight
    raised = score("```python\nraise RuntimeError('nope')\n```", t)
    assert raised.score == 0.0 and "solution raised RuntimeError: nope" in raised.reason, raised
    # Exiting early (with success) or printing a fake report is not a pass.
    cheat = score("import os, sys\nprint('done')\nos._exit(0)", t)
    assert cheat.score == 0.0 and "no readable result" in cheat.reason, cheat
    assert score("import sys\nsys.exit(0)", t).score == 0.0


def test_code_setup_and_sandbox_limits():
    rec = next(json.loads(line) for line in (REPO / "samples/mbpp/mbpp.jsonl").read_text().splitlines()
               if json.loads(line)["test_setup_code"])
    assert score(rec["code"], code_task(rec)).score == 1.0          # setup code runs before the asserts
    t = code_task(mbpp(1), timeout_s=1)
    hang = score("while True: pass", t)
    assert hang.score == 0.0 and "timeout" in hang.reason.lower()    # the run's deadline or a call's, under load
    with pytest.raises(ValueError, match="meta\\['tests'\\]"):
        REWARDS["code"]("x", Task("code", "", "", {"task_id": 7}))
    assert score_sample("x", Task("code", "", "", {"task_id": 7})).status == "error"


def tool_transcript(calls: list[tuple[str, dict, str]], final: str) -> str:
    """The assistant side of a tool rollout in the chat template's format."""
    text = ""
    for name, args, response in calls:
        text += assistant_text(Message("assistant", reasoning=f"call {name}", tool_calls=(ToolCall(name, args),)))
        text += f"{OBSERVATION}<tool_response>\n{response}\n</tool_response>{ASSISTANT}"
    return text + assistant_text(Message("assistant", final, reasoning="done")) + EOS


def test_tool_calculator():
    rec = first_gsm8k()
    t = Task("tool", rec["question"], "72", {})
    good = tool_transcript([("calculator", {"expression": "48/2"}, calculator("48/2")),
                            ("calculator", {"expression": "48+24"}, calculator("48+24"))], "The answer is 72.")
    out = score(good, t)
    assert (out.score, out.reason) == (1.0, "correct after 2 tool calls")
    assert score(good.replace("The answer is 72.", "The answer is 71."), t).score == 0.0
    forged = tool_transcript([("calculator", {"expression": "48/2"}, "25")], "The answer is 72.")
    assert "not what calculator returns" in score(forged, t).reason
    assert "at least 1" in score(assistant_text(Message("assistant", "The answer is 72.")) + EOS, t).reason
    unclosed = good.replace("</tool_call>", "", 1)
    assert score(unclosed, t).reason.startswith("malformed")
    stopped = assistant_text(Message("assistant", tool_calls=(ToolCall("calculator", {"expression": "1+1"}),))) + OBSERVATION
    assert score(stopped, t).reason == "no final answer after the tool calls"
    unknown = tool_transcript([("shell", {"cmd": "ls"}, "x")], "The answer is 72.")
    assert score(unknown, t).score == 0.0


def test_tool_search_docs():
    doc = DocIndex(stdlib_functions(), SFTDataConfig().max_doc_chars).search("textwrap.dedent")
    t = Task("tool", "What does textwrap.dedent do?", "It removes common leading whitespace.", {})
    good = tool_transcript([("search_docs", {"query": "textwrap.dedent"}, doc)], "It removes common leading whitespace.")
    assert score(good, t).score == 1.0
    assert score(good.replace("Remove any common", "Add any common"), t).score == 0.0


def test_worker_batches_times_out_and_recovers():
    arith = Task("arithmetic", "", " 1 9 0", {})
    samples = [(" 1 9 0", arith), ("x", Task("test_sleep_forever", "", "", {})), (" 1 9 1", arith),
               ("hello", Task("test_raise", "", "", {})), ("y", Task("test_bad_score", "", "", {})),
               ("z", Task("nope", "", "", {})), (" 1 9 0", arith)]
    with RewardWorker(imports=["tests.rl.reward_fixtures"]) as w:
        first_pid = w.pid
        t0 = time.monotonic()
        out = w.score(samples, timeout_s=1.0)
        assert time.monotonic() - t0 < 20
        assert [o.status for o in out] == ["ok", "timeout", "ok", "error", "error", "error", "ok"]
        assert [o.score for o in out] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert out[1].reason == "timeout after 1s"
        assert out[3].reason == "ValueError: boom on 'hello'"
        assert "score in [0, 1]" in out[4].reason and "no reward registered" in out[5].reason
        assert w.restarts == 1 and w.pid != first_pid
        assert not Path(f"/proc/{first_pid}").exists()
        last_pid = w.pid
    assert w.pid is None and not Path(f"/proc/{last_pid}").exists()


def test_worker_throughput_uses_one_round_trip():
    arith = Task("arithmetic", "", " 1 9 0", {})
    with RewardWorker() as w:
        t0 = time.monotonic()
        out = w.score([(" 1 9 0", arith)] * 200, timeout_s=5)
        assert time.monotonic() - t0 < 5          # ~0.05 s here; a process per sample would take minutes
        assert all(o.score == 1.0 for o in out)
        if isolation()["python"]:
            rec = mbpp(1)
            outs = w.score([(rec["code"], code_task(rec)), (rec["code"].replace("min(", "max("), code_task(rec))], 30)
            assert [o.score for o in outs] == [1.0, 0.0]


def test_worker_import_failure_is_reported():
    with pytest.raises(RuntimeError, match="no_such_module_xyz"):
        RewardWorker(imports=["no_such_module_xyz"])
