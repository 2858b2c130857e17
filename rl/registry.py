"""Name -> function tables that register themselves (rewards, re-checks, RL algorithms)."""
from __future__ import annotations

from typing import Callable


def registrar(table: dict, kind: str, name: str) -> Callable:
    """Decorator: the function becomes table[name]; a second function under one name is an error."""
    def deco(fn):
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered ({table[name].__module__})")
        table[name] = fn
        return fn
    return deco


def registered(table: dict, kind: str, name: str) -> str:
    """For config validation: the name, or a ValueError listing what is registered."""
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; registered: {', '.join(sorted(table))}")
    return name
