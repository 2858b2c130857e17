"""Checks on processes a test started and stopped (Linux /proc): still alive, still in a session,
still holding a port."""
from __future__ import annotations

import socket
from pathlib import Path


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def session_members(sid: int) -> list[int]:
    """Live processes in session `sid`."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                f = (p / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if f[0] != "Z" and int(f[3]) == sid:
                out.append(int(p.name))
    return out
