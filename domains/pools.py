"""Prompt pools of the verifiable domains, as domains.task.Task lists.

    arithmetic  domains.arithmetic, train pairs (held-out pairs are for evaluation only)
    math        GSM8K train problems after the lines SFT holds out (final answer after ####)
    code        MBPP training ids (601-974): description + one example assert; all asserts run
    tool        GSM8K train problems answered with the calculator tool (XML tool calls)
Evaluation sets never feed these pools: GSM8K's test split and MBPP's test ids (11-510) are
read only by evaluation and decontamination.
"""
from __future__ import annotations

import json
from pathlib import Path

from data_processing.common import expand_path
from domains import arithmetic
from domains.task import Task

MBPP_TRAIN_IDS = range(601, 975)
DOMAINS = ("arithmetic", "math", "code", "tool")


def gsm8k_tasks(path: str, skip: int, domain: str = "math") -> list[Task]:
    from domains.gsm8k import read_gsm8k

    return [Task(domain, p.question, p.answer, {"line": skip + i + 1})
            for i, p in enumerate(read_gsm8k(path)[skip:])]


def mbpp_tasks(path: str, ids: range = MBPP_TRAIN_IDS) -> list[Task]:
    out = []
    p = expand_path(path)
    for n, line in enumerate(Path(p).read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            tid, tests = int(rec["task_id"]), list(rec["test_list"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{p}:{n}: not an MBPP record ({e})") from None
        if tid in ids:
            prompt = f"{rec['text'].strip()} Your code should pass this test:\n{tests[0]}"
            # the reference never enters a rollout or the reward: only the fresh-input re-check runs it
            out.append(Task("code", prompt, "", {"task_id": tid, "tests": tests, "reference": rec.get("code", ""),
                                                  "setup": rec.get("test_setup_code", "")}))
    return out


def load_pools(domains: dict[str, float], *, gsm8k_path: str, gsm8k_skip: int, mbpp_path: str
               ) -> dict[str, list[Task]]:
    """One pool per domain with a positive weight."""
    unknown = set(domains) - set(DOMAINS)
    if unknown:
        raise ValueError(f"unknown RL domains {sorted(unknown)}; known: {', '.join(DOMAINS)}")
    pools: dict[str, list[Task]] = {}
    for name, w in domains.items():
        if w <= 0:
            continue
        if name == "arithmetic":
            pools[name] = [arithmetic.task(a, b) for a, b in arithmetic.pairs("train")]
        elif name in ("math", "tool"):
            pools[name] = gsm8k_tasks(gsm8k_path, gsm8k_skip, name)
        else:
            pools[name] = mbpp_tasks(mbpp_path)
        if not pools[name]:
            raise ValueError(f"RL domain {name!r} has no prompts")
    if not pools:
        raise ValueError("every RL domain weight is 0: nothing to train on")
    return pools
