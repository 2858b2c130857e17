"""Multi-turn episodes with tools, token-in-token-out (TITO).

A group of `n` samples of one task runs turn by turn, batched: each turn continues every
active sample's token ids with the rollout engine; a turn that ends on <|observation|> with tool
calls is executed by the environment and the tool results are appended as token ids (loss mask
0); a turn that ends otherwise is the final answer, scored by the environment.

Token ids only ever grow by appending: the history is never decoded and re-encoded, so the
trainer sees exactly the ids the engine sampled (a decode -> encode round trip can merge or split
tokens differently; tests/rl/test_agent.py has such a case). The one exception is a context
manager that rewrites history (keep-recent-k elision, a reset at a token threshold, or a
template that drops earlier reasoning): the trajectory then forks — the ids so far become one
training sample, and the episode goes on in a new sample whose prompt is the rewritten history,
encoded once. Both samples share the group and the episode's final reward.

Every generated token records the policy version of the engine that sampled it; the engine may
take new weights between turns, so one episode can span versions (the per-token off-policy
ledger the staleness rules read).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from chat.template import (
    ASSISTANT,
    END_THINK,
    END_TOOL_RESPONSE,
    OBSERVATION,
    THINK,
    TOOL_RESPONSE,
    Message,
    encode,
    parse_assistant,
)
from domains.task import Task
from rl.rollout import RolloutEngine, SamplingParams
from rl.sample import Sample, Status


class Env(Protocol):
    tools: list[dict]          # what a call is checked against; shown in the prompt unless prompt_tools says otherwise

    def reset(self, task: Task) -> str: ...

    def step(self, calls: list) -> Any: ...          # .observations: list[str], .done: bool

    def final_reward(self, answer: str) -> Any: ...  # .score, .status, .reason


# (messages so far) -> (messages to show instead, whether history was rewritten)
ContextManager = Callable[[list[Message]], tuple[list[Message], bool]]


def context_for(settings: dict[str, Any] | None, tokenizer, tools: list[dict]) -> ContextManager | None:
    """rl.envs.context.manage_context bound to {"keep_recent": k, "max_tokens": n}, or None."""
    if not settings:
        return None
    from rl.envs.context import TemplateTokenCounter, context_manager

    return context_manager(settings["keep_recent"], settings.get("max_tokens"),
                           TemplateTokenCounter(tokenizer, tools))


def prompt_tools(env: Env) -> list[dict] | None:
    """The tool schemas the prompt shows: env.prompt_tools where an environment sets it (None: the
    tools are known from training, not described), else env.tools."""
    return getattr(env, "prompt_tools", env.tools)


def seed_for(*parts: Any) -> int:
    """A generator seed from (seed, group id, turn, ...): rollouts do not depend on which worker
    runs them or in what order, so a re-routed or resumed group regenerates identically."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & (2**63 - 1)


def observation_ids(tokenizer, observations: list[str]) -> list[int]:
    """The template's continuation after an assistant turn that ended on <|observation|>: the
    tool results, then the next assistant marker with the empty think block (thinking off).
    It starts right after a special token, so encoding it alone gives the ids the template's
    full rendering would (special tokens split the text before BPE)."""
    text = "".join(f"{TOOL_RESPONSE}\n{o}\n{END_TOOL_RESPONSE}" for o in observations)
    return tokenizer.encode(text + ASSISTANT + THINK + END_THINK, add_special_tokens=False).ids


@dataclass
class _Episode:
    env: Any
    messages: list[Message]
    sample: Sample
    forks: list[Sample]
    done: bool = False


def run_group(engine: RolloutEngine, tokenizer, make_env: Callable[[], Env], task: Task, group: int, n: int,
              params: SamplingParams, max_turns: int, seed: int,
              context: ContextManager | None = None, on_turn: Callable[[], None] | None = None) -> list[Sample]:
    """n episodes of `task`; returns every training sample (forks included), all in `group`."""
    eps = []
    for _ in range(n):
        env = make_env()
        first = Message("user", env.reset(task), thinking=False)
        ids = encode(tokenizer, [first], prompt_tools(env), thinking_mode="turn", add_generation_prompt=True).ids
        eps.append(_Episode(env, [first], Sample(task, group, ids), []))
    obs_token = tokenizer.token_to_id(OBSERVATION)
    for turn in range(max_turns):
        active = [e for e in eps if not e.done]
        if not active:
            break
        if on_turn is not None:
            on_turn()                              # e.g. take new weights between turns
        gen = torch.Generator().manual_seed(seed_for(seed, group, turn))
        # one affinity key per group: its episodes share the prompt, and every turn returns to it
        outs = engine.complete([e.sample.prompt_ids + e.sample.response_ids for e in active], params, gen,
                               keys=[f"group/{group}"] * len(active))
        for e, (toks, lps, stopped, versions) in zip(active, outs):
            s = e.sample
            s.response_ids += toks
            s.rollout_logprobs += lps
            s.versions += versions
            s.loss_mask += [1] * len(toks)
            text = tokenizer.decode(toks, skip_special_tokens=False)
            parsed = parse_assistant(text, e.env.tools)
            calls = list(parsed.message.tool_calls) if stopped and toks[-1] == obs_token else []
            if not stopped:
                s.status = Status.TRUNCATED
            if calls and turn < max_turns - 1:
                result = e.env.step(calls)
                obs = list(result.observations)
                e.messages += [parsed.message, *(Message("tool", o) for o in obs)]
                more = observation_ids(tokenizer, obs)
                s.response_ids += more
                s.rollout_logprobs += [0.0] * len(more)
                s.versions += versions[-1:] * len(more)
                s.loss_mask += [0] * len(more)
                if getattr(result, "done", False):
                    _finish(e, parsed.message.content)
                elif context is not None:
                    _maybe_fork(e, tokenizer, context)
            else:
                _finish(e, parsed.message.content)
    for e in eps:
        if not e.done:
            _finish(e, "")
    return [x for e in eps for x in (*e.forks, e.sample)]


def _finish(e: _Episode, answer: str) -> None:
    outcome = e.env.final_reward(answer)
    check = None
    if outcome.status == "ok" and outcome.score >= 1.0 and hasattr(e.env, "recheck"):
        r = e.env.recheck()              # the reward-hacking signal (rl.reward_audit), never a reward
        check = r.score if r.status == "ok" else None
    cheat = e.env.canary_cheat() if hasattr(e.env, "canary_cheat") else None
    for s in (*e.forks, e.sample):
        s.text = answer
        s.reward = float(outcome.score)
        s.reward_reason = outcome.reason
        s.reward_recheck = check
        s.canary_cheat = cheat
        if outcome.status != "ok":
            s.status = Status.REWARD_ERROR
    e.done = True


def _maybe_fork(e: _Episode, tokenizer, context: ContextManager) -> None:
    shown, rewritten = context(e.messages)
    if not rewritten:
        return
    e.forks.append(e.sample)
    ids = encode(tokenizer, shown, prompt_tools(e.env), thinking_mode="turn", add_generation_prompt=True).ids
    e.sample = Sample(e.sample.task, e.sample.group, ids)
    e.messages = list(shown)
