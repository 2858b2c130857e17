"""Verifiable rewards, registered by domain, run in a killable worker process.

Every reward is `fn(response_text, task) -> RewardOutcome` with a score in [0, 1]; REWARDS maps
Task.domain to it (@register_reward). The RL loop scores through RewardWorker, a persistent
process (a fresh interpreter, like multiprocessing "spawn") that gets a whole batch in one message and answers sample by
sample, so each sample has its own wall-clock deadline: a sample past it is "timeout", the
worker is killed and restarted and the remaining samples go on in the new one. A reward that
raises gives "error" with the message. Neither is ever a score the policy is trained on.

Domains:
    arithmetic  the leading digits of the response (spaces ignored) equal task.answer's digits;
    math        GSM8K style: the answer after the last "####", else in the last \\boxed{}, else
                the last number (reason "no marked answer"), compared numerically (commas, $ and
                % stripped, 1e-6 relative) or, when not a number, symbolically with sympy;
    code        MBPP: the first ```python block (else any ``` block, else the whole text) runs in
                rl.sandbox with meta["setup"]; it hands back the value of each test's call and the
                trusted side compares it with the assert's expected value (rl.verify); 1.0 iff
                every test passes;
    tool        chat.template tool calls (calculator, search_docs of posttrain.sft_data)
                are executed for real; the transcript's tool responses, where present, must be
                what the tool returns; the final message's answer is compared as in math.
Re-checks (RECHECKS, @register_recheck): an independent check of a rewarded sample, never a
reward: score 1.0 when it agrees, 0.0 when it does not, status "skipped" when it cannot tell.
`code` re-runs the response and meta["reference"] on fresh inputs (rl.verify.recheck). The RL
stages report the share of re-checked rewarded samples that disagree
(reward_recheck_disagreement): a rising share means the policy found a hole in the reward.

Text after the last </think> is the answer (an unterminated <think> has none); stop tokens
are ignored.
"""
from __future__ import annotations

import functools
import importlib
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable, Sequence

from domains.task import Task
from rl.registry import registrar
from rl.sandbox import SandboxLimits
from rl.verify import (
    CallCheck,
    Recheck,
    UnverifiableTest,
    checks_from_asserts,
    judge,
    recheck,
    run_calls,
)

__all__ = ["Task", "RewardOutcome", "REWARDS", "RECHECKS", "register_reward", "register_recheck", "score_sample",
           "recheck_sample", "recheck_outcome", "RewardWorker",
           "TOOLS", "run_tool", "extract_math_answer", "equivalent", "extract_code"]


@dataclass
class RewardOutcome:
    score: float           # in [0, 1]
    status: str            # "ok" | "timeout" | "error" (error = the reward function raised)
    reason: str            # short: "wrong answer", "no answer found", "test failed: ...", ...


REWARDS: dict[str, Callable[[str, Task], RewardOutcome]] = {}
RECHECKS: dict[str, Callable[[str, Task], RewardOutcome]] = {}


def register_reward(name: str):
    """Decorator: the function becomes REWARDS[name] (the Task.domain it scores)."""
    return registrar(REWARDS, "reward", name)


def register_recheck(name: str):
    """Decorator: the function becomes RECHECKS[name], the re-check of rewarded samples of that domain."""
    return registrar(RECHECKS, "recheck", name)


def recheck_outcome(r: Recheck) -> RewardOutcome:
    if r.agrees is None:
        return RewardOutcome(0.0, "skipped", r.reason)
    return RewardOutcome(float(r.agrees), "ok", r.reason)


def score_sample(text: str, task: Task) -> RewardOutcome:
    """One sample in this process (no timeout): what the worker runs for each sample."""
    return _apply(REWARDS, "reward", text, task)


def recheck_sample(text: str, task: Task) -> RewardOutcome:
    """The re-check of one rewarded sample in this process."""
    return _apply(RECHECKS, "recheck", text, task)


