"""Runs a server command and takes it down when the stage that started it dies, `kill -9` included:
`python rl/server_guard.py PARENT_PID -- COMMAND...` (standard library only; the vLLM and native inference servers).

The guard leads the server's process group. Every half second it checks that PARENT_PID is still
its parent; once it is not, it sends SIGTERM to the whole group (the server, its engine core
and workers), waits up to GRACE_S seconds and then SIGKILLs what is left: vLLM's graceful shutdown
can wait forever on an open connection. It exits with the server's status when the server exits.
A kernel parent-death signal would not do: it fires when the *thread* that forked exits.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

GRACE_S = 10.0


def _take_down() -> None:
    os.killpg(0, signal.SIGTERM)                 # the guard too: it ignores SIGTERM below
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                time.sleep(0.2)
                continue
        except ChildProcessError:
            break
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> int:
    parent, sep, cmd = int(argv[0]), argv[1], argv[2:]
    if sep != "--" or not cmd:
        raise SystemExit("usage: server_guard.py PARENT_PID -- COMMAND...")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)    # the stage stops the whole group; we stay to finish it
    child = subprocess.Popen(cmd, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    while True:
        code = child.poll()
        if code is not None:
            return code
        if os.getppid() != parent:
            _take_down()
            return 1
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
