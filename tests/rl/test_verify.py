"""rl.verify: the wire format, the trusted comparison, test splitting and the fresh-input re-check."""
from __future__ import annotations

import json
import random

import pytest

from rl.verify import (
    REL_TOL,
    UnverifiableTest,
    checks_from_asserts,
    decode,
    fresh_calls,
    judge,
    recheck,
    run_calls,
    same,
)


def test_decode_builds_plain_data_and_refuses_the_rest():
    wire = {"tuple": [1, {"set": [2, 3]}, {"dict": [[{"tuple": [1, 2]}, "x"]]}, {"float": "inf"},
                      {"bytes": "6869"}, {"complex": [1, 2]}, {"frozenset": []}]}
    assert decode(json.loads(json.dumps(wire))) == (1, {2, 3}, {(1, 2): "x"}, float("inf"), b"hi", 1 + 2j,
                                                    frozenset())
    for bad in ({"object": 1}, {"tuple": 1, "set": []}, {"set": [[1]]}, {"dict": [[[1], 2]]}, {"float": "1e999x"},
                {"dict": [1]}, {"complex": [True, 1]}):
        with pytest.raises(ValueError):
            decode(bad)
    deep = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(ValueError, match="deeply"):
        decode(deep)


def test_same_is_python_equality_with_float_tolerance():
    assert same(0.1 + 0.2, 0.3) and same([1.0, (2, 0.30000000000000004)], [1, (2, 0.3)])
    assert not same(0.3 * (1 + 10 * REL_TOL), 0.3)
    assert not same([1, 2], (1, 2)) and not same((1, 2), [1, 2])          # as == says
    assert same({1, 2}, frozenset({1, 2})) and same({"a": 1.0000000001}, {"a": 1})
    assert not same({"a": 1}, {"a": 1, "b": 2}) and not same("1", 1) and not same(None, 0)
    assert not same(float("nan"), float("nan"))


def test_checks_from_asserts_splits_the_call_from_the_expected_value():
    c, = checks_from_asserts(['assert f([1, 2], "x") == (3, {"a": 1})'])
    assert (c.call, c.expected) == ("f([1, 2], 'x')", (3, {"a": 1}))
    c, = checks_from_asserts(["assert g(1)==sys.getsizeof((1, 2))"])    # the expected side, computed here
    assert isinstance(c.expected, int) and c.expected > 0
    for bad, why in (("assert f(1)", "only `assert CALL == EXPECTED`"), ("assert f(1) != 2", "only"),
                     ("x = f(1)", "only"), ("assert f(1) == g(2)", "uses g"), ("assert f(1 ==", "not Python")):
        with pytest.raises(UnverifiableTest, match=why):
            checks_from_asserts([bad])


def test_run_calls_and_judge():
    checks = checks_from_asserts(["assert add(1, 2) == 3", "assert add(0.1, 0.2) == 0.3", "assert boom() == 1",
                                  "assert obj() == 1", "assert add('a', 'b') == 'ab'"])
    code = ("def add(a, b):\n    print('noise')\n    return a + b\n"
            "def boom():\n    raise KeyError('k')\n"
            "def obj():\n    return object()\n")
    run = run_calls([c.call for c in checks], code=code)
    verdicts = judge(checks, run)
    assert [ok for ok, _ in verdicts] == [True, True, False, False, True], verdicts
    assert "KeyError" in verdicts[2][1] and "not plain data" in verdicts[3][1]
    # a repository imported as a module, with setup code run after it
    run = run_calls(["twice(x)"], files={"solution.py": "def twice(v):\n    return 2 * v\n"}, module="solution",
                    setup="x = 21")
    assert run.values == [(True, 42)] and run.problem == ""


def test_fresh_calls_perturb_literal_arguments_only():
    checks = checks_from_asserts(["assert f([3, 1, 2], 5) == 1", "assert f(Pair(1, 2)) == 0"])
    calls = fresh_calls(checks, random.Random(0), 5)
    assert len(calls) == 5 and all(c.startswith("f([") for c in calls)
    assert "f([3, 1, 2], 5)" not in calls
    assert calls == fresh_calls(checks, random.Random(0), 5)              # seeded


def test_recheck_catches_a_solution_that_memorised_the_tests():
    tests = ["assert biggest([1, 5, 2]) == 5", "assert biggest([7, 3]) == 7", "assert biggest([0, -1, -4]) == 0"]
    checks = checks_from_asserts(tests)
    reference = {"code": "def biggest(xs):\n    return max(xs)\n"}
    memorised = {"code": "def biggest(xs):\n    return {(1, 5, 2): 5, (7, 3): 7, (0, -1, -4): 0}.get(tuple(xs))\n"}
    honest = {"code": "def biggest(xs):\n    best = xs[0]\n    for x in xs:\n        best = x if x > best else best\n"
                      "    return best\n"}
    assert all(ok for ok, _ in judge(checks, run_calls([c.call for c in checks], **memorised)))   # passes the tests
    r = recheck(checks, reference, memorised, seed=1)
    assert r.agrees is False and "reference" in r.reason, r
    assert recheck(checks, reference, honest, seed=1).agrees is True
    no_literals = checks_from_asserts(["assert biggest(DATA) == 5"])
    assert recheck(no_literals, reference, honest, seed=1).agrees is None
