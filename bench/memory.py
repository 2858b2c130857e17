"""Process memory readings shared by the benchmarks (Linux): run each measurement in a fresh
process and report peak RSS minus the RSS just before the measured pass."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


def run_one_in_subprocess(script: str, name: str, length: int, argv: list[str]) -> dict:
    """`script --one NAME --lengths LENGTH ARGV...` in a fresh process (so its peak RSS is its
    own); returns the JSON dict the script prints last."""
    cmd = [sys.executable, script, "--one", name, "--lengths", str(length), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{name} at {length} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
