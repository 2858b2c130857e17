"""Hybrid rewards for general RL: rule rewards, an outcome reward model (ORM), a generative reward
model (GRM), and the service that runs a judge with a deadline.

    rules   format (parse_assistant: template well formed, think blocks closed, tool calls valid
            against the declared tools), language (share of ASCII letters among the letters: the
            prompts are English) and, where the prompt declares tools, tool (tool_rule: a call
            the tool runs 1, no call 0.5, a malformed call or one the tool refuses 0); each in
            [0, 1], `rule` is their mean
    orm     sigmoid of the reward-model stage's score (posttrain.reward_model), standardised by the
            scores' mean and std on its held-out replies; it reads the conversation as the policy
            saw and wrote it: the declared tools and the raw reply, tool calls included
    grm     an earlier checkpoint prompted with a rubric that says what a good reply does, tools
            included, shown the tools offered and the reply with its calls written out
            (judge_view), through the rollout engine: the first integer 0-10 of its greedy reply
            / 10, or the expected verdict over its first token's distribution (grm_judge); no
            verdict: the component is missing
Every judge takes (task, raw reply) items: the reply decoded with its special tokens, so a tool
call is something each judge can see (decoded without them, a call is only its argument text).
    length  -max(0, len - target) / target: the length penalty, a guard against reward hacking by
            verbosity (the ORM and a small GRM both tend to prefer longer answers)

JudgeService runs a judge (a callable on a list of items, returning one score or None per item) in
a daemon thread, chunk by chunk, each chunk with its own deadline. A chunk past its deadline and
every chunk after it come back as timeouts (those samples fail, the step goes on); the hung thread
is told to stop after its current chunk and its results are discarded; the next call starts a new
thread. A thread cannot be killed, so a truly hung judge keeps its thread: the judges here are in-
process models (no native code that can hang forever), and a model-executing reward that can hang
belongs in rl.rewards.RewardWorker's killable process instead.
"""
from __future__ import annotations

import json
import math
import queue
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from chat.template import parse_assistant
from domains.task import Task

COMPONENTS = ("rule", "orm", "grm")

Judge = Callable[[list[tuple[Task, str]]], list[Optional[float]]]


# ---------------------------------------------------------------- rules
def language_score(text: str) -> float:
    """Share of ASCII letters among the letters of `text` (1.0 with no letters at all)."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 1.0
    return sum(c.isascii() for c in letters) / len(letters)


def tool_rule(raw_text: str, tools: Sequence[dict] | None) -> float | None:
    """On a prompt that declares tools: 1.0 when the reply calls a tool and every call parses
    against the declared tools and the tool runs it (rl.rewards.run_tool: the calculator evaluates
    the expression), 0.5 for a reply without a call, 0.0 for a malformed call or one the tool
    refuses. None without tools. A plain answer is allowed, a working call pays more, a broken
    one less; whether the call computes the right thing is not the rule's to know (the verified
    outcome's, never rewarded)."""
    return _tool_score(parse_assistant(raw_text, tools=tools), raw_text) if tools else None


def _tool_score(parsed, raw_text: str) -> float:
    from chat.template import TOOL_CALL
    from rl.rewards import run_tool

    if not parsed.message.tool_calls:
        return 0.0 if TOOL_CALL in raw_text else 0.5
    if not parsed.ok:
        return 0.0
    runs = all(not run_tool(c.name, c.arguments).startswith("error:") for c in parsed.message.tool_calls)
    return 1.0 if runs else 0.0


def rule_reward(raw_text: str, tools: Sequence[dict] | None = None) -> dict[str, float]:
    """format: 1.0 when the raw assistant text (special tokens kept) parses without error against
    `tools`; language: language_score of its content; tool: tool_rule (only with tools); rule:
    their mean."""
    parsed = parse_assistant(raw_text, tools=tools)
    out = {"format": float(parsed.ok), "language": language_score(parsed.message.content or "")}
    if tools:
        out["tool"] = _tool_score(parsed, raw_text)
    out["rule"] = sum(out.values()) / len(out)
    return out


def valid_tool_call(raw_text: str, tools: Sequence[dict]) -> bool:
    """The reply makes at least one tool call and parses cleanly against `tools` (the gates'
    tool_call_validity)."""
    parsed = parse_assistant(raw_text, tools=tools)
    return parsed.ok and bool(parsed.message.tool_calls)


def judge_view(raw_text: str, tools: Sequence[dict] | None) -> str:
    """The reply as a reader sees it: its content, then each tool call written out as
    `[tool call] name({arguments})`, or `[malformed tool call]` when its markup does not parse
    against `tools` (the GRM's view: a rubric prompt cannot carry the special tokens themselves)."""
    from chat.template import TOOL_CALL

    parsed = parse_assistant(raw_text, tools=tools)
    text = (parsed.message.content or "").strip()
    if parsed.ok:
        calls = [f"[tool call] {c.name}({json.dumps(c.arguments, ensure_ascii=False)})" for c in parsed.message.tool_calls]
    else:
        calls = ["[malformed tool call]"] if TOOL_CALL in raw_text else []
    return "\n".join([text, *calls] if text else calls)


