"""Each escape is tried INSIDE the sandbox and must fail there, with the host left intact.
Where this machine lacks the isolation primitive a test needs, the test skips and says so."""
from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from pathlib import Path

import pytest

from rl.sandbox import (OUTPUT_LIMIT, UID_BASE, UID_RANGE, SandboxLimits, isolation, run_command,
                        run_python)

REPO = Path(__file__).resolve().parents[2]


def need(key: str) -> None:
    if not isolation()[key]:
        pytest.skip(f"this machine has no {key} for the sandbox (isolation(): {isolation()})")


def sandbox_processes() -> list[int]:
    """Pids of live processes running as a sandbox uid."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            uid = int((p / "status").read_text().split("\nUid:")[1].split()[0])
        except (OSError, IndexError):
            continue
        if UID_BASE <= uid < UID_BASE + UID_RANGE:
            out.append(int(p.name))
    return out


def test_happy_path_prints_exit_code_files_and_stdin():
    r = run_python("import sys, os\nprint(open('data/in.txt').read(), sys.stdin.read())\n"
                   "print(sorted(os.environ))\nopen('out.txt', 'w').write('x')\nsys.exit(3)",
                   files={"data/in.txt": "hello"}, stdin="from stdin")
    assert r.status == "failed" and r.returncode == 3, r
    assert r.stdout.splitlines()[0] == "hello from stdin"
    assert r.stdout.splitlines()[1] == "['HOME', 'LANG', 'PATH', 'TMPDIR']"
    ok = run_python("print(6 * 7)")
    assert (ok.status, ok.returncode, ok.stdout, ok.stderr) == ("ok", 0, "42\n", "")
    assert 0 < ok.wall_s < 10
    cmd = run_command(["cat", "f.txt"], files={"f.txt": "via run_command"})
    assert (cmd.status, cmd.stdout) == ("ok", "via run_command")


def test_parent_secret_never_reaches_the_child():
    secret = uuid.uuid4().hex
    os.environ["GLMFORGE_TEST_SECRET"] = secret
    try:
        code = ("import os, glob\nprint(dict(os.environ))\n"
                "for f in glob.glob('/proc/*/environ'):\n"
                "    try: print(f, open(f, 'rb').read())\n"
                "    except OSError as e: print(f, e)\n")
        if not (isolation()["pid_namespace"] or isolation()["private_uid"]):
            pytest.skip("neither a pid namespace nor a private uid: /proc/<parent>/environ is readable")
        r = run_python(code)
        assert r.status == "ok", r
        assert "/proc/" in r.stdout        # it really looked
        assert secret not in r.stdout + r.stderr
        assert "GLMFORGE_TEST_SECRET" not in r.stdout
    finally:
        del os.environ["GLMFORGE_TEST_SECRET"]


def test_network_connect_to_loopback_fails():
    need("network_namespace")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        port = server.getsockname()[1]
        r = run_python("import socket\ns = socket.socket()\ns.settimeout(3)\n"
                       f"try:\n    s.connect(('127.0.0.1', {port})); print('CONNECTED')\n"
                       "except OSError as e:\n    print('blocked', e.errno)\n")
        assert r.status == "ok", r
        assert "blocked" in r.stdout and "CONNECTED" not in r.stdout
        with pytest.raises(BlockingIOError):
            server.accept()                       # nothing reached the server
        with socket.create_connection(("127.0.0.1", port), timeout=3):   # the host itself can
            time.sleep(0.05)
            conn, _ = server.accept()
            conn.close()


def test_fork_bomb_is_bounded_and_leaves_nothing():
    need("private_uid")
    code = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
            "            n = 0\n            continue\n        n += 1\n"
            "except OSError as e:\n    print('refused', e.errno, flush=True)\ntime.sleep(60)\n")
    t0 = time.monotonic()
    r = run_python(code, SandboxLimits(wall_s=3, max_processes=16))
    assert time.monotonic() - t0 < 10
    assert r.status == "timeout", r
    assert "refused" in r.stdout
    assert r.stdout.count("refused") <= 16         # at most max_processes processes ever ran
    assert sandbox_processes() == []


def test_writing_outside_the_folder_fails():
    need("readonly_filesystem")
    targets = [f"/tmp/{uuid.uuid4().hex}", str(REPO / f"sandbox-escape-{uuid.uuid4().hex}"),
               f"/dev/shm/{uuid.uuid4().hex}", f"/var/tmp/{uuid.uuid4().hex}"]
    code = "\n".join(f"try:\n    open({t!r}, 'w').write('x'); print('WROTE')\nexcept OSError as e:\n"
                     f"    print('refused', e.errno)" for t in targets)
    r = run_python(code + "\nopen('inside.txt', 'w').write('ok'); print(open('inside.txt').read())")
    assert r.status == "ok", r
    assert r.stdout.count("refused") == len(targets) and "WROTE" not in r.stdout
    assert r.stdout.rstrip().endswith("ok")
    for t in targets:
        assert not os.path.exists(t), t


def test_wall_clock_limit_kills_quickly():
    t0 = time.monotonic()
    r = run_python("import time\nprint('start', flush=True)\ntime.sleep(60)", SandboxLimits(wall_s=1.0))
    assert time.monotonic() - t0 < 5
    assert r.status == "timeout" and r.returncode is None
    assert r.stdout == "start\n"            # output up to the kill is kept
    assert 1.0 <= r.wall_s < 4


def test_cpu_limit():
    r = run_python("while True: pass", SandboxLimits(wall_s=20, cpu_s=1))
    assert r.status == "timeout" and r.returncode == -signal.SIGXCPU, r
    assert r.wall_s < 15


def test_memory_cap():
    small = run_python("x = bytearray(50 * 2**20); print(len(x))", SandboxLimits(memory_mb=256))
    assert small.status == "ok", small                 # the cap, not the code, stops the big one
    r = run_python("x = bytearray(2 * 2**30)", SandboxLimits(memory_mb=256))
    assert r.status == "memory" and "MemoryError" in r.stderr, r


def test_output_is_truncated():
    r = run_python("import sys\nsys.stdout.write('x' * 1_000_000)")
    assert r.status == "ok"
    assert r.stdout.startswith("x" * OUTPUT_LIMIT) and len(r.stdout) < OUTPUT_LIMIT + 100
    assert f"{1_000_000 - OUTPUT_LIMIT} more bytes truncated" in r.stdout


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="relative path"):
        run_python("print(1)", files={"../escape.txt": "x"})
    with pytest.raises(ValueError, match="main.py"):
        run_python("print(1)", files={"main.py": "x"})
    with pytest.raises(ValueError, match="wall_s"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match="sandbox PATH"):
        run_command(["no-such-program-xyz"])


def test_isolation_report():
    iso = isolation()
    for key in ("network_namespace", "pid_namespace", "readonly_filesystem", "private_uid", "rlimits",
                "empty_environment", "python", "unshare", "bwrap"):
        assert key in iso
    assert iso["python"]
