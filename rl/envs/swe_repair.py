"""swe_repair: SWE-style repair of a small repository with failing tests, built from MBPP.

An instance is a two-file repository:
    solution.py        the MBPP reference solution (training ids 601-974 only; ast.unparse'd, so
                       the bug is a one-token diff) with one bug injected by an AST mutation
    test_solution.py   `from solution import *`, the task's setup code, and one test_<i> function
                       per MBPP assert
FAIL_TO_PASS are the tests the bug breaks, PASS_TO_PASS the rest. Mutations (MUTATIONS): a flipped
comparison (< <=, > >=, == !=), a wrong arithmetic operator, an off-by-one range() bound, an int
constant + 1, and/or swapped, True/False swapped, a swapped call (min/max, any/all,
upper/lower, startswith/endswith, append -> insert(0, .), sort -> reverse). Sites are tried in an order seeded by the task
id; the first mutant that fails at least one assert (while the reference passes all) is the
instance; a task with no such mutant among the first MAX_TRIES, or whose reference fails, is
skipped. Reference and mutants run in rl.sandbox (one run per task, SIGALRM per test inside).

Building takes minutes (one sandbox run per task), so the instances are built once and shipped in
rl/envs/data/swe_repair_mbpp.jsonl (`python -m rl.envs build-swe-repair`, deterministic; the
tests rebuild a few and compare). It is derived from samples/mbpp/mbpp.jsonl (CC-BY-4.0, see
samples/SOURCES.md): 374 training tasks -> 283 instances (91 skipped: most have no mutable site,
e.g. one-line library calls); in 199 of them the bug fails every assert (PASS_TO_PASS empty).

Tools: read_file(path), write_file(path, content), run_tests() (the workspace's test file, so the
model sees what it changed). The reward splits each test of the original test file into the call
the model's code must answer and the check made by trusted code (rl.verify): the final
repository runs in a fresh sandbox and hands back each call's value, and this process compares it
with the expected value, so an edited test file, printed "ok" lines, a patched print or an
atexit handler count for nothing. 1 iff every FAIL_TO_PASS and PASS_TO_PASS test passes.
recheck() runs the reference and the final repository on fresh inputs (rl.verify.recheck).

SWE-bench Lite (samples/swebench_lite: 73 instances, dev + a 50-instance test sample): every
instance's patch touches a single file, but none is feasible without the upstream repository. A
record holds only the diff hunks of that file, not the file at base_commit, and its FAIL_TO_PASS
tests import the whole project (django, sympy, astropy, ...) with its dependencies, none of which
is shipped or fetchable on the training machines. So no instance is built from them.
"""
from __future__ import annotations

import ast
import json
import random
import re
import zlib
from pathlib import Path
from typing import Sequence

from chat.template import ToolCall
from domains.task import Task
from rl.envs.base import StepResult, check_args, draw, function_spec, register_env
from rl.rewards import RewardOutcome, recheck_outcome
from rl.sandbox import SandboxLimits, run_python
from rl.swe.mutate import MUTATIONS, apply_mutation, sites  # noqa: F401 (MUTATIONS: the families, re-exported)
from rl.verify import CallCheck, checks_from_asserts, judge, recheck, run_calls

MBPP_TRAIN_IDS = range(601, 975)
DATA = Path(__file__).with_name("data") / "swe_repair_mbpp.jsonl"
MAX_TRIES = 12
TEST_TIMEOUT_S = 2
HELDOUT_PER_MILLE = 200
MAX_FILE_CHARS = 64 * 1024



def mutate(source: str, k: int) -> tuple[str, str]:
    """(mutated source, description) for the k-th site of sites."""
    tree = ast.parse(source)
    kind, node, sub = list(sites(tree))[k]
    desc = apply_mutation(kind, node, sub)
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n", desc


def split_test_file(text: str) -> tuple[str, dict[str, str]]:
    """test_file's output -> (setup code, {test name: assert line}): the inverse of test_file."""
    body = ast.parse(text).body
    if not body or not (isinstance(body[0], ast.ImportFrom) and body[0].module == "solution"):
        raise ValueError("a swe_repair test file starts with `from solution import *`")
    setup, tests = [], {}
    for node in body[1:]:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            if len(node.body) != 1 or not isinstance(node.body[0], ast.Assert):
                raise ValueError(f"{node.name} is not a single assert")
            tests[node.name] = ast.unparse(node.body[0])
        else:
            setup.append(ast.unparse(node))
    return "\n".join(setup), tests


