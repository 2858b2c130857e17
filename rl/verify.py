"""Verdicts on model-written functions, computed outside the process that runs them.

A test such as MBPP's `assert f(x) == expected` is split in two:
    the call      `f(x)`, evaluated in rl.sandbox after the model's solution.py (and the task's
                  setup code) ran; the sandbox hands back only the value, as plain data;
    the check     `value == expected`, made here by trusted code. The expected value never
                  enters the sandbox, nor any file it can read.
What the model's code prints, patches, imports or exits with can only change the values it
hands back, never the comparison, so it cannot turn a failing test into a pass.

Plain data (the wire format, one JSON line): null, booleans, numbers, strings and lists as JSON;
tuples, sets, frozensets, dicts, bytes, complex numbers and non-finite floats as one-key objects
({"tuple": [...]}, {"dict": [[key, value], ...]}, {"float": "inf"}, ...). Only values of exactly
these built-in types are sent, with collections' Counter, OrderedDict and defaultdict sent as
dicts (Python's == treats them as dicts); a subclass of int or str, or any other object, fails
its test;
decode() builds them anew from JSON, so no object of the model's can reach the comparison.

Comparison (same()): Python's == for every type, except that floats compare with
math.isclose(rel_tol=REL_TOL, abs_tol=ABS_TOL), inside lists, tuples and dict values too.
A crash, a timeout, an early exit, a value that is not plain data or a missing answer fails the
test.

Test shapes that can be expressed (checks_from_asserts): `assert CALL == EXPECTED`, where CALL is
any expression (it runs in the sandbox) and EXPECTED needs nothing of the solution (a literal, or
an expression over `math`, `sys` and the built-ins, evaluated here). Every MBPP assert has this
shape. Tests that cannot be expressed: an assert on state the call leaves behind (an argument
mutated in place, a file written), on an object of the solution's own classes, on printed
output, or any assert whose expected side calls the solution; such tests are refused with
UnverifiableTest when the task is loaded, never run in the model's process.

Re-check (recheck()): an independent check of a rewarded solution, never rewarded itself. The
calls' literal arguments are perturbed (seeded), the reference solution and the candidate run
on them in two separate sandboxes, and the candidate must agree wherever the reference returns
a value. A solution that memorised the tests passes them and fails here.
"""
from __future__ import annotations

import ast
import builtins
import json
import math
import random
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from rl.sandbox import SandboxLimits, run_python

REL_TOL, ABS_TOL = 1e-6, 1e-9
MAX_DEPTH = 64


class UnverifiableTest(ValueError):
    """A test that cannot be split into a sandboxed call and a trusted check."""


@dataclass(frozen=True)
class CallCheck:
    call: str           # expression source evaluated in the sandbox
    expected: Any       # plain data, built here
    source: str         # the original test, for reasons


# ---------------------------------------------------------------- plain data
_TAGS = ("tuple", "set", "frozenset", "dict", "bytes", "complex", "float")


def decode(obj: Any, depth: int = 0) -> Any:
    """JSON (as json.loads returns it) -> plain data; ValueError on anything else."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [decode(x, depth + 1) for x in obj]
    if not isinstance(obj, dict) or len(obj) != 1:
        raise ValueError("a JSON object must be one of the tagged forms")
    (tag, body), = obj.items()
    if tag in ("tuple", "set", "frozenset"):
        if not isinstance(body, list):
            raise ValueError(f"{tag} must hold a list")
        items = [decode(x, depth + 1) for x in body]
        try:
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        except TypeError as e:           # an unhashable member of a set
            raise ValueError(f"bad {tag}: {e}") from None
    if tag == "dict":
        if not isinstance(body, list) or not all(isinstance(p, list) and len(p) == 2 for p in body):
            raise ValueError("dict must hold [key, value] pairs")
        try:
            return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
        except TypeError as e:
            raise ValueError(f"bad dict key: {e}") from None
    if tag == "bytes" and isinstance(body, str):
        return bytes.fromhex(body)
    if tag == "complex" and isinstance(body, list) and len(body) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in body):
        return complex(body[0], body[1])
    if tag == "float" and body in ("inf", "-inf", "nan"):
        return float(body)
    raise ValueError(f"unknown tag {tag!r}" if tag not in _TAGS else f"bad {tag} body")


def same(got: Any, want: Any) -> bool:
    """Python's == on plain data, with floats compared within REL_TOL / ABS_TOL."""
    if isinstance(want, float) or isinstance(got, float):
        if isinstance(got, (int, float)) and isinstance(want, (int, float)):
            return math.isclose(got, want, rel_tol=REL_TOL, abs_tol=ABS_TOL)
        return got == want
    if type(got) in (list, tuple) and type(want) is type(got):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want))
    if type(got) is dict and type(want) is dict:
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    return got == want


