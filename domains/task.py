"""One prompt of a verifiable domain: what SFT demonstrates, RL samples and rewards score."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    """One prompt of a verifiable domain. `meta` is JSON-serialisable (tests, tool specs, ids)."""

    domain: str
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)