def test_checks(task: Task) -> tuple[str, dict[str, CallCheck]]:
    """The original tests of an instance as sandboxed calls with trusted checks."""
    setup, tests = split_test_file(task.meta["files"]["test_solution.py"])
    return setup, dict(zip(tests, checks_from_asserts(list(tests.values()))))


def test_file(setup: str, tests: Sequence[str]) -> str:
    body = "".join(f"\n\ndef test_{i}():\n    {t.strip()}\n" for i, t in enumerate(tests))
    return f"from solution import *\n{setup.strip()}\n{body}"


# Runs the tests of test_solution.py one by one, each under SIGALRM; one JSON line per test.
RUNNER = r"""import json, os, signal, sys, traceback
sys.path.insert(0, os.getcwd())
sys.setrecursionlimit(3000)
def alarm(*_):
    raise TimeoutError("test took longer than %ds")
signal.signal(signal.SIGALRM, alarm)
names = json.loads(sys.argv[1]) if len(sys.argv) > 1 else None
try:
    signal.alarm(%d)
    import test_solution as T
    signal.alarm(0)
except BaseException as e:
    print(json.dumps({"test": "<import>", "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}))
    sys.exit(0)
for name in sorted((n for n in dir(T) if n.startswith("test_") and callable(getattr(T, n))),
                   key=lambda n: (len(n), n)):
    try:
        signal.alarm(%d)
        getattr(T, name)()
        signal.alarm(0)
        print(json.dumps({"test": name, "ok": True}), flush=True)
    except BaseException as e:
        signal.alarm(0)
        print(json.dumps({"test": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
""" % (TEST_TIMEOUT_S, TEST_TIMEOUT_S, TEST_TIMEOUT_S)

# The builder's sandbox program: reference first, then mutants in order until one qualifies.
_BUILD = r"""import json, signal, sys, types
sys.setrecursionlimit(3000)
def alarm(*_):
    raise TimeoutError
signal.signal(signal.SIGALRM, alarm)
job = json.load(open("job.json"))
def run(src):
    out = []
    try:
        signal.alarm(%d)
        mod = types.ModuleType("solution")
        exec(compile(src, "solution.py", "exec"), mod.__dict__)
        ns = {k: v for k, v in mod.__dict__.items() if not k.startswith("_")}
        exec(job["setup"], ns)
        signal.alarm(0)
    except BaseException:
        signal.alarm(0)
        return [False] * len(job["tests"])
    for t in job["tests"]:
        try:
            signal.alarm(%d)
            exec(t, dict(ns))
            signal.alarm(0)
            out.append(True)
        except BaseException:
            signal.alarm(0)
            out.append(False)
    return out
ref = run(job["reference"])
print(json.dumps({"k": -1, "ok": ref}), flush=True)
if all(ref):
    for k, src in job["mutants"]:
        ok = run(src)
        print(json.dumps({"k": k, "ok": ok}), flush=True)
        if not all(ok):
            break
""" % (TEST_TIMEOUT_S, TEST_TIMEOUT_S)


