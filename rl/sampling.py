"""How a rollout engine samples: one value type every engine takes (the native one, the served
pools, vLLM), apart from the engines so that none of them imports another for it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