# ---------------------------------------------------------------- splitting tests
_TRUSTED_NAMES = {"math": math, "sys": sys, **{k: getattr(builtins, k) for k in (
    "abs", "bool", "bytes", "complex", "dict", "float", "frozenset", "int", "len", "list", "max", "min",
    "pow", "range", "round", "set", "sorted", "str", "sum", "tuple", "True", "False", "None")}}


def _expected_value(node: ast.expr, source: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    free = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} - set(_TRUSTED_NAMES)
    if free:
        raise UnverifiableTest(f"{source!r}: the expected side uses {', '.join(sorted(free))}, which only the "
                               "solution defines")
    # dataset text over math/sys/builtins only, never model output
    value = eval(compile(ast.Expression(node), "<expected>", "eval"), {"__builtins__": {}, **_TRUSTED_NAMES})
    try:
        return decode(json.loads(json.dumps(_encode_trusted(value))))
    except (TypeError, ValueError) as e:
        raise UnverifiableTest(f"{source!r}: the expected value is not plain data ({e})") from None


def checks_from_asserts(asserts: Sequence[str]) -> list[CallCheck]:
    """`assert CALL == EXPECTED` lines -> CallChecks; UnverifiableTest names the first that is not."""
    out = []
    for src in asserts:
        try:
            body = ast.parse(src.strip()).body
        except SyntaxError as e:
            raise UnverifiableTest(f"{src!r}: not Python ({e.msg})") from None
        if (len(body) != 1 or not isinstance(body[0], ast.Assert) or not isinstance(body[0].test, ast.Compare)
                or len(body[0].test.ops) != 1 or not isinstance(body[0].test.ops[0], ast.Eq)):
            raise UnverifiableTest(f"{src!r}: only `assert CALL == EXPECTED` can be checked outside the sandbox")
        test = body[0].test
        out.append(CallCheck(ast.unparse(test.left), _expected_value(test.comparators[0], src), src.strip()))
    return out