def _apply(table: dict, kind: str, text: str, task: Task) -> RewardOutcome:
    fn = table.get(task.domain)
    if fn is None:
        return RewardOutcome(0.0, "error", f"no {kind} registered for domain {task.domain!r} "
                                           f"(have {sorted(table)})")
    try:
        out = fn(text, task)
        if not isinstance(out, RewardOutcome) or not 0.0 <= out.score <= 1.0:
            raise ValueError(f"{kind} {task.domain!r} must return a RewardOutcome with score in [0, 1], got {out!r}")
        return out
    except Exception as e:  # the reward's own failure is the sample's outcome, not the worker's
        return RewardOutcome(0.0, "error", f"{type(e).__name__}: {e}"[:500])


# ---------------------------------------------------------------- text helpers
_STOPS = ("<|endoftext|>", "<|user|>", "<|observation|>")


def final_text(response: str) -> str:
    """The part of a response that carries its answer: after the last </think>."""
    for s in _STOPS:
        response = response.replace(s, "")
    if "</think>" in response:
        return response.rpartition("</think>")[2]
    return "" if "<think>" in response else response


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_math_answer(text: str) -> tuple[str | None, str]:
    """(answer, how): how is "####", "boxed", "last number" or "none"."""
    if "####" in text:
        line = text.rpartition("####")[2].strip().split("\n")[0].strip()
        return (line or None), "####"
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip(), "boxed"
    nums = _NUMBER.findall(text)
    return (nums[-1], "last number") if nums else (None, "none")


def _clean(s: str) -> str:
    s = s.strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    for junk in ("\\$", "$", "\\%", "%", ",", "\\!", "\\,", "\\left", "\\right"):
        s = s.replace(junk, "")
    return s.strip().rstrip(".").strip()


def _as_number(s: str) -> float | None:
    try:
        v = float(s.replace(" ", ""))
    except ValueError:
        return None
    return v if math.isfinite(v) else None


# sympy's parser eval()s its input: only plain math may reach it (the worker is not a sandbox).
_SAFE_MATH = re.compile(r"^[0-9a-zA-Z+\-*/^().\s]*$")
_NAMES_OK = {"sqrt", "pi", "e", "E", "I", "i", "log", "ln", "exp", "sin", "cos", "tan", "oo", "frac"}


def _latex_to_plain(s: str) -> str:
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for _ in range(4):   # nested fractions
        s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
        s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", "pi").replace("{", "(").replace("}", ")")
    return s.replace("\\", "")


@functools.lru_cache(maxsize=4096)
def _sympy_expr(s: str):
    plain = _latex_to_plain(s)
    if not _SAFE_MATH.match(plain) or "__" in plain:
        return None
    if any(len(w) > 1 and w not in _NAMES_OK for w in re.findall(r"[a-zA-Z]+", plain)):
        return None
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )
    try:
        return parse_expr(plain, transformations=standard_transformations
                          + (implicit_multiplication_application, convert_xor), evaluate=True)
    except Exception:       # sympy raises many types on malformed input; all mean "not math"
        return None


# a number and then words only: "72 clips", "5 hours per day"
_NUMBER_THEN_WORDS = re.compile(r"\s*(-?\d[\d,]*(?:\.\d+)?|-?\.\d+)\s*[A-Za-z][A-Za-z\s-]*\.?\s*")


def _numeric_part(ans: str, ref: str) -> str:
    """"72 clips" -> "72" when the reference is a number and the answer is a number followed by
    words. Anything else stays whole: taking the first number out of any text paid a boxed
    `__import__('os').system('touch /tmp/d0e2...')` for the answer 0."""
    if _as_number(_clean(ref)) is None or _as_number(_clean(ans)) is not None:
        return ans
    m = _NUMBER_THEN_WORDS.fullmatch(_clean(ans))
    return m.group(1) if m else ans


