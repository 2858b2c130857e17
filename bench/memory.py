"""Process memory readings shared by the benchmarks (Linux): run each measurement in a fresh
process and report peak RSS minus the RSS just before the measured pass."""
from __future__ import annotations

import os
import resource


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux
