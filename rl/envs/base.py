"""The environment interface (rl.envs describes it): StepResult, Environment, the registry
(register_env, make_env, tasks_for), the split convention (draw) and the tool-spec helpers
(function_spec, check_args). It imports no environment; the environments import it, and
rl.envs imports them to register them."""
from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from chat.template import ToolCall
from domains.task import Task
from rl.rewards import RewardOutcome

SPLITS = ("train", "heldout")


@dataclass
class StepResult:
    observations: list[str]                  # one per call, in order: the tool messages' contents
    done: bool = False                       # the environment ends the episode (then final_reward)
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    name: str
    tools: list[dict]

    def reset(self, task: Task) -> str: ...

    def step(self, calls: Sequence[ToolCall]) -> StepResult: ...

    def final_reward(self, answer: str) -> RewardOutcome: ...

    @classmethod
    def tasks(cls, split: str, n: int, seed: int) -> list[Task]: ...


ENVIRONMENTS: dict[str, type] = {}


def register_env(name: str) -> Callable[[type], type]:
    """Class decorator: ENVIRONMENTS[name] = cls, and cls.name = name."""
    def deco(cls: type) -> type:
        if name in ENVIRONMENTS and ENVIRONMENTS[name] is not cls:
            raise ValueError(f"environment {name!r} is already registered ({ENVIRONMENTS[name].__module__})")
        cls.name = name
        ENVIRONMENTS[name] = cls
        return cls
    return deco


def _get(name: str) -> type:
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(ENVIRONMENTS))}")
    return ENVIRONMENTS[name]


def make_env(name: str, **cfg: Any):
    return _get(name)(**cfg)


def tasks_for(name: str, split: str, n: int, seed: int, args: dict[str, Any] | None = None) -> list[Task]:
    """args: the environment's constructor arguments (env_args); those its `tasks` takes by name
    reach it (swe: `root`, the swe-envs artifact its tasks live in)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    cls = _get(name)
    wanted = inspect.signature(cls.tasks).parameters
    return cls.tasks(split, n, seed, **{k: v for k, v in (args or {}).items() if k in wanted})


def draw(pool: Sequence[Task], split: str, n: int, seed: int) -> list[Task]:
    """The split convention: train with replacement in a seeded order, held-out without (capped)."""
    if not pool:
        raise ValueError(f"empty {split} pool")
    rng = random.Random(seed)
    if split == "heldout":
        order = list(pool)
        rng.shuffle(order)
        return order[:n]
    return [rng.choice(pool) for _ in range(n)]


def function_spec(name: str, description: str, params: dict[str, str] | None = None) -> dict:
    """An OpenAI-style tool spec whose parameters are all required strings (name -> description)."""
    params = params or {}
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object",
                       "properties": {k: {"type": "string", "description": d} for k, d in params.items()},
                       "required": list(params)}}}


def check_args(call: ToolCall, tools: Sequence[dict]) -> str | None:
    """An error line for the model when the call names no tool or misses a required argument."""
    spec = next((t["function"] for t in tools if t["function"]["name"] == call.name), None)
    if spec is None:
        return f"error: no such tool {call.name!r} (tools: {', '.join(t['function']['name'] for t in tools)})"
    missing = [k for k in spec["parameters"].get("required", []) if k not in call.arguments]
    if missing:
        return f"error: {call.name} needs argument(s) {', '.join(missing)}"
    return None
