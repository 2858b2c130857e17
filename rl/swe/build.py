"""Building a source's environments: fetch, install, run the suite, synthesise bugs, keep the
instances the tests verify.

Per source, in `out/<name>/`:
    repo/             the clean files (what every instance starts from)
    venv/             the test environment (rl.swe.python), mounted read-only by the sandbox
    tried.jsonl       one line per mutant tried (kept or why not): a killed build resumes after it
    instances.jsonl   the kept instances
    report.json       written last: built or not (reason), tests collected / passing / seconds,
                      mutants tried, instances kept, seconds

A source is built when its suite runs and passes cleanly: at least one test passes and no more
than `max_failing_share` of them fail in the sandbox (those few are left out of every instance);
otherwise the report names the reason (fetch, dependencies, no_tests, tests_fail, timeout, ...).

An instance is one mutant of one source file (rl.swe.mutate) that fails at least one test the
clean repository passes (FAIL_TO_PASS) while the rest still pass (PASS_TO_PASS): both runs are
the validation, the clean run being the reference fix's. What the model sees is written from the
failing tests' messages (pytest's crash lines), never from the tests' code.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field

from glmforge.shutdown import stop_requested
from rl.swe.mutate import count, mutant
from rl.swe.python import BuildError, Python, TestRun, run_limits
from rl.swe.sources import Source, SourceError, fetch

REPORT = "report.json"


class BuildConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    instances_per_source: int = Field(200, ge=0, description="instances kept per source at most")
    mutants_per_file: int = Field(30, ge=1, description="mutants tried per source file at most")
    max_failing_share: float = Field(0.05, ge=0, lt=1, description="clean-run failures tolerated (left out of "
                                     "every instance), as a share of the tests")
    suite_timeout_s: float = Field(300.0, gt=0, description="one run of a source's test suite")
    mutant_timeout_factor: float = Field(5.0, gt=1, description="a mutant's run may take this many times the clean "
                                         "run (at least 10 s, at most suite_timeout_s): a mutant that loops forever "
                                         "is given up on quickly")
    offline: bool = Field(False, description="install test dependencies from the installer's cache only")
    statement_failures: int = Field(3, ge=1, description="failure messages quoted in a statement")


def hunk(old: str, new: str) -> dict[str, Any]:
    """The lines that differ between two versions of a file: {start, old, new} (0-based)."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    j = 0
    while j < min(len(a), len(b)) - i and a[len(a) - 1 - j] == b[len(b) - 1 - j]:
        j += 1
    return {"start": i, "old": a[i:len(a) - j], "new": b[i:len(b) - j]}


def apply_hunk(text: str, h: dict[str, Any], reverse: bool = False) -> str:
    """`text` with the hunk applied (reverse: undone); ValueError when it does not match."""
    lines = text.splitlines(keepends=True)
    before, after = (h["new"], h["old"]) if reverse else (h["old"], h["new"])
    start = h["start"]
    if lines[start:start + len(before)] != list(before):
        raise ValueError(f"the hunk at line {start + 1} does not match the file")
    return "".join(lines[:start] + list(after) + lines[start + len(before):])


def statement(source: str, run: TestRun, f2p: list[str], most: int) -> str:
    """The task as the model sees it: what failed, from the failures' messages, not the tests."""
    lines = []
    for test in f2p[:most]:
        msg = (run.messages.get(test) or "the check fails").strip()
        lines.append("- " + msg.replace("\n", "\n  ")[:600])
    more = f"\n(and {len(f2p) - most} more failing check(s))" if len(f2p) > most else ""
    return (f"A bug was introduced into the source code of the `{source}` project. Checks of its behaviour "
            f"now fail with:\n" + "\n".join(lines) + more +
            "\nFind the bug in the project's source code and fix it. Do not change the tests.")


