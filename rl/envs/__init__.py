"""Agentic RL environments: registered classes that hold one episode's state and run its tools.

The interface (what rl.agent.run_group drives; one fresh instance per episode):

    env = make_env(name, **cfg)          # constructor arguments from the stage config (env_args)
    env.tools                            # OpenAI-style function specs, shown through the chat template
    env.reset(task) -> str               # the episode's first user message
    env.step(calls) -> StepResult        # run one assistant turn's ToolCalls: one observation per call
    env.final_reward(answer) -> RewardOutcome   # the answer: the last assistant message without
                                         # tool calls ("" at max turns); score in [0, 1]; computed
                                         # by trusted code, never by what runs in the sandbox
    env.recheck() -> RewardOutcome       # optional: an independent check of a rewarded episode
                                         # (1 agrees, 0 disagrees, status "skipped"), never a reward

    tasks_for(name, split, n, seed) -> list[Task]   # Task.domain == name; meta is JSON (it travels
                                         # to rollout workers over the wire), so an episode needs
                                         # nothing but its Task and the constructor arguments
Splits are "train" and "heldout" (disjoint); "train" draws with replacement in a seeded order,
"heldout" without (capped at the pool).

An environment object is plain data (files as dicts of text, counters, a lazily built index), so
it pickles and can be constructed in any worker process. Every execution of model-written code
or shell commands goes through rl.sandbox with SandboxLimits.

Environments:
    swe          fix a synthesised bug in a real repository (the swe-envs stage's instances):
                 read_file / search / write_file / run_tests; the suite decides in a fresh sandbox
    swe_repair   fix an injected bug in an MBPP solution: read_file / write_file / run_tests
    terminal     shell tasks in a sandboxed working folder: run(command); a verifier script checks
    search       questions over the stdlib docstrings: search(query) / open(name)
    calc_arith   domains.arithmetic addition with a calculator tool (the tiny CPU preset);
                 calc_arith3 / calc_arith4 on three- / four-digit operands

manage_context (rl.envs.context) is the keep-recent-k / token-threshold context manager that
rl.agent.run_group takes as `context=` (bind its arguments with context_manager(...)).
"""
from __future__ import annotations

from chat.template import ToolCall
from rl.envs.base import (
    ENVIRONMENTS,
    SPLITS,
    Environment,
    StepResult,
    check_args,
    draw,
    function_spec,
    make_env,
    register_env,
    tasks_for,
)
from rl.rewards import RewardOutcome, recheck_outcome

__all__ = ["Environment", "StepResult", "ENVIRONMENTS", "register_env", "make_env", "tasks_for", "function_spec",
           "draw", "check_args", "SPLITS", "ToolCall", "RewardOutcome", "recheck_outcome", "manage_context", "context_manager",
           "TemplateTokenCounter"]

from rl.envs import calc_arith, delayed, search, swe, swe_repair, terminal  # noqa: E402,F401  (registration)
from rl.envs.context import TemplateTokenCounter, context_manager, manage_context  # noqa: E402
