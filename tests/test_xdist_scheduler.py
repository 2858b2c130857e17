"""tests/_xdist_crash.py: a worker that dies mid-run is reported, and the rest of the suite still runs."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

SUITE = '''
import os, time, pytest

@pytest.mark.xdist_group("a")
def test_a1(): time.sleep(0.3)

@pytest.mark.xdist_group("a")
def test_a_dies(): os._exit(1)

@pytest.mark.xdist_group("a")
def test_a_after(): pass

@pytest.mark.xdist_group("b")
def test_b_dies_first(): os._exit(1)

@pytest.mark.xdist_group("b")
def test_b_after(): time.sleep(0.3)

def test_c(): time.sleep(0.5)

def test_d(): pass
'''


@pytest.mark.parametrize("workers", [1, 2])
def test_crashed_worker_is_reported_and_the_run_ends(tmp_path, workers):
    """Under pytest-xdist 3.8.0's own loadgroup scheduler this run hangs (workers=1) or reruns the
    test that killed its worker until the restart budget is spent (workers=2)."""
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "def pytest_xdist_make_scheduler(config, log):\n"
        "    from tests._xdist_crash import CrashSafeLoadGroup\n"
        "    return CrashSafeLoadGroup(config, log)\n")
    (tmp_path / "test_suite.py").write_text(SUITE)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
                          "--dist", "loadgroup", "test_suite.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 1, run.stdout[-3000:]
    assert "2 failed, 5 passed" in summary, run.stdout[-3000:]
    assert "FAILED test_suite.py::test_a_dies@a" in run.stdout
    assert "FAILED test_suite.py::test_b_dies_first@b" in run.stdout
