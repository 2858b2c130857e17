"""delayed: another environment with heavy-tailed tool and grading latency (benchmarks, tests).

Real agentic environments answer slowly and unevenly (a test suite, a web search, a build): a
few calls take far longer than the median. That is the case asynchronous rollouts exist for,
so bench/rl_async.py measures it with this wrapper: each step() and final_reward() first sleeps
a log-normal time (median `median_s`, shape `sigma`), seeded by (seed, the task's prompt, call
number) so every run of the same episode waits the same.
"""
from __future__ import annotations

import hashlib
import math
import random
import time
from typing import Any, Sequence

from chat.template import ToolCall
from domains.task import Task
from rl.envs.base import StepResult, make_env, register_env, tasks_for
from rl.rewards import RewardOutcome


@register_env("delayed")
class Delayed:
    name = "delayed"

    def __init__(self, inner: str = "calc_arith", median_s: float = 0.05, sigma: float = 1.5, seed: int = 0,
                 inner_args: dict[str, Any] | None = None):
        if median_s < 0 or sigma < 0:
            raise ValueError("delayed: median_s and sigma must be >= 0")
        self.inner = make_env(inner, **(inner_args or {}))
        self.inner_name, self.median_s, self.sigma, self.seed = inner, median_s, sigma, seed
        self.tools = self.inner.tools
        self._rng = random.Random(seed)

    def _wait(self) -> None:
        time.sleep(self.median_s * math.exp(self.sigma * self._rng.gauss(0.0, 1.0)))

    def reset(self, task: Task) -> str:
        key = hashlib.sha256(f"{self.seed}|{task.prompt}".encode()).digest()
        self._rng = random.Random(int.from_bytes(key[:8], "little"))
        inner = Task(self.inner_name, task.prompt, task.answer, task.meta)
        return self.inner.reset(inner)

    def step(self, calls: Sequence[ToolCall]) -> StepResult:
        self._wait()
        return self.inner.step(calls)

    def final_reward(self, answer: str) -> RewardOutcome:
        self._wait()
        return self.inner.final_reward(answer)

    @classmethod
    def tasks(cls, split: str, n: int, seed: int, inner: str = "calc_arith") -> list[Task]:
        return [Task(cls.name, t.prompt, t.answer, t.meta) for t in tasks_for(inner, split, n, seed)]
