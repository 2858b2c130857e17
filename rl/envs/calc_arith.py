"""calc_arith: domains.arithmetic's addition prompt with a calculator tool, for the tiny CPU preset.

The first user message is the plain arithmetic prompt (" 3 4 + 5 7 ="), so a model SFT-trained on
the arithmetic domain (sampled accuracy ~0.3-0.6) already gets reward without the tool: GRPO has
reward variance from the first step. The calculator (domains.tools.calculator, evaluated for
real) may be called any number of times; its result may be used or ignored. The reward reads only
the final answer (the assistant message without tool calls): 1 iff its leading digits are the
answer's digits (as rl.rewards' arithmetic reward), no bonus or penalty for tool use.

The tool reads numbers in the domain's notation too: digits separated by spaces are one number
("3 4 + 5 7" is 34 + 57), so a call can copy the prompt's tokens. reverse_digits=True makes it print
its result in the answer's format (" 1 9 0" for 91), so copying the observation is an answer a
width-32 model can learn (posttrain.sft_data demonstrates exactly that); the default is the plain
calculator ("91"). schema_in_prompt=False leaves the calculator's schema out of the prompt (the
call is still checked against it): the chat template's tool preamble is ~190 tokens, three times
the tiny preset's DSA top-k of 64 and ten times the episode itself; a model SFT-trained on
schema-less demonstrations knows the tool without it.
"""
from __future__ import annotations

import re
from typing import Sequence

from chat.template import ToolCall
from domains import arithmetic
from domains.task import Task
from domains.tools import CALCULATOR, calculator
from rl.envs.base import StepResult, check_args, register_env
from rl.rewards import RewardOutcome, arithmetic_reward

_SPACED_DIGITS = re.compile(r"(?<=\d) +(?=\d)")     # "3 4" -> "34"


@register_env("calc_arith")
class CalcArith:
    name = "calc_arith"
    DIGITS = arithmetic.DIGITS          # operand digits of the tasks

    def __init__(self, reverse_digits: bool = False, digits: int | None = None, schema_in_prompt: bool = True):
        self.reverse_digits, self.digits = bool(reverse_digits), int(digits or self.DIGITS)
        self.tools = [CALCULATOR]
        self.prompt_tools = self.tools if schema_in_prompt else None
        self.task: Task | None = None
        self.calls = 0

    def reset(self, task: Task) -> str:
        if task.domain != self.name:
            raise ValueError(f"calc_arith got a task of domain {task.domain!r}")
        self.task, self.calls = task, 0
        return task.prompt

    def _calc(self, expression: str) -> str:
        try:
            value = calculator(_SPACED_DIGITS.sub("", expression))
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
        # the split convention of rl.envs.draw, as domains.arithmetic draws it (wide operands unlisted)
        return [Task(cls.name, t.prompt, t.answer, t.meta) for t in arithmetic.tasks(n, split, seed, cls.DIGITS)]


@register_env("calc_arith3")
class CalcArith3(CalcArith):
    """calc_arith on three-digit operands, sums the tiny model never learned to add: a direct answer
    almost never scores, a calculator call whose result is copied does (with reverse_digits)."""
    name = "calc_arith3"
    DIGITS = 3


@register_env("calc_arith4")
class CalcArith4(CalcArith):
    """calc_arith on four-digit operands: the call copies eight digits and the result five, past
    what copying three-digit demonstrations teaches (SFT needs four-digit calls:
    sft.data.arithmetic_tool_digits: 4)."""
    name = "calc_arith4"
    DIGITS = 4
