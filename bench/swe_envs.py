"""Environments from real repositories (rl.swe): what a sandboxed test run costs over a plain one,
and how many validated instances a CPU-minute builds.

    python bench/swe_envs.py [--repeats 5] [--instances 16] [--json]

On the shipped project (samples/repos/inflection, 455 tests): the suite run `repeats` times in
this process's own interpreter outside any sandbox (the virtualenv's python, a copy of the
repository), then the same through rl.swe.python (bubblewrap, the virtualenv mounted read-only,
limits, the report plugin); then a build of `instances` instances from a fresh folder, timed
(one sandboxed suite run per mutant tried, one at a time: one core).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rl.swe.build import BuildConfig, build_source  # noqa: E402
from rl.swe.python import Python, run_limits  # noqa: E402
from rl.swe.sources import Source  # noqa: E402

PROJECT = REPO / "samples" / "repos" / "inflection"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    py = Python()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = tmp / "venv"
        py.install(PROJECT, env, ["pytest"], offline=True)
        repo = tmp / "repo"
        shutil.copytree(PROJECT, repo)
        plain, boxed = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            r = subprocess.run([str(env / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=repo,
                               capture_output=True, text=True)
            plain.append(time.perf_counter() - t0)
            assert r.returncode == 0, r.stdout[-500:]
            run = py.run_tests(PROJECT, env, [], run_limits(120))
            boxed.append(run.seconds)
            assert run.status == "ok" and len(run.passed) == 455, run.output
        t0 = time.perf_counter()
        report = build_source(Source(name="inflection", kind="path", path=str(PROJECT)), tmp / "build", tmp / "cache",
                              BuildConfig(instances_per_source=args.instances, mutants_per_file=200, offline=True), 0)
        build_s = time.perf_counter() - t0
    out = {"plain_s": statistics.median(plain), "sandboxed_s": statistics.median(boxed),
           "overhead_ratio": statistics.median(boxed) / statistics.median(plain),
           "instances": report["instances"], "mutants_tried": report["mutants_tried"], "build_s": build_s,
           "instances_per_cpu_minute": report["instances"] / (build_s / 60),
           "settings": {"repeats": args.repeats, "instances": args.instances, "tests": 455}}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"suite (455 tests): plain {out['plain_s']:.2f} s, sandboxed {out['sandboxed_s']:.2f} s = "
              f"{out['overhead_ratio']:.2f}x; build: {out['instances']} instances from {out['mutants_tried']} mutants "
              f"in {build_s:.0f} s = {out['instances_per_cpu_minute']:.1f} per CPU-minute")


if __name__ == "__main__":
    main()
