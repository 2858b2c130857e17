"""Agentic RL environments on scripted tool calls: right actions get reward 1, wrong ones 0, every
command runs in the sandbox with its limits, context management elides and forks, and the
environments travel to another process."""
from __future__ import annotations

import ast
import json
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chat.template import EOS, OBSERVATION, Message, ToolCall, assistant_text
from domains import arithmetic
from rl.agent import run_group
from rl.envs import ENVIRONMENTS, make_env, swe_repair, tasks_for, terminal
from rl.envs.context import (
    ELIDED,
    TemplateTokenCounter,
    context_manager,
    manage_context,
)
from rl.rollout import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def test_registry_and_splits():
    assert {"swe_repair", "terminal", "search", "calc_arith"} <= set(ENVIRONMENTS)
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        make_env("nope")
    with pytest.raises(ValueError, match="split"):
        tasks_for("calc_arith", "test", 1, 0)
    for name in ("swe_repair", "search", "calc_arith"):
        train = tasks_for(name, "train", 50, 0)
        held = tasks_for(name, "heldout", 10_000, 0)
        assert len(train) == 50 and held and all(t.domain == name for t in train + held)
        assert not {t.prompt for t in train} & {t.prompt for t in held}, name
        assert tasks_for(name, "train", 5, 1) == tasks_for(name, "train", 5, 1)   # seeded
    for t in tasks_for("terminal", "train", 5, 0) + tasks_for("swe_repair", "train", 5, 0):
        assert json.loads(json.dumps(t.meta)) == t.meta                           # travels over the wire


# ---------------------------------------------------------------- calc_arith
def test_calc_arith_rewards_the_final_answer():
    (task,) = [t for t in tasks_for("calc_arith", "train", 200, 0) if t.meta["a"] + t.meta["b"] < 100][:1]
    a, b = task.meta["a"], task.meta["b"]
    env = make_env("calc_arith")
    assert env.reset(task) == task.prompt
    r = env.step([ToolCall("calculator", {"expression": f"{a}+{b}"}), ToolCall("calc", {})])
    assert r.observations[0] == str(a + b) and r.observations[1].startswith("error: no such tool")
    assert env.final_reward(task.answer).score == 1.0
    assert env.final_reward(" 9" + task.answer).score == 0.0
    assert env.final_reward("").score == 0.0
    rev = make_env("calc_arith", reverse_digits=True)
    rev.reset(task)
    assert rev.step([ToolCall("calculator", {"expression": f"{a} + {b}"})]).observations == [task.answer]
    assert rev.prompt_tools == rev.tools and make_env("calc_arith", schema_in_prompt=False).prompt_tools is None
    (t3,) = tasks_for("calc_arith3", "heldout", 1, 0)
    assert t3.domain == "calc_arith3" and t3.meta["digits"] == 3 and len(t3.answer.split()) == 4
    e3 = make_env("calc_arith3", reverse_digits=True)
    e3.reset(t3)
    assert e3.step([ToolCall("calculator", {"expression": t3.prompt.strip(" =")})]).observations == [t3.answer]
    # the prompt's notation: digits one token each, "3 4 + 5 7" is 34 + 57
    assert rev.step([ToolCall("calculator", {"expression": task.prompt.strip(" =")})]).observations == [task.answer]
    # four digits: 81M pairs, drawn without listing them, on the same split by hash
    train4, held4 = tasks_for("calc_arith4", "train", 300, 0), tasks_for("calc_arith4", "heldout", 300, 0)
    assert {t.meta["digits"] for t in train4 + held4} == {4} and len(train4[0].answer.split()) == 5
    assert not any(arithmetic.is_heldout(t.meta["a"], t.meta["b"]) for t in train4)
    assert all(arithmetic.is_heldout(t.meta["a"], t.meta["b"]) for t in held4)
    assert len({t.prompt for t in held4}) == 300 and tasks_for("calc_arith4", "heldout", 300, 0) == held4
    e4 = make_env("calc_arith4", reverse_digits=True)
    e4.reset(held4[0])
    assert e4.step([ToolCall("calculator", {"expression": held4[0].prompt.strip(" =")})]).observations == [held4[0].answer]


