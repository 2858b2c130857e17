"""GSM8K records: question, human-written rationale (calculator annotations lifted out) and the
final answer."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from data_processing.common import expand_path
from domains.tools import calculator, format_number, same_number

_ANNOT = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


@dataclass(frozen=True)
class Problem:
    question: str
    rationale: str     # human-written steps, annotations removed
    answer: str        # the final number after ####
    calls: tuple[tuple[str, str, str], ...]   # (text before the call on its line, expression, annotated result)


def read_gsm8k(path: str | Path) -> list[Problem]:
    out = []
    for line in Path(expand_path(path)).read_text(encoding="utf-8").split("\n"):  # not splitlines(): U+2028
        if not line.strip():
            continue
        rec = json.loads(line)
        body, _, final = rec["answer"].rpartition("####")
        calls = []
        for ln in body.strip().splitlines():
            for m in _ANNOT.finditer(ln):
                calls.append((_ANNOT.sub("", ln[: m.start()]).strip(), m.group(1).strip(), m.group(2).strip()))
        out.append(Problem(rec["question"].strip(), _ANNOT.sub("", body).strip(), final.strip().replace(",", ""),
                           tuple(calls)))
    return out


def calculator_results(p: Problem) -> list[str | None]:
    """What the calculator computes for each of the problem's annotated calls (None: an
    expression it cannot evaluate)."""
    out: list[str | None] = []
    for _, expr, _ in p.calls:
        try:
            out.append(calculator(expr))
        except ValueError:
            out.append(None)
    return out


def reproduced_steps(p: Problem) -> list[str] | None:
    """The calculator's results for the problem's calls when it reproduces every one of GSM8K's
    annotated results, else None."""
    results = calculator_results(p)
    if any(r is None or not same_number(r, note) for r, (_, _, note) in zip(results, p.calls)):
        return None
    return results  # type: ignore[return-value]


def extract_answer(text: str) -> str | None:
    """The final number of a reply: after '####' when present, else the last number."""
    tail = text.rpartition("####")[2] if "####" in text else text
    nums = re.findall(r"-?\d[\d,]*\.?\d*", tail)
    if not nums:
        return None
    n = nums[-1].replace(",", "").rstrip(".")
    try:
        return format_number(float(n))
    except ValueError:
        return None
