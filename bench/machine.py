"""The machine a bench figure was taken on, for the line every bench prints beside its result."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().split("\n"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """'2 cpus <model>, Linux x86_64, Python 3.11.7'"""
    return (f"{os.cpu_count()} cpus {cpu_model()}, {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}")