class ScriptedEngine:
    def __init__(self, turns):
        self.turns, self.version = list(turns), 0

    def complete(self, prefixes, params, generator, keys=None):
        ids = self.turns.pop(0)
        return [(list(ids), [-0.5] * len(ids), True, [self.version] * len(ids)) for _ in prefixes]


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


def _call_text(tool, **args):
    return assistant_text(Message("assistant", tool_calls=(ToolCall(tool, args),))).removeprefix("<think></think>")


def test_calc_arith_episode_through_run_group(tokenizer):
    task = tasks_for("calc_arith", "train", 1, 3)[0]
    a, b = task.meta["a"], task.meta["b"]
    turns = [_ids(tokenizer, _call_text("calculator", expression=f"{a}+{b}") + OBSERVATION),
             _ids(tokenizer, task.answer + EOS)]
    (s,) = run_group(ScriptedEngine(turns), tokenizer, lambda: make_env("calc_arith"), task, 0, 1,
                     SamplingParams(), max_turns=4, seed=0)
    assert s.reward == 1.0 and "after 1 tool calls" in s.reward_reason


# ---------------------------------------------------------------- search
def test_search_finds_the_function_and_scores_the_name():
    task = tasks_for("search", "train", 1, 0)[0]
    env = make_env("search")
    env.reset(task)
    hits = env.step([ToolCall("search", {"query": task.meta["summary"]})]).observations[0]
    assert task.answer in hits.splitlines()[0]
    doc = env.step([ToolCall("open", {"name": task.answer}), ToolCall("open", {})]).observations
    assert task.meta["summary"].split()[0] in doc[0] and doc[1].startswith("error:")
    bare = task.answer.rsplit(".", 1)[1]
    for good in (task.answer, bare, f"`{bare}()`", f"{task.answer}."):
        assert env.final_reward(good).score == 1.0, good
    other = next(t.answer for t in tasks_for("search", "train", 50, 1) if t.answer != task.answer)
    assert env.final_reward(other).score == 0.0
    assert env.final_reward(f"{bare} or {other}").score == 0.0
    assert bare not in re.findall(r"\w+", task.meta["summary"])           # the question does not name it


# ---------------------------------------------------------------- manage_context
def _history(n_tools):
    msgs = [Message("system", "sys"), Message("user", "find it", thinking=False)]
    for i in range(n_tools):
        msgs += [Message("assistant", tool_calls=(ToolCall("search", {"query": f"q{i}"}),)),
                 Message("tool", f"result {i} " + "x" * 40)]
    return msgs


def test_manage_context_keeps_recent_k_and_forks_only_on_rewrite():
    chars = lambda ms: sum(len(m.content) for m in ms)           # noqa: E731
    msgs = _history(2)
    same, forked = manage_context(msgs, keep_recent=2, max_tokens=None, count_tokens=chars)
    assert same == msgs and not forked
    out, forked = manage_context(_history(4), keep_recent=2, max_tokens=None, count_tokens=chars)
    tools = [m.content for m in out if m.role == "tool"]
    assert forked and tools[:2] == [ELIDED, ELIDED] and tools[2].startswith("result 2") and tools[3].startswith("result 3")
    again, forked = manage_context(out, keep_recent=2, max_tokens=None, count_tokens=chars)
    assert again == out and not forked                          # already elided: no second fork
    # reset at the threshold: system + the task, with a note; over it again, still one note
    reset, forked = manage_context(_history(4), keep_recent=2, max_tokens=60, count_tokens=chars)
    assert forked and [m.role for m in reset] == ["system", "user"]
    assert reset[1].content.startswith("find it\n\n[Context reset: 8 earlier messages")
    longer = reset + _history(3)[2:]
    reset2, forked = manage_context(longer, keep_recent=2, max_tokens=60, count_tokens=chars)
    assert forked and reset2[1].content.count("[Context reset") == 1 and not reset2[1].thinking
    with pytest.raises(ValueError):
        manage_context(msgs, keep_recent=-1, max_tokens=None, count_tokens=chars)


def test_search_episode_forks_when_context_elides(tokenizer):
    task = tasks_for("search", "train", 1, 0)[0]
    q = task.meta["summary"].split()[0]
    turns = [_ids(tokenizer, _call_text("search", query=q) + OBSERVATION),
             _ids(tokenizer, _call_text("open", name=task.answer) + OBSERVATION),
             _ids(tokenizer, task.answer + EOS)]
    env = make_env("search")
    ctx = context_manager(1, None, TemplateTokenCounter(tokenizer, env.tools))
    samples = run_group(ScriptedEngine(turns), tokenizer, lambda: make_env("search"), task, 0, 1, SamplingParams(),
                        max_turns=5, seed=0, context=ctx)
    assert len(samples) == 2 and all(s.reward == 1.0 for s in samples)   # one fork: the first result elided
    assert ELIDED in tokenizer.decode(samples[1].prompt_ids, skip_special_tokens=False)
    assert TemplateTokenCounter(tokenizer, env.tools)(_history(1)) > TemplateTokenCounter(tokenizer, env.tools)(_history(0))


# ---------------------------------------------------------------- terminal
def _solution(task):
    p, tpl = task.prompt, task.meta["template"]
    if tpl == "count_lines":
        city = re.search(r"contain (\w+) and", p).group(1)
        return [f"grep -c {city} data.csv > answer.txt"]
    if tpl == "replace_word":
        old, new = re.search(r"Replace the word (\w+) with (\w+)", p).groups()
        return [f"sed -i 's/{old}/{new}/g' src/*.py"]
    return {"sum_column": ["awk -F, 'NR>1{s+=$3} END{print s}' data.csv > total.txt"],
            "largest_file": ["ls -S logs | head -1 > answer.txt"],
            "rename_ext": ['for f in notes/*.txt; do mv "$f" "${f%.txt}.md"; done'],
            "sort_unique": ["sort -u names.txt > sorted.txt"],
            "count_ext": ["find project -name '*.py' | wc -l > answer.txt"],
            "error_codes": ["grep '^ERROR' app.log | cut -d' ' -f2 | sort -u > errors.txt"],
            "backup": ["mkdir backup", "cp conf/*.cfg backup/"],
            "make_exec": ["chmod +x tool.sh", "./tool.sh > out.txt"]}[tpl]


def test_terminal_every_template_solved_by_commands_and_not_without():
    tasks = tasks_for("terminal", "heldout", len(terminal.TEMPLATES), 0)
    assert {t.meta["template"] for t in tasks} == set(terminal.TEMPLATES)
    for task in tasks:
        env = make_env("terminal")
        env.reset(task)
        if task.meta["template"] == "count_lines":
            assert env.final_reward("").score == 0.0                    # nothing done yet
        for cmd in _solution(task):                                      # state persists between runs
            obs = env.step([ToolCall("run", {"command": cmd})]).observations[0]
            assert obs.endswith("[exit code 0]"), (task.meta["template"], cmd, obs)
        out = env.final_reward("done")
        assert out.score == 1.0, (task.meta["template"], out)
        if task.meta["template"] in ("count_lines", "sort_unique"):
            target = "answer.txt" if task.meta["template"] == "count_lines" else "sorted.txt"
            env.step([ToolCall("run", {"command": f"echo 999 >> {target}"})])
            assert env.final_reward("done").score == 0.0


def test_terminal_commands_run_in_the_sandbox_with_limits():
    task = tasks_for("terminal", "train", 1, 0)[0]
    env = make_env("terminal", wall_s=1.0)
    env.reset(task)
    t0 = time.monotonic()
    obs = env.step([ToolCall("run", {"command": "echo kept > a.txt; sleep 100"})]).observations[0]
    assert "timed out" in obs and time.monotonic() - t0 < 10
    assert "No such file" in env.run("cat a.txt")                      # the timed-out run's changes are gone
    assert "[exit code 0]" not in env.run("touch /etc/glmforge-escape")  # outside the folder is read-only
    assert env.run("id -u").split()[0] != "0"                           # not root


# ---------------------------------------------------------------- swe_repair
def _f2p_p2p(env):
    lines = env.step([ToolCall("run_tests", {})]).observations[0].splitlines()
    return {ln.split()[0]: ln.split()[1] == "PASSED" for ln in lines if ln.startswith("test_")}