def equivalent(pred: str, ref: str) -> bool:
    """Numerically equal (1e-6 relative) or symbolically equal (sympy), after stripping $ , %."""
    a, b = _clean(pred), _clean(ref)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    if x is not None and y is not None:
        return math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-12)
    ea, eb = _sympy_expr(a), _sympy_expr(b)
    if ea is None or eb is None:
        return a.lower() == b.lower()
    import sympy
    try:
        return bool(sympy.simplify(ea - eb) == 0)
    except Exception:       # e.g. comparing a relation with a number
        return False


# ---------------------------------------------------------------- arithmetic
_LEADING_DIGITS = re.compile(r"\s*(-?[\d ]*)")


@register_reward("arithmetic")
def arithmetic_reward(text: str, task: Task) -> RewardOutcome:
    got = _LEADING_DIGITS.match(final_text(text)).group(1).replace(" ", "")
    want = task.answer.replace(" ", "")
    if not got.strip("-"):
        return RewardOutcome(0.0, "ok", "no answer found")
    return RewardOutcome(1.0, "ok", "correct") if got == want else RewardOutcome(0.0, "ok", "wrong answer")


# ---------------------------------------------------------------- math
@register_reward("math")
def math_reward(text: str, task: Task) -> RewardOutcome:
    ans, how = extract_math_answer(final_text(text))
    if ans is None:
        return RewardOutcome(0.0, "ok", "no answer found")
    ok = equivalent(_numeric_part(ans, task.answer), task.answer)
    reason = "correct" if ok else "wrong answer"
    if how == "last number":
        reason += " (no marked answer)"
    return RewardOutcome(float(ok), "ok", reason)


# ---------------------------------------------------------------- code
_FENCE = re.compile(r"```[ \t]*(\w*)[^\n]*\n(.*?)```", re.S)


def extract_code(text: str) -> str:
    blocks = _FENCE.findall(text)
    py = [b for lang, b in blocks if lang.lower() in ("python", "py", "python3")]
    if py:
        return py[0]
    return blocks[0][1] if blocks else text


def code_checks(task: Task) -> tuple[list[CallCheck], str]:
    """The task's asserts as sandboxed calls with trusted checks, and its setup code."""
    tests, setup = task.meta.get("tests"), task.meta.get("setup", "") or ""
    where = f"code task {task.meta.get('task_id', '?')}"
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"{where}: meta['tests'] must be a non-empty list of assert strings, got {tests!r}")
    if not isinstance(setup, str):
        raise ValueError(f"{where}: meta['setup'] must be a str, got {type(setup).__name__}")
    try:
        return checks_from_asserts(tests), setup
    except UnverifiableTest as e:
        raise ValueError(f"{where}: {e}") from None


def _code_limits(task: Task) -> SandboxLimits:
    return SandboxLimits(wall_s=float(task.meta.get("timeout_s", 5.0)), cpu_s=int(task.meta.get("cpu_s", 5)),
                         memory_mb=int(task.meta.get("memory_mb", 512)))


@register_reward("code")
def code_reward(text: str, task: Task) -> RewardOutcome:
    """The solution runs in rl.sandbox and hands back each test call's value; the comparison with
    the expected value is made here (rl.verify), so nothing the code does can pass a test for it."""
    checks, setup = code_checks(task)
    limits = _code_limits(task)
    run = run_calls([c.call for c in checks], code=extract_code(final_text(text)), setup=setup, limits=limits)
    verdicts = judge(checks, run)
    failed = [(c, why) for c, (ok, why) in zip(checks, verdicts) if not ok]
    if not failed:
        return RewardOutcome(1.0, "ok", f"all {len(checks)} tests passed")
    check, why = failed[0]
    return RewardOutcome(0.0, "ok", f"{len(failed)} of {len(checks)} tests failed: {check.source[:150]} ({why[:150]})")


@register_recheck("code")
def code_recheck(text: str, task: Task) -> RewardOutcome:
    """Fresh inputs: the task's reference solution (meta['reference']) and the response must agree."""
    reference = task.meta.get("reference")
    if not isinstance(reference, str) or not reference.strip():
        return RewardOutcome(0.0, "skipped", "the task has no reference solution")
    checks, setup = code_checks(task)
    seed = zlib.crc32(f"{task.meta.get('task_id')}:{text}".encode())
    r = recheck(checks, {"code": reference, "setup": setup}, {"code": extract_code(final_text(text)), "setup": setup},
                seed=seed, limits=_code_limits(task))
    return recheck_outcome(r)


# ---------------------------------------------------------------- tool
@functools.lru_cache(maxsize=1)
def _doc_index():
    from domains.tools import MAX_DOC_CHARS, DocIndex, stdlib_functions
    return DocIndex(stdlib_functions(), MAX_DOC_CHARS)


def _calculator(args: dict) -> str:
    from domains.tools import calculator
    return calculator(str(args["expression"]))


TOOLS: dict[str, Callable[[dict], str]] = {
    "calculator": _calculator,
    "search_docs": lambda args: _doc_index().search(str(args["query"])),
}


def run_tool(name: str, arguments: dict) -> str:
    """The tool's real answer, as the environment shows it in <tool_response> (errors as text,
    so the model can read them)."""
    if name not in TOOLS:
        return f"error: no such tool {name!r}"
    try:
        return TOOLS[name](arguments)
    except KeyError as e:
        return f"error: missing argument {e.args[0]!r}"
    except ValueError as e:
        return f"error: {e}"


_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)


@register_reward("tool")
def tool_reward(text: str, task: Task) -> RewardOutcome:
    """`text` is the assistant side of a tool-using rollout: assistant messages separated by
    <|observation|><tool_response>...</tool_response> blocks and <|assistant|>."""
    from chat.template import ASSISTANT, OBSERVATION, parse_assistant
    from domains.tools import CALCULATOR, SEARCH_DOCS

    schemas = [CALCULATOR, SEARCH_DOCS]
    calls, final = 0, None
    for k, seg in enumerate(text.split(ASSISTANT)):
        body, obs_sep, obs = seg.partition(OBSERVATION)
        parsed = parse_assistant(body + obs_sep, tools=schemas)
        if not parsed.ok:
            return RewardOutcome(0.0, "ok", f"malformed message {k}: {parsed.errors[0]}")
        observed = _TOOL_RESPONSE.findall(obs)
        for j, call in enumerate(parsed.message.tool_calls):
            calls += 1
            real = run_tool(call.name, call.arguments)
            if j < len(observed) and observed[j] != real:
                return RewardOutcome(0.0, "ok", f"tool response {calls} is not what {call.name} returns")
        final = None if parsed.message.tool_calls else parsed.message.content
    need = int(task.meta.get("min_tool_calls", 1))
    if calls < need:
        return RewardOutcome(0.0, "ok", f"{calls} tool calls, the task needs at least {need}")
    if final is None or not final.strip():
        return RewardOutcome(0.0, "ok", "no final answer after the tool calls")
    ans, how = extract_math_answer(final)
    if _as_number(_clean(task.answer)) is None and how in ("last number", "none"):
        ans = final.strip()           # a non-numeric reference is compared with the whole reply
    if ans is None:
        return RewardOutcome(0.0, "ok", "no answer found")
    ok = equivalent(_numeric_part(ans, task.answer), task.answer)
    return RewardOutcome(float(ok), "ok", f"{'correct' if ok else 'wrong answer'} after {calls} tool calls")