# ---------------------------------------------------------------- the sandboxed side
# The sandbox program. It is the model's process: nothing here is trusted, and nothing secret is
# in it (calls.json holds the calls and setup code only). Values go to the original stdout as one
# JSON line; the solution's own prints go to /dev/null so that they cannot crowd it out.
_CALLER = r'''
import collections, json, math, os, signal, sys, types
DICTS = (dict, collections.Counter, collections.OrderedDict, collections.defaultdict)   # before the solution runs
sys.path.insert(0, os.getcwd())
sys.setrecursionlimit(3000)
job = json.load(open("calls.json"))
out = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)

def encode(v, depth=0):
    if depth > 64:
        raise TypeError("value nested too deeply")
    t = type(v)
    if v is None or t is bool or t is str:
        return v
    if t is int:
        return v
    if t is float:
        return v if math.isfinite(v) else {"float": repr(v)}
    if t is list:
        return [encode(x, depth + 1) for x in v]
    if t in (tuple, set, frozenset):
        return {t.__name__: [encode(x, depth + 1) for x in v]}
    if t in DICTS:
        return {"dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in dict.items(v)]}
    if t is bytes:
        return {"bytes": v.hex()}
    if t is complex:
        return {"complex": [v.real, v.imag]}
    raise TypeError("returned a %s, not plain data" % t.__name__)

def alarm(*_):
    raise TimeoutError("call took longer than %ds" % job["timeout_s"])

def fail_all(why):
    out.write(json.dumps({"results": [{"error": why}] * len(job["calls"])}) + "\n")
    out.flush()

signal.signal(signal.SIGALRM, alarm)
ns = {}
try:
    signal.alarm(job["timeout_s"])
    if job["module"]:
        mod = __import__(job["module"])
        ns = {k: v for k, v in vars(mod).items() if not k.startswith("_")}
    else:
        mod = types.ModuleType("solution")
        exec(compile(job["code"], "solution.py", "exec"), mod.__dict__)
        ns = dict(mod.__dict__)
    exec(job["setup"], ns)
    signal.alarm(0)
except BaseException as e:
    signal.alarm(0)
    fail_all("solution raised %s: %s" % (type(e).__name__, str(e)[:200]))
    raise SystemExit(0)
results = []
for call in job["calls"]:
    try:
        signal.alarm(job["timeout_s"])
        value = eval(call, dict(ns))
        signal.alarm(0)
        results.append({"value": encode(value)})
    except BaseException as e:
        signal.alarm(0)
        results.append({"error": "%s: %s" % (type(e).__name__, str(e)[:200])})
out.write(json.dumps({"results": results}) + "\n")
out.flush()
'''


@dataclass
class CallRun:
    values: list[tuple[bool, Any]]   # per call: (True, value) or (False, error text)
    problem: str                     # "" when the run itself ended normally


def run_calls(calls: Sequence[str], *, code: str | None = None, files: dict[str, str] | None = None,
              module: str = "", setup: str = "", limits: SandboxLimits = SandboxLimits(),
              call_timeout_s: int | None = None) -> CallRun:
    """Evaluate each call in one sandbox run after the solution: `code` (executed as the module
    "solution"), or `module` imported from `files` (a repository). Values come back decoded;
    anything unreadable fails every call. call_timeout_s (default: the run's wall limit) bounds
    each call inside the sandbox; the wall-clock kill bounds the run."""
    if (code is None) == (not module):
        raise ValueError("give either code or module")
    job = {"calls": list(calls), "setup": setup or "", "code": code or "", "module": module,
           "timeout_s": max(1, int(call_timeout_s or limits.wall_s))}
    r = run_python(_CALLER, limits, files={**(files or {}), "calls.json": json.dumps(job)})
    problem = "" if r.status == "ok" else f"sandbox {r.status} (returncode {r.returncode})"
    lines = r.stdout.strip().split("\n")
    try:
        report = json.loads(lines[-1])
        raw = report["results"]
        if not isinstance(raw, list) or len(raw) != len(calls):
            raise ValueError(f"{len(raw) if isinstance(raw, list) else 'no'} results for {len(calls)} calls")
        values = []
        for item in raw:
            if isinstance(item, dict) and set(item) == {"value"}:
                values.append((True, decode(item["value"])))
            elif isinstance(item, dict) and set(item) == {"error"} and isinstance(item["error"], str):
                values.append((False, item["error"][:300]))
            else:
                raise ValueError("a result is neither a value nor an error")
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        why = problem or f"no readable result ({type(e).__name__}: {str(e)[:100]})"
        tail = r.stderr.strip()[-200:]
        return CallRun([(False, why + (f": {tail}" if tail else ""))] * len(calls), why)
    return CallRun(values, problem)