def test_swe_repair_bug_fails_its_tests_and_the_fix_passes():
    tasks = tasks_for("swe_repair", "heldout", 3, 0)
    assert len(swe_repair.load_instances()) > 200
    for task in tasks[:2]:
        env = make_env("swe_repair")
        env.reset(task)
        assert task.meta["fail_to_pass"]
        verdict = _f2p_p2p(env)
        assert all(not verdict[t] for t in task.meta["fail_to_pass"])
        assert all(verdict[t] for t in task.meta["pass_to_pass"])
        assert env.step([ToolCall("read_file", {"path": "solution.py"})]).observations[0] == task.meta["files"]["solution.py"]
        assert env.final_reward("done").score == 0.0
        # editing the tests does not count: the reward runs the original test file
        env.step([ToolCall("write_file", {"path": "test_solution.py", "content": "def test_0():\n    pass\n"})])
        assert env.final_reward("done").score == 0.0
        obs = env.step([ToolCall("write_file", {"path": "solution.py", "content": task.answer}),
                        ToolCall("read_file", {"path": "../etc/passwd"})]).observations
        assert obs[0].startswith("wrote solution.py") and obs[1].startswith("error:")
        out = env.final_reward("fixed")
        assert out.score == 1.0, out


def test_swe_repair_instances_rebuild_identically():
    shipped = {d["task_id"]: d for d in swe_repair.load_instances()}
    recs = {r["task_id"]: r for r in swe_repair.read_mbpp(ROOT / "samples/mbpp/mbpp.jsonl")}
    assert set(shipped) <= set(recs) and min(shipped) >= 601
    for tid in sorted(shipped)[:2]:
        assert swe_repair.build_instance(recs[tid]) == shipped[tid]


def test_mutations_change_one_token():
    src = "def f(xs, n):\n    return [x + 1 for x in range(1, n + 1) if x < n and True] + [max(xs)]\n"
    n = len(list(swe_repair.sites(ast.parse(src))))
    mutants = [swe_repair.mutate(src, k) for k in range(n)]
    assert {desc.split()[0] for _, desc in mutants} == set(swe_repair.MUTATIONS)
    assert all(m != ast.unparse(ast.parse(src)) + "\n" for m, _ in mutants)
    sources = "".join(m for m, _ in mutants)
    assert "range(1, n)" in sources and "range(2, n + 1)" in sources and "min(xs)" in sources


# ---------------------------------------------------------------- other processes
_CHILD = r"""
import json, pickle, sys
from rl.envs import make_env, ToolCall
jobs = pickle.loads(sys.stdin.buffer.read())
out = []
for env, calls, answer in jobs:
    obs = env.step(calls).observations if calls else []
    out.append([obs, env.final_reward(answer).score])
fresh = make_env("calc_arith")
print(json.dumps({"results": out, "fresh": fresh.name}))
"""


def test_environments_pickle_into_another_process():
    jobs = []
    calc = tasks_for("calc_arith", "train", 1, 0)[0]
    e = make_env("calc_arith")
    e.reset(calc)
    jobs.append((e, [ToolCall("calculator", {"expression": "2+3"})], calc.answer))
    srch = tasks_for("search", "train", 1, 0)[0]
    e = make_env("search")
    e.reset(srch)
    jobs.append((e, [], srch.answer))
    swe = tasks_for("swe_repair", "train", 1, 0)[0]
    e = make_env("swe_repair")
    e.reset(swe)
    e.step([ToolCall("write_file", {"path": "solution.py", "content": swe.answer})])
    jobs.append((e, [], ""))
    term = next(t for t in tasks_for("terminal", "heldout", 10, 0) if t.meta["template"] == "make_exec")
    e = make_env("terminal")
    e.reset(term)
    e.step([ToolCall("run", {"command": "chmod +x tool.sh"})])          # state made here, used there
    jobs.append((e, [ToolCall("run", {"command": "./tool.sh > out.txt"})], ""))
    r = subprocess.run([sys.executable, "-c", _CHILD], input=pickle.dumps(jobs), capture_output=True, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    got = json.loads(r.stdout)
    assert got["fresh"] == "calc_arith"
    assert got["results"][0] == [["5"], 1.0]
    assert [x[1] for x in got["results"][1:]] == [1.0, 1.0, 1.0]
