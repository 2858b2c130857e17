"""The sandbox's cost per call (rl/sandbox.py), beside the same program run without isolation.

Two programs, each run N times; wall milliseconds per call, median and p95:
    trivial   `print(1)` through rl.sandbox.run_python;
    mbpp      rl.rewards.code_reward on one MBPP training task (TASK_ID) with its reference
              solution as the response: the tests run in the sandbox, the verdict is checked
              to be 1.0 (a bench of a failing run would time something else).
Baselines: the very programs those calls ran in the sandbox (argv, files and stdin, recorded from
the call) replayed by a plain subprocess.run in a temporary folder, with no isolation, limits or
uid change: once with this interpreter ([sys.executable, ...], the venv's), once with the
sandbox's own (/usr/bin/python3). Interpreters differ in start-up (the venv's site-packages), so
the second ratio, same interpreter, is the price of the isolation alone.

    .venv/bin/python bench/sandbox.py [--runs 50 | --quick] [--json]

It measures whichever rl.sandbox comes first on the path: PYTHONPATH=<another checkout> times
that checkout's sandbox (its file is printed).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))                     # after PYTHONPATH: another checkout may come first

from machine import machine  # noqa: E402  (bench/machine.py: this script's directory is on sys.path)

from domains.pools import mbpp_tasks  # noqa: E402
from rl import sandbox  # noqa: E402
from rl.rewards import code_reward  # noqa: E402

MBPP = REPO / "samples/mbpp/mbpp.jsonl"
TASK_ID = 602                                  # first_repeated_char: three asserts


def reference_response() -> tuple[str, object]:
    """(the task's reference solution as a model response, the Task) for MBPP TASK_ID."""
    task = next(t for t in mbpp_tasks(str(MBPP)) if t.meta["task_id"] == TASK_ID)
    code = next(json.loads(ln)["code"] for ln in MBPP.read_text().splitlines()
                if ln.strip() and json.loads(ln)["task_id"] == TASK_ID)
    return f"```python\n{code}\n```", task


def recorded(call: Callable[[], object]) -> list[tuple[list[str], dict[str, str], str]]:
    """The (argv, files, stdin) of every sandbox run `call` makes (run_python goes through run_command)."""
    calls, original = [], sandbox.run_command

    def record(argv, limits=sandbox.SandboxLimits(), files=None, stdin=""):
        calls.append((list(argv), dict(files or {}), stdin))
        return original(argv, limits, files, stdin)

    sandbox.run_command = record
    try:
        call()
    finally:
        sandbox.run_command = original
    return calls


def replay(calls: list[tuple[list[str], dict[str, str], str]], python: str | None) -> None:
    """Run the recorded programs unisolated, each in a fresh folder, with `python` (None: the
    interpreter the sandbox ran)."""
    for argv, files, stdin in calls:
        with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as tmp:
            for name, text in files.items():
                path = Path(tmp) / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
            r = subprocess.run([python or argv[0], *argv[1:]], cwd=tmp, input=stdin.encode(), capture_output=True)
            if r.returncode != 0:
                sys.exit(f"the baseline replay of {argv} failed: {r.stderr.decode(errors='replace')[-500:]}")


def timings(call: Callable[[], object], runs: int) -> dict[str, float]:
    call()                                     # warm: imports, the sandbox's one-time probe
    ms = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()
        ms.append((time.perf_counter() - t0) * 1e3)
    ms.sort()
    return {"median_ms": statistics.median(ms), "p95_ms": ms[max(0, math.ceil(0.95 * runs) - 1)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50, help="calls timed per program and side (default 50)")
    ap.add_argument("--quick", action="store_true", help="10 runs")
    ap.add_argument("--json", action="store_true", help="end with the figures as one JSON document")
    args = ap.parse_args()
    runs = 10 if args.quick else args.runs

    response, task = reference_response()

    def mbpp() -> None:
        outcome = code_reward(response, task)
        if outcome.score != 1.0:
            sys.exit(f"MBPP {TASK_ID}'s reference solution scored {outcome.score}: {outcome.reason}")

    def trivial() -> None:
        r = sandbox.run_python("print(1)")
        if r.stdout != "1\n":
            sys.exit(f"print(1) in the sandbox: {r}")

    iso = sandbox.isolation()
    print(f"rl.sandbox: {sandbox.__file__}; isolation: "
          + ", ".join(f"{k}={iso[k]}" for k in ("tool", "bwrap_version", "network_namespace", "private_uid")
                      if k in iso))
    rows = {}
    for name, call in (("trivial", trivial), ("mbpp", mbpp)):
        programs = recorded(call)
        r = rows[name] = {"sandbox": timings(call, runs),
                          "baseline": timings(lambda: replay(programs, sys.executable), runs),
                          "baseline_same_python": timings(lambda: replay(programs, None), runs),
                          "sandbox_runs_per_call": len(programs)}
        r["ratio"] = r["sandbox"]["median_ms"] / r["baseline"]["median_ms"]
        r["ratio_same_python"] = r["sandbox"]["median_ms"] / r["baseline_same_python"]["median_ms"]
    settings = (f"{runs} runs per side; baselines unisolated: {sys.executable} and the sandbox's "
                f"{iso['python']}; MBPP task {TASK_ID}; {machine()}")
    plain, plain_same = f"plain {sys.executable}", f"plain {iso['python']}"
    print("ms per call, median / p95; ratio: sandbox median / plain median")
    print(f"{'program':<8} {'sandbox':>15}   {plain} {'ratio':>6}   {plain_same} {'ratio':>6}")
    for name, r in rows.items():
        cols = [f"{r[k]['median_ms']:.1f} / {r[k]['p95_ms']:.1f}"
                for k in ("sandbox", "baseline", "baseline_same_python")]
        print(f"{name:<8} {cols[0]:>15}   {cols[1]:>{len(plain)}} {r['ratio']:>5.2f}x   "
              f"{cols[2]:>{len(plain_same)}} {r['ratio_same_python']:>5.2f}x")
    print(settings)
    if args.json:
        print(json.dumps({"rows": rows, "runs": runs, "sandbox_module": sandbox.__file__,
                          "isolation": {k: iso.get(k) for k in ("tool", "bwrap", "bwrap_version")},
                          "settings": settings}, indent=1))


if __name__ == "__main__":
    main()