# ---------------------------------------------------------------- worker
def _serve(read_fd: int, write_fd: int, imports: list[str]) -> None:
    """The worker's loop: a batch in, one (index, score, status, reason) out per sample."""
    rx, tx = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    try:
        for m in imports:
            importlib.import_module(m)
    except Exception:
        tx.send(("fatal", traceback.format_exc()))
        return
    tx.send(("ready", None))
    while True:
        try:
            batch = rx.recv()
        except EOFError:        # the parent is gone
            return
        if batch is None:
            return
        kind, items = batch
        apply = recheck_sample if kind == "recheck" else score_sample
        for i, text, (domain, prompt, answer, meta) in items:
            out = apply(text, Task(domain, prompt, answer, meta))
            tx.send((i, out.score, out.status, out.reason))


_BOOT = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); import rl.rewards as r; "
         "r._serve(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])")


class RewardWorker:
    """A persistent worker process that runs the rewards (a process, never a thread, so a stuck
    reward can be killed).

    score(samples, timeout_s) -> outcomes in order: each sample gets its own wall-clock
    deadline (from the previous answer); a sample past it gets "timeout", the worker is killed
    and restarted, and the rest continue. `imports` are modules the worker imports first (they
    register extra rewards). Context manager; close() stops the process and waits for it.
    A code sample's sandbox has its own wall limit; keep timeout_s above it.

    The process is a fresh interpreter (what multiprocessing's "spawn" starts) talking over
    multiprocessing Connections, started directly rather than through multiprocessing.Process
    so that it never re-runs the parent's __main__ (a flow script)."""

    def __init__(self, imports: Sequence[str] = ()):
        self._imports = tuple(imports)
        self._proc: subprocess.Popen | None = None
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(sys.path), str(down_r),
                                           str(up_w), *self._imports], pass_fds=(down_r, up_w),
                                          stdin=subprocess.DEVNULL)
        finally:
            os.close(down_r)
            os.close(up_w)
        self._tx, self._rx = Connection(down_w, readable=False), Connection(up_r, writable=False)
        try:
            kind, detail = self._rx.recv()
        except EOFError:
            kind, detail = "fatal", f"exit code {self._proc.wait()}"
        if kind != "ready":
            self._kill()
            raise RuntimeError(f"reward worker failed to start: {detail}")

    def _kill(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._tx.close()
        self._rx.close()
        self._proc = None

    def score(self, samples: Sequence[tuple[str, Task]], timeout_s: float) -> list[RewardOutcome]:
        return self._run("score", samples, timeout_s)

    def recheck(self, samples: Sequence[tuple[str, Task]], timeout_s: float) -> list[RewardOutcome]:
        """RECHECKS on rewarded samples, with the same per-sample deadline as score()."""
        return self._run("recheck", samples, timeout_s)

    def _run(self, kind: str, samples: Sequence[tuple[str, Task]], timeout_s: float) -> list[RewardOutcome]:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        payload = []
        for i, (text, t) in enumerate(samples):
            if not isinstance(text, str):
                raise ValueError(f"samples[{i}]: response must be a str, got {type(text).__name__}")
            payload.append((i, text, (t.domain, t.prompt, t.answer, t.meta)))
        out: list[RewardOutcome | None] = [None] * len(payload)
        while payload:
            if self._proc is None:
                self._start()
                self.restarts += 1
            self._tx.send((kind, payload))
            since = time.monotonic()
            for k, (i, _, _) in enumerate(payload):
                if not self._rx.poll(max(0.0, since + timeout_s - time.monotonic())):
                    out[i] = RewardOutcome(0.0, "timeout", f"timeout after {timeout_s:g}s")
                    self._kill()
                    payload = payload[k + 1:]
                    break
                try:
                    j, score, status, reason = self._rx.recv()
                except EOFError:   # the worker died inside a reward (e.g. a crash in native code)
                    code = self._proc.wait()
                    self._kill()
                    out[i] = RewardOutcome(0.0, "error", f"reward worker died (exit code {code})")
                    payload = payload[k + 1:]
                    break
                assert j == i, (j, i)
                out[i] = RewardOutcome(score, status, reason)
                since = time.monotonic()
            else:
                payload = []
        return out

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self._tx.send(None)
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._kill()

    def __enter__(self) -> "RewardWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