def judge(checks: Sequence[CallCheck], run: CallRun) -> list[tuple[bool, str]]:
    """(passed, reason) per check."""
    out = []
    for check, (ok, value) in zip(checks, run.values):
        if not ok:
            out.append((False, str(value)))
        elif same(value, check.expected):
            out.append((True, "passed"))
        else:
            out.append((False, f"returned {_short(value)}"))
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _encode_trusted(v: Any) -> Any:
    """The same wire format for values computed here (the expected side)."""
    t = type(v)
    if v is None or t in (bool, int, str):
        return v
    if t is float:
        return v if math.isfinite(v) else {"float": repr(v)}
    if t is list:
        return [_encode_trusted(x) for x in v]
    if t in (tuple, set, frozenset):
        return {t.__name__: [_encode_trusted(x) for x in v]}
    if t is dict:
        return {"dict": [[_encode_trusted(k), _encode_trusted(x)] for k, x in v.items()]}
    if t is bytes:
        return {"bytes": v.hex()}
    if t is complex:
        return {"complex": [v.real, v.imag]}
    raise TypeError(f"{t.__name__} is not plain data")


# ---------------------------------------------------------------- re-check on fresh inputs
def _perturb(v: Any, rng: random.Random) -> Any:
    t = type(v)
    if t is bool or v is None:
        return v
    if t is int:
        lo = 0 if v >= 0 else v - 3
        return rng.choice([x for x in range(max(lo, v - 3), v + 4) if x != v])
    if t is float:
        return round(v * rng.uniform(0.5, 1.5) + rng.uniform(-1, 1), 3)
    if t is str:
        chars = list(v)
        rng.shuffle(chars)
        return "".join(chars)
    if t in (list, tuple):
        items = [_perturb(x, rng) for x in v]
        if rng.random() < 0.5:
            rng.shuffle(items)
        return t(items)
    if t is dict:
        return {k: _perturb(x, rng) for k, x in v.items()}
    if t in (set, frozenset):
        try:
            return t(_perturb(x, rng) for x in v)
        except TypeError:
            return v
    return v


def fresh_calls(checks: Sequence[CallCheck], rng: random.Random, n: int) -> list[str]:
    """Up to n calls like the tests' own, with literal arguments perturbed; calls whose arguments
    are not all literals are left out."""
    bases = []
    for c in checks:
        node = ast.parse(c.call, mode="eval").body
        if not isinstance(node, ast.Call) or node.keywords:
            continue
        try:
            args = [ast.literal_eval(a) for a in node.args]
        except ValueError:
            continue
        if args:
            bases.append((ast.unparse(node.func), args))
    out: list[str] = []
    seen = {c.call for c in checks}
    for k in range(4 * n):
        if not bases or len(out) == n:
            break
        func, args = bases[k % len(bases)]
        call = f"{func}({', '.join(repr(_perturb(a, rng)) for a in args)})"
        if call not in seen:
            seen.add(call)
            out.append(call)
    return out


@dataclass
class Recheck:
    agrees: bool | None     # None: no fresh input on which the reference returned a value
    reason: str


def recheck(checks: Sequence[CallCheck], reference: dict, candidate: dict, *, seed: int, n: int = 6,
            limits: SandboxLimits = SandboxLimits(), call_timeout_s: int | None = None) -> Recheck:
    """Run the reference and the candidate (each: run_calls keyword arguments, code= or
    files=/module=, plus setup=) in separate sandboxes on fresh inputs; compare where the
    reference returns a value."""
    calls = fresh_calls(checks, random.Random(seed), n)
    if not calls:
        return Recheck(None, "no test call with literal arguments to perturb")
    want = run_calls(calls, limits=limits, call_timeout_s=call_timeout_s, **reference)
    usable = [i for i, (ok, _) in enumerate(want.values) if ok]
    if not usable:
        return Recheck(None, f"the reference returned no value on {len(calls)} fresh inputs")
    got = run_calls([calls[i] for i in usable], limits=limits, call_timeout_s=call_timeout_s, **candidate)
    for i, (ok, value) in zip(usable, got.values):
        if not ok or not same(value, want.values[i][1]):
            return Recheck(False, f"{calls[i]}: reference {_short(want.values[i][1])}, solution "
                                  f"{value if not ok else _short(value)}")
    return Recheck(True, f"agrees on {len(usable)} fresh inputs")