def tools_line(tools: Sequence[dict] | None) -> str:
    """The tools a prompt offers, one line for the GRM: name (parameters): description."""
    if not tools:
        return "none"
    out = []
    for t in tools:
        f = t.get("function", t)
        params = ", ".join((f.get("parameters") or {}).get("properties") or {})
        out.append(f"{f.get('name')}({params}): {f.get('description', '')}".strip())
    return "; ".join(out)


def length_penalty(n_tokens: int, target: int) -> float:
    return -max(0, n_tokens - target) / target


# ---------------------------------------------------------------- GRM
RUBRIC = ("You are grading an assistant's reply. A good reply is correct, helpful, clear and concise. When "
          "tools are offered, a good reply calls a tool for a computation it cannot do reliably itself, with "
          "well-formed arguments that compute a step of the problem, instead of guessing a number; a malformed "
          "tool call is worse than none. Rate the reply from 0 (useless or wrong) to 10 (what a good reply "
          "does). Reply with the number only.\n\nTools offered: {tools}\n\nQuestion: {prompt}\n\nReply: {reply}")
_INT = re.compile(r"\d+")


def parse_grm_score(text: str) -> float | None:
    """The first integer of the judge's reply, if in 0..10, as a score in [0, 1]."""
    m = _INT.search(text)
    if m is None:
        return None
    v = int(m.group())
    return v / 10 if 0 <= v <= 10 else None


def score_token_ids(tokenizer) -> dict[int, list[int]]:
    """The token ids that begin a 0-10 verdict: for each value, its digits with and without a
    leading space, where the vocabulary has them as one token."""
    out: dict[int, list[int]] = {}
    for v in range(11):
        ids = {tokenizer.token_to_id(form) for form in (str(v), f" {v}", f"\u0120{v}")} - {None}
        if ids:
            out[v] = sorted(ids)
    if not out:
        raise ValueError("GRM: the tokenizer has no single-token numbers 0-10 to read a verdict from")
    return out


def grm_judge(engine, tokenizer, scoring: str = "parse", max_new_tokens: int = 4, min_number_mass: float = 0.05,
              max_reply_chars: int = 2000) -> Judge:
    """A GRM over a RolloutEngine (the judge's own weights), the rubric as one user turn.

    scoring "parse": a greedy completion of up to max_new_tokens, parse_grm_score (a judge that
    reasons before its verdict). "expected": the verdict read from the first token's distribution
    (G-Eval, Liu et al. 2023): sum over v of p(v) * v / 10, renormalised over the number tokens; no
    score when they carry under min_number_mass of the probability (the judge is not answering
    with a number). A small judge's greedy first token is rarely a number, and a one-token verdict
    moves in steps of 0.1; the expectation is defined whenever the judge leans numeric at all and
    moves continuously with its confidence."""
    from rl.rollout import SamplingParams, prompt_ids

    if scoring not in ("parse", "expected"):
        raise ValueError(f"GRM scoring must be 'parse' or 'expected', got {scoring!r}")
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    numbers = score_token_ids(tokenizer) if scoring == "expected" else {}

    def judge(items: list[tuple[Task, str]]) -> list[Optional[float]]:
        prefixes = [prompt_ids(tokenizer, Task("grm", RUBRIC.format(
            tools=tools_line(t.meta.get("tools")), prompt=t.prompt,
            reply=judge_view(r, t.meta.get("tools"))[:max_reply_chars]), "")) for t, r in items]
        if scoring == "parse":
            out = engine.complete(prefixes, params, torch.Generator())
            return [parse_grm_score(tokenizer.decode(toks, skip_special_tokens=True)) for toks, *_ in out]
        p = engine.next_token_logprobs(prefixes).exp()
        mass = torch.stack([p[:, ids].sum(-1) for ids in numbers.values()], -1)      # [N, values]
        total = mass.sum(-1)
        expected = (mass * torch.tensor([v / 10 for v in numbers])).sum(-1) / total.clamp_min(1e-12)
        return [float(e) if m >= min_number_mass else None for e, m in zip(expected, total)]

    return judge


