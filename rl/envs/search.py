"""search: answer a question about the Python stdlib from a local docstring corpus.

Corpus: posttrain.sft_data.stdlib_functions() (documented top-level functions of small pure-Python
stdlib modules, read with ast from this interpreter's stdlib). Each task quotes the summary line of
one function's docstring and asks which function of its module it documents; the summary must be
unique in the module and must not contain the function's name. Answer: the function's name alone
(`fill`, `textwrap.fill`; backticks, quotes, a trailing "()" or "." are ignored). Held out: a
crc32 of the dotted name, 20%.

Tools:
    search(query)  BM25 over each function's dotted name and docstring: the top 5 as
                   "module.function: summary line"
    open(name)     the docstring of a dotted (or bare) name, as posttrain.sft_data.DocIndex shows it

Long episodes are meant to run under rl.envs.context.manage_context (keep-recent-k, reset).
"""
from __future__ import annotations

import functools
import math
import re
import zlib
from collections import Counter
from typing import Sequence

from chat.template import ToolCall
from domains.task import Task
from rl.envs.base import StepResult, check_args, draw, function_spec, register_env
from rl.rewards import RewardOutcome

TOP_K = 5
HELDOUT_PER_MILLE = 200
_WORD = re.compile(r"[a-z0-9]+")


def _tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower().replace("_", " "))


def summary(doc: str) -> str:
    return " ".join(doc.split("\n\n")[0].split())


class BM25:
    def __init__(self, docs: dict[str, str], k1: float = 1.5, b: float = 0.75):
        self.names = list(docs)
        self.tf = [Counter(_tokens(f"{n} {d}")) for n, d in docs.items()]
        self.len = [sum(t.values()) for t in self.tf]
        self.avg = sum(self.len) / max(1, len(self.len))
        df = Counter(w for t in self.tf for w in t)
        self.idf = {w: math.log(1 + (len(self.tf) - c + 0.5) / (c + 0.5)) for w, c in df.items()}
        self.k1, self.b = k1, b

    def top(self, query: str, k: int) -> list[str]:
        q = set(_tokens(query))
        scores = []
        for i, tf in enumerate(self.tf):
            s = sum(self.idf[w] * tf[w] * (self.k1 + 1) / (tf[w] + self.k1 * (1 - self.b + self.b * self.len[i] / self.avg))
                    for w in q if w in tf)
            if s > 0:
                scores.append((-s, self.names[i]))
        return [n for _, n in sorted(scores)[:k]]


@functools.lru_cache(maxsize=2)
def _corpus(max_chars: int):
    """(functions by name, BM25, DocIndex): built once per process, never pickled."""
    from domains.tools import DocIndex, stdlib_functions
    fns = stdlib_functions()
    return {f.name: f for f in fns}, BM25({f.name: f.doc for f in fns}), DocIndex(fns, max_chars)


@functools.lru_cache(maxsize=1)
def _pool() -> tuple[Task, ...]:
    by_name, _, _ = _corpus(SearchEnv.DEFAULT_MAX_CHARS)
    per_module: dict[str, list] = {}
    for f in by_name.values():
        per_module.setdefault(f.name.rsplit(".", 1)[0], []).append(f)
    out = []
    for module, fns in sorted(per_module.items()):
        counts = Counter(summary(f.doc) for f in fns)
        for f in fns:
            bare, s = f.name.rsplit(".", 1)[1], summary(f.doc)
            if counts[s] > 1 or re.search(rf"\b{re.escape(bare)}\b", s) or len(s) < 20:
                continue
            prompt = (f"Which function of the Python standard-library module `{module}` has this documentation "
                      f"summary?\n\n\"{s}\"\n\nUse the tools to find it, then answer with the function's name only.")
            out.append(Task(SearchEnv.name, prompt, f.name, {"module": module, "summary": s}))
    return tuple(out)


def is_heldout(name: str) -> bool:
    return zlib.crc32(name.encode()) % 1000 < HELDOUT_PER_MILLE


def normalise(answer: str) -> str:
    a = answer.strip().strip("`'\" ").rstrip(".").strip("`'\" ")
    return a[:-2] if a.endswith("()") else a


@register_env("search")
class SearchEnv:
    name = "search"
    DEFAULT_MAX_CHARS = 1500

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS, top_k: int = TOP_K):
        if max_chars <= 0 or top_k <= 0:
            raise ValueError(f"search: max_chars and top_k must be > 0, got {max_chars}, {top_k}")
        self.max_chars, self.top_k = int(max_chars), int(top_k)
        self.tools = [function_spec("search", "Full-text search over Python standard-library docstrings; "
                                              "returns matching function names with their summary line.",
                                    {"query": "words to search for"}),
                      function_spec("open", "Show the docstring of a function by its dotted name (module.function).",
                                    {"name": "the function's dotted name"})]
        self.task: Task | None = None
        self.calls = 0

    def reset(self, task: Task) -> str:
        if task.domain != self.name:
            raise ValueError(f"search got a task of domain {task.domain!r}")
        self.task, self.calls = task, 0
        return task.prompt

    def _run(self, call: ToolCall) -> str:
        by_name, bm25, index = _corpus(self.max_chars)
        if call.name == "search":
            hits = bm25.top(str(call.arguments["query"]), self.top_k)
            if not hits:
                return "No results."
            return "\n".join(f"{n}: {summary(by_name[n].doc)}" for n in hits)
        return index.search(str(call.arguments["name"]))

    def step(self, calls: Sequence[ToolCall]) -> StepResult:
        obs = []
        for c in calls:
            self.calls += 1
            obs.append(check_args(c, self.tools) or self._run(c))
        return StepResult(obs, False, {"tool_calls": self.calls})

    def final_reward(self, answer: str) -> RewardOutcome:
        if self.task is None:
            raise RuntimeError("final_reward before reset")
        got, want = normalise(answer), self.task.answer
        if not got:
            return RewardOutcome(0.0, "ok", f"no answer after {self.calls} tool calls")
        ok = got in (want, want.rsplit(".", 1)[1])
        return RewardOutcome(float(ok), "ok", f"{'correct' if ok else 'wrong answer'} after {self.calls} tool calls")

    @classmethod
    def tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        pool = [t for t in _pool() if is_heldout(t.answer) == (split == "heldout")]
        return draw(pool, split, n, seed)