def _read_jsonl(path: Path) -> list[dict]:
    """The whole lines of a file a kill may have cut; the file is rewritten to just those."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break                        # a line cut by a kill: the build resumes from the one before
    path.write_text("".join(json.dumps(r) + "\n" for r in out), encoding="utf-8")
    return out


def _append(path: Path, rec: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def build_source(source: Source, out: Path, cache: Path, cfg: BuildConfig, seed: int,
                 lang: Python = Python()) -> dict[str, Any]:
    """Build one source into `out` (resuming a killed build); its report."""
    out = Path(out)
    done = out / REPORT
    if done.is_file():
        return json.loads(done.read_text())
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"source": source.name, "kind": source.kind, "built": False, "reason": None}

    def finish(**kw) -> dict[str, Any]:
        report.update(kw, seconds=round(time.perf_counter() - t0, 2))
        tmp = done.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(done)
        return report

    repo = out / "repo"
    try:
        if not (out / "fetched").is_file():
            fetch(source, repo, cache)
            (out / "fetched").write_text("")
    except SourceError as e:
        return finish(reason="fetch", detail=str(e))
    try:
        if not (out / "installed").is_file():
            lang.install(repo, out / "venv", source.test_requires, cfg.offline)
            (out / "installed").write_text("")
    except BuildError as e:
        return finish(reason=e.reason, detail=f"source {source.name}: {e.detail}")
    clean = lang.run_tests(repo, out / "venv", source.tests, run_limits(cfg.suite_timeout_s))
    tests = [k for k in clean.outcomes if not k.startswith("collect::")]
    report.update(tests_collected=len(tests), tests_passing=len(clean.passed), tests_failing=len(clean.failing),
                  suite_seconds=round(clean.seconds, 2))
    if clean.status != "ok":
        return finish(reason=clean.status, detail=f"source {source.name}: {clean.output[-300:]}")
    if not clean.passed or len(clean.failing) > cfg.max_failing_share * len(tests):
        return finish(reason="tests_fail", detail=f"source {source.name}: {len(clean.failing)} of {len(tests)} tests "
                      f"fail on the clean repository, e.g. {sorted(clean.failing)[:3]}")
    kept = _read_jsonl(out / "instances.jsonl")
    # an instance written just before a kill counts as tried (its tried line may be missing)
    tried = {r["mutant"] for r in _read_jsonl(out / "tried.jsonl")} | {k["mutant"] for k in kept}
    limits = run_limits(min(cfg.suite_timeout_s, max(10.0, cfg.mutant_timeout_factor * clean.seconds)))
    for mutant_id, rel, text, mutated, desc in _mutants(repo, lang, cfg, seed):
        if stop_requested():             # a stop signal: what is recorded so far is where a rerun goes on
            raise KeyboardInterrupt(f"source {source.name}: stopped after {len(tried)} mutants")
        if len(kept) >= cfg.instances_per_source:
            break
        if mutant_id in tried:
            continue
        run = lang.run_tests(repo, out / "venv", source.tests, limits, files={rel: mutated})
        f2p = sorted(clean.passed & run.failing)
        p2p = sorted(clean.passed & run.passed)
        why = None if run.status == "ok" and f2p else ("timeout" if run.status == "timeout" else
                                                         "runner_error" if run.status != "ok" else "no_test_fails")
        if why is None and len(f2p) + len(p2p) != len(clean.passed):
            why = "tests_vanished"       # a test the clean run passes was not reported at all
        if why is None:
            inst = {"instance_id": f"{source.name}__{mutant_id}", "mutant": mutant_id, "source": source.name, "file": rel,
                    "mutation": desc, "bug": hunk(text, mutated), "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p,
                    "problem_statement": statement(source.name, run, f2p, cfg.statement_failures),
                    "tests": list(source.tests), "suite_seconds": round(run.seconds, 2)}
            _append(out / "instances.jsonl", inst)
            kept.append(inst)
        _append(out / "tried.jsonl", {"mutant": mutant_id, "kept": why is None, "why": why})
        tried.add(mutant_id)
    return finish(built=True, mutants_tried=len(tried), instances=len(kept))


def _mutants(repo: Path, lang: Python, cfg: BuildConfig, seed: int) -> Iterator[tuple[str, str, str, str, str]]:
    """(id, file, text, mutated text, description): up to mutants_per_file sites of each source
    file, in an order seeded by (seed, file), files interleaved so every file gets its turn; each
    mutant made when its turn comes (a large module has thousands of sites)."""
    queues = []
    for rel in lang.source_files(repo):
        try:
            text = (repo / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        order = list(range(count(text)))
        random.Random(f"{seed}:{rel}").shuffle(order)
        queues.append((rel, text, order[:cfg.mutants_per_file]))
    while any(order for _, _, order in queues):
        for rel, text, order in queues:
            if order:
                i = order.pop(0)
                made = mutant(text, i)
                if made is not None:
                    mutated, desc, line = made
                    yield f"{rel.replace('/', '.')}.{line}.{i}", rel, text, mutated, desc