def orm_judge(orm, tokenizer, max_len: int, mean: float = 0.0, std: float = 1.0,
              scales: dict[str, dict[str, float]] | None = None) -> Judge:
    """The ORM (posttrain.reward_model.RewardModel) as a judge: sigmoid((score - mean) / std) per
    item, mean and std those of the ORM's scores on its held-out replies: of the item's family of
    prompts when `scales` has it ("tools": the prompt declares tools, "plain": it does not), else
    the overall ones. A Bradley-Terry head is defined only up to a shift and a scale; unstandardised,
    its sigmoid sat at 0.50 +- 0.02 on the tiny preset and drowned under the rule rewards' 0/1
    steps, and one scale for both families let the tool replies' wide spread flatten the plain ones."""
    from chat.template import reply_ids

    scale = {None: (mean, std)}
    for family, s in (scales or {}).items():
        scale[family] = (s["mean"], s["std"])
    if any(sd <= 0 for _, sd in scale.values()):
        raise ValueError(f"ORM judge: score std must be > 0, got {scale}")

    @torch.no_grad()
    def judge(items: list[tuple[Task, str]]) -> list[Optional[float]]:
        ids = [reply_ids(tokenizer, t.prompt, r, max_len, t.meta.get("tools")) for t, r in items]
        out = []
        for (t, _), s in zip(items, orm.score_ids(ids).tolist()):
            m, sd = scale.get("tools" if t.meta.get("tools") else "plain", scale[None])
            out.append(1 / (1 + math.exp(-(s - m) / sd)))
        return out

    return judge


# ---------------------------------------------------------------- the service
@dataclass
class JudgeResult:
    scores: list[Optional[float]]       # None: no score (unparseable, or failed: see `failed`)
    failed: list[bool]                  # True: timed out or the judge raised (the sample fails)
    reason: str = ""


class JudgeService:
    """A judge with per-chunk deadlines (module doc). Thread-safe for one caller."""

    def __init__(self, name: str, judge: Judge, timeout_s: float, chunk: int = 16):
        if timeout_s <= 0 or chunk < 1:
            raise ValueError(f"judge {name}: timeout_s must be > 0 and chunk >= 1")
        self.name, self.judge, self.timeout_s, self.chunk = name, judge, timeout_s, chunk
        self.timeouts = 0

    def score(self, items: list[tuple[Task, str]]) -> JudgeResult:
        n = len(items)
        if n == 0:
            return JudgeResult([], [])
        chunks = [(k, items[k:k + self.chunk]) for k in range(0, n, self.chunk)]
        results: "queue.Queue[tuple[int, Any]]" = queue.Queue()
        stop = threading.Event()

        def run() -> None:
            for k, part in chunks:
                if stop.is_set():
                    return
                try:
                    out = list(self.judge(part))
                    if len(out) != len(part):
                        raise ValueError(f"judge {self.name} returned {len(out)} scores for {len(part)} items")
                    results.put((k, out))
                except BaseException as e:       # a failing judge fails its chunk, not the caller
                    results.put((k, e))

        threading.Thread(target=run, name=f"judge-{self.name}", daemon=True).start()
        scores: list[Optional[float]] = [None] * n
        failed = [True] * n
        reason = ""
        for _ in chunks:
            try:
                k, out = results.get(timeout=self.timeout_s)
            except queue.Empty:
                stop.set()                    # the thread's late results go to a queue nobody reads
                self.timeouts += 1
                reason = f"judge {self.name} timed out after {self.timeout_s}s"
                break
            if isinstance(out, BaseException):
                reason = f"judge {self.name} failed: {type(out).__name__}: {out}"
                continue
            for j, v in enumerate(out):
                scores[k + j] = None if v is None else float(v)
                failed[k + j] = False
        return JudgeResult(scores, failed, reason)


# ---------------------------------------------------------------- combining
def combine(components: dict[str, Optional[float]], weights: dict[str, float], length: float,
            length_weight: float) -> float:
    """Weighted mean of the present components (weights renormalised over them) plus the
    weighted length penalty."""
    present = {c: v for c, v in components.items() if v is not None and weights.get(c, 0) > 0}
    total_w = sum(weights[c] for c in present)
    base = sum(weights[c] * v for c, v in present.items()) / total_w if total_w > 0 else 0.0
    return base + length_weight * length


def disagreement(components: list[dict[str, Optional[float]]]) -> dict[str, float]:
    """Per pair of components and overall: the share of samples (with both / all present) whose
    verdicts (score >= 0.5) differ. A reward-hacking alarm: the policy exploiting one judge shows
    up as that judge drifting from the others."""
    out: dict[str, float] = {}
    pairs = [(a, b) for i, a in enumerate(COMPONENTS) for b in COMPONENTS[i + 1:]]
    for a, b in pairs:
        both = [(c[a] >= 0.5, c[b] >= 0.5) for c in components if c.get(a) is not None and c.get(b) is not None]
        if both:
            out[f"{a}_{b}"] = sum(x != y for x, y in both) / len(both)
    verdicts = [{v >= 0.5 for v in c.values() if v is not None} for c in components]
    multi = [v for v, c in zip(verdicts, components) if sum(x is not None for x in c.values()) >= 2]
    out["any"] = sum(len(v) > 1 for v in multi) / len(multi) if multi else 0.0
    return out