def build_instance(rec: dict) -> dict | None:
    """One MBPP record -> a repair instance (JSON), or None when no mutant qualifies."""
    tid = int(rec["task_id"])
    try:
        reference = ast.unparse(ast.parse(rec["code"].replace("\r\n", "\n").replace("\t", "    "))) + "\n"
    except SyntaxError:
        return None
    n_sites = len(list(sites(ast.parse(reference))))
    order = list(range(n_sites))
    random.Random(tid).shuffle(order)
    mutants, seen = [], {reference}
    for k in order:
        src, desc = mutate(reference, k)
        if src not in seen:                       # e.g. a constant that unparses the same
            seen.add(src)
            mutants.append((k, src, desc))
        if len(mutants) == MAX_TRIES:
            break
    if not mutants:
        return None
    setup = (rec.get("test_setup_code") or "").replace("\r\n", "\n")
    tests = [t.replace("\r\n", "\n").strip() for t in rec["test_list"]]
    job = {"reference": reference, "setup": setup, "tests": tests, "mutants": [(k, s) for k, s, _ in mutants]}
    r = run_python(_BUILD, SandboxLimits(wall_s=60, cpu_s=60, memory_mb=1024), {"job.json": json.dumps(job)})
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    if not lines or lines[0]["k"] != -1 or not all(lines[0]["ok"]):
        return None
    last = lines[-1]
    if last["k"] == -1 or all(last["ok"]):
        return None
    _, buggy, desc = next(m for m in mutants if m[0] == last["k"])
    tests_py = test_file(setup, tests)
    # the same verdicts through the runner the environment uses (module import, not exec)
    limits = SandboxLimits(wall_s=30, cpu_s=30)
    ref_res, _ = run_tests({"solution.py": reference, "test_solution.py": tests_py}, limits)
    bug_res, _ = run_tests({"solution.py": buggy, "test_solution.py": tests_py}, limits)
    names = [f"test_{i}" for i in range(len(tests))]
    if ([ref_res.get(t, (False,))[0] for t in names] != [True] * len(tests)
            or [bug_res.get(t, (True,))[0] for t in names] != list(last["ok"])):
        return None
    return {"task_id": tid, "text": rec["text"].strip(), "reference": reference, "buggy": buggy, "mutation": desc,
            "tests": tests_py,
            "fail_to_pass": [f"test_{i}" for i, ok in enumerate(last["ok"]) if not ok],
            "pass_to_pass": [f"test_{i}" for i, ok in enumerate(last["ok"]) if ok]}


def read_mbpp(path: str | Path, ids: range = MBPP_TRAIN_IDS) -> list[dict]:
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n"), 1):
        if line.strip():
            try:
                rec = json.loads(line)
                tid = int(rec["task_id"])
                _ = rec["code"], list(rec["test_list"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not an MBPP record ({e})") from None
            if tid in ids:
                out.append(rec)
    return out


def build(mbpp_path: str | Path, out: Path = DATA, ids: range = MBPP_TRAIN_IDS) -> dict[str, int]:
    recs = read_mbpp(mbpp_path, ids)
    built = [x for x in map(build_instance, recs) if x is not None]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in built), encoding="utf-8")
    return {"tasks": len(recs), "instances": len(built), "skipped": len(recs) - len(built)}


