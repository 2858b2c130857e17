"""calc_arith: rl.arithmetic's addition prompt with a calculator tool, for the tiny CPU preset.

The first user message is the plain arithmetic prompt (" 3 4 + 5 7 ="), so a model SFT-trained on
the arithmetic domain (sampled accuracy ~0.3-0.6) already gets reward without the tool: GRPO has
reward variance from the first step. The calculator (posttrain.sft_data.calculator, evaluated for
real) may be called any number of times; its result may be used or ignored. The reward reads only
the final answer (the assistant message without tool calls): 1 iff its leading digits are the
answer's digits (as rl.rewards' arithmetic reward), no bonus or penalty for tool use.

reverse_digits=True makes the tool print its result in the answer's format (" 1 9 0" for 91),
so copying the observation is an answer a width-32 model can learn; the default is the plain
calculator ("91").
"""
from __future__ import annotations

from typing import Sequence

from posttrain.chat_template import ToolCall
from rl import arithmetic
from rl.envs import RewardOutcome, StepResult, check_args, draw, register_env
from rl.rewards import arithmetic_reward
from rl.sample import Task
from posttrain.sft_data import CALCULATOR, calculator


@register_env("calc_arith")
class CalcArith:
    name = "calc_arith"

    def __init__(self, reverse_digits: bool = False, digits: int = arithmetic.DIGITS):
        self.reverse_digits, self.digits = bool(reverse_digits), int(digits)
        self.tools = [CALCULATOR]
        self.task: Task | None = None
        self.calls = 0

    def reset(self, task: Task) -> str:
        if task.domain != self.name:
            raise ValueError(f"calc_arith got a task of domain {task.domain!r}")
        self.task, self.calls = task, 0
        return task.prompt

    def _calc(self, expression: str) -> str:
        try:
            value = calculator(expression)
        except ValueError as e:
            return f"error: {e}"
        if self.reverse_digits and value.isdigit():
            return "".join(f" {d}" for d in reversed(value.zfill(self.digits + 1)))
        return value

    def step(self, calls: Sequence[ToolCall]) -> StepResult:
        obs = []
        for c in calls:
            self.calls += 1
            obs.append(check_args(c, self.tools) or self._calc(str(c.arguments["expression"])))
        return StepResult(obs, False, {"tool_calls": self.calls})

    def final_reward(self, answer: str) -> RewardOutcome:
        if self.task is None:
            raise RuntimeError("final_reward before reset")
        out = arithmetic_reward(answer, self.task)
        return RewardOutcome(out.score, out.status, f"{out.reason} after {self.calls} tool calls")

    @classmethod
    def tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        pool = [Task(cls.name, t.prompt, t.answer, t.meta) for t in
                (arithmetic.task(a, b) for a, b in arithmetic.pairs(split))]
        return draw(pool, split, n, seed)
