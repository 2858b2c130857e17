"""Checks on processes a test started and stopped (Linux /proc, read through runtime.shutdown's
helpers): still alive, still in a session, still holding a port."""
from __future__ import annotations

import socket

from runtime.shutdown import _pids, _stat


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return _stat(pid)[2] != "Z"
    except OSError:
        return False


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def session_members(sid: int) -> list[int]:
    """Live processes in session `sid`."""
    out = []
    for pid in _pids():
        try:
            f = _stat(pid)
        except OSError:
            continue
        if f[2] != "Z" and int(f[5]) == sid:
            out.append(pid)
    return out


def descendants_running(module: bytes) -> list[int]:
    """This process's descendants whose command line runs `module` (`python -m MODULE ...`), not
    counting the launchers and guards that carry it as an argument (training.spawn, server_guard)."""
    import os

    from runtime.shutdown import descendants

    found = []
    for pid in descendants(os.getpid()):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if module in argv and b"training.spawn" not in argv and not any(a.endswith(b"server_guard.py") for a in argv):
            found.append(pid)
    return sorted(found)