def load_instances(path: Path = DATA) -> list[dict]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):  # not splitlines(): U+2028
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            _ = d["task_id"], d["buggy"], d["tests"], d["fail_to_pass"], d["pass_to_pass"], d["text"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a swe_repair instance ({e})") from None
        out.append(d)
    return out


def instance_task(d: dict) -> Task:
    failing = ", ".join(d["fail_to_pass"])
    prompt = (f"This repository has solution.py and test_solution.py. solution.py should do this: {d['text']}\n"
              f"The tests {failing} fail. Find and fix the bug in solution.py so that every test in "
              "test_solution.py passes. Tools: read_file, write_file (the whole new content), run_tests. "
              "Answer briefly when done.")
    meta = {"task_id": d["task_id"], "files": {"solution.py": d["buggy"], "test_solution.py": d["tests"]},
            "fail_to_pass": d["fail_to_pass"], "pass_to_pass": d["pass_to_pass"], "mutation": d["mutation"]}
    return Task(SWERepairEnv.name, prompt, d["reference"], meta)


def run_tests(files: dict[str, str], limits: SandboxLimits) -> tuple[dict[str, tuple[bool, str]], str]:
    """{test: (passed, error)} and a problem line ("" when the run itself went fine)."""
    r = run_python(RUNNER, limits, files)
    results = {}
    for x in r.stdout.splitlines():
        try:
            d = json.loads(x)
            results[d["test"]] = (bool(d["ok"]), d.get("error", ""))
        except (ValueError, KeyError, TypeError):
            continue
    problem = "" if r.status == "ok" else f"the test run ended with {r.status}: {r.stderr.strip()[-300:]}"
    return results, problem


def _safe_path(path: str) -> str | None:
    p = Path(path.strip())
    if not p.parts or p.is_absolute() or ".." in p.parts or not re.fullmatch(r"[\w./-]+", str(p)):
        return None
    return str(p)


@register_env("swe_repair")
class SWERepairEnv:
    name = "swe_repair"

    def __init__(self, wall_s: float = 20.0, cpu_s: int = 20, memory_mb: int = 512):
        self.limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb)
        self.tools = [function_spec("read_file", "Show a file of the repository.", {"path": "relative path"}),
                      function_spec("write_file", "Replace a file's whole content (or create it).",
                                    {"path": "relative path", "content": "the new content"}),
                      function_spec("run_tests", "Run test_solution.py; one line per test.")]
        self.task: Task | None = None
        self.files: dict[str, str] = {}
        self.calls = 0

    def reset(self, task: Task) -> str:
        if task.domain != self.name:
            raise ValueError(f"swe_repair got a task of domain {task.domain!r}")
        for key in ("files", "fail_to_pass", "pass_to_pass"):
            if key not in task.meta:
                raise ValueError(f"swe_repair task {task.meta.get('task_id')!r}: meta has no {key!r}")
        self.task, self.files, self.calls = task, dict(task.meta["files"]), 0
        return task.prompt

    def _tool(self, c: ToolCall) -> str:
        if c.name == "run_tests":
            results, problem = run_tests(self.files, self.limits)
            lines = [f"{t} {'PASSED' if ok else 'FAILED: ' + err}" for t, (ok, err) in results.items()]
            passed = sum(ok for ok, _ in results.values())
            return "\n".join([*lines, *([problem] if problem else []), f"{passed} passed, {len(results) - passed} failed"])
        path = _safe_path(str(c.arguments["path"]))
        if path is None:
            return f"error: {c.arguments['path']!r} is not a relative path inside the repository"
        if c.name == "read_file":
            return self.files[path] if path in self.files else \
                f"error: no file {path!r} (files: {', '.join(sorted(self.files))})"
        content = str(c.arguments["content"])
        if len(content) > MAX_FILE_CHARS:
            return f"error: content longer than {MAX_FILE_CHARS} characters"
        self.files[path] = content if content.endswith("\n") else content + "\n"
        return f"wrote {path} ({len(content)} characters)"

    def step(self, calls: Sequence[ToolCall]) -> StepResult:
        obs = []
        for c in calls:
            self.calls += 1
            obs.append(check_args(c, self.tools) or self._tool(c))
        return StepResult(obs, False, {"tool_calls": self.calls})

    def _repository(self) -> dict[str, str]:
        return {p: t for p, t in self.files.items() if p != "test_solution.py"}

    def final_reward(self, answer: str) -> RewardOutcome:
        if self.task is None:
            raise RuntimeError("final_reward before reset")
        setup, checks = test_checks(self.task)
        need = [*self.task.meta["fail_to_pass"], *self.task.meta["pass_to_pass"]]
        run = run_calls([checks[t].call for t in need], files=self._repository(), module="solution", setup=setup,
                        limits=self.limits, call_timeout_s=TEST_TIMEOUT_S)
        failed = [t for t, (ok, _) in zip(need, judge([checks[t] for t in need], run)) if not ok]
        if not failed:
            return RewardOutcome(1.0, "ok", f"all {len(need)} tests pass after {self.calls} tool calls")
        f2p = [t for t in failed if t in self.task.meta["fail_to_pass"]]
        return RewardOutcome(0.0, "ok", f"{len(failed)} of {len(need)} tests fail ({len(f2p)} FAIL_TO_PASS)"
                                        + (f"; {run.problem}" if run.problem else ""))

    def recheck(self) -> RewardOutcome:
        """The reference solution and the final repository on fresh inputs (never a reward)."""
        setup, checks = test_checks(self.task)
        r = recheck(list(checks.values()), {"code": self.task.answer, "setup": setup},
                    {"files": self._repository(), "module": "solution", "setup": setup},
                    seed=zlib.crc32(json.dumps(self.files, sort_keys=True).encode()), limits=self.limits,
                    call_timeout_s=TEST_TIMEOUT_S)
        return recheck_outcome(r)

    @classmethod
    def tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        pool = [instance_task(d) for d in load_instances()
                if (zlib.crc32(str(d["task_id"]).encode()) % 1000 < HELDOUT_PER_MILLE) == (split == "heldout")]
        return draw(pool, split, n, seed)
