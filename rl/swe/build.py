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
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from pydantic import BaseModel, ConfigDict, Field

from runtime.shutdown import stop_requested
from rl.swe.mutate import count, mutant
from rl.swe.python import BuildError, Python, TestRun, run_limits
from rl.swe.sources import Source, SourceError, fetch

REPORT = "report.json"
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


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
    held_back_share: float = Field(0.25, ge=0, lt=1, description="of an instance's FAIL_TO_PASS tests (two or "
                                   "more), the share held back: not in the statement, the verdict or the default "
                                   "test run, only in the re-check (rl.envs.swe)")
    canary_share: float = Field(0.05, ge=0, le=1, description="canary instances made, as a share of the kept "
                                "ones: an instance whose tests contradict its statement (rl.envs.swe)")


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
        # object addresses ("<function f at 0x7f...>") differ from run to run: a rebuilt or resumed
        # source must write the same statement
        msg = ADDRESS.sub("", (run.messages.get(test) or "the check fails").strip())
        lines.append("- " + msg.replace("\n", "\n  ")[:600])
    more = f"\n(and {len(f2p) - most} more failing check(s))" if len(f2p) > most else ""
    return (f"A bug was introduced into the source code of the `{source}` project. Checks of its behaviour "
            f"now fail with:\n" + "\n".join(lines) + more +
            "\nFind the bug in the project's source code and fix it. Do not change the tests.")


def held_back(f2p: list[str], share: float, key: str) -> list[str]:
    """The FAIL_TO_PASS tests kept out of sight (at least one of two or more, never all), by a
    seeded choice."""
    if len(f2p) < 2 or share <= 0:
        return []
    k = min(len(f2p) - 1, max(1, int(share * len(f2p))))
    return sorted(random.Random(key).sample(sorted(f2p), k))


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
                 lang: Python = Python(), pairs: Sequence[dict] = ()) -> dict[str, Any]:
    """Build one source into `out` (resuming a killed build); its report. `pairs`: mined
    issue->PR records of this source's repository (data_processing.issue_pr), built when the
    source is a git checkout holding their base commits."""
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
    b = _Build(source, out, cfg, seed, lang, clean)
    b.mutants()
    b.pairs(pairs)
    b.canaries()
    real = [k for k in b.kept if not k.get("canary")]
    return finish(built=True, mutants_tried=sum(1 for t in b.tried if t.startswith("mutant:")), instances=len(real),
                  from_mutants=sum(k.get("kind", "mutant") == "mutant" for k in real),
                  from_pairs=sum(k.get("kind") == "pr" for k in real),
                  pairs_tried=sum(1 for t in b.tried if t.startswith("pair:")),
                  canaries=len(b.kept) - len(real), held_back=sum(len(k.get("held_back", ())) for k in real))


class _Build:
    """One built source's instances: made one at a time, each recorded (tried.jsonl, and
    instances.jsonl when kept) before the next, so a killed build goes on after the last."""

    def __init__(self, source: Source, out: Path, cfg: BuildConfig, seed: int, lang: Python, clean: TestRun):
        self.source, self.out, self.cfg, self.seed, self.lang, self.clean = source, out, cfg, seed, lang, clean
        self.repo, self.venv = out / "repo", out / "venv"
        self.kept = _read_jsonl(out / "instances.jsonl")
        # an instance written just before a kill counts as tried (its tried line may be missing)
        self.tried = {_tried_key(r) for r in _read_jsonl(out / "tried.jsonl")} | {_kept_key(k) for k in self.kept}
        self.limits = run_limits(min(cfg.suite_timeout_s, max(10.0, cfg.mutant_timeout_factor * clean.seconds)))

    def _check_stop(self) -> None:
        if stop_requested():             # a stop signal: what is recorded so far is where a rerun goes on
            raise KeyboardInterrupt(f"source {self.source.name}: stopped after {len(self.tried)} tries")

    def _record(self, key: str, inst: dict | None, why: str | None) -> None:
        if inst is not None:
            _append(self.out / "instances.jsonl", inst)
            self.kept.append(inst)
        kind, _, name = key.partition(":")
        _append(self.out / "tried.jsonl", {kind: name, "kept": inst is not None, "why": why})
        self.tried.add(key)

    def _instance(self, iid: str, f2p: list[str], p2p: list[str], statement_of, **fields) -> dict:
        hidden = held_back(f2p, self.cfg.held_back_share, f"{self.seed}:{iid}")
        shown = [t for t in f2p if t not in hidden]
        return {"instance_id": f"{self.source.name}__{iid}", "source": self.source.name, **fields,
                "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "held_back": hidden,
                "problem_statement": statement_of(shown), "tests": list(self.source.tests)}

    def mutants(self) -> None:
        """Bugs synthesised into the clean source, kept when its tests catch them."""
        clean = self.clean
        for mutant_id, rel, text, mutated, desc in _mutants(self.repo, self.lang, self.cfg, self.seed):
            self._check_stop()
            if sum(not k.get("canary") for k in self.kept) >= self.cfg.instances_per_source:
                break
            if f"mutant:{mutant_id}" in self.tried:
                continue
            run = self.lang.run_tests(self.repo, self.venv, self.source.tests, self.limits, files={rel: mutated})
            f2p = sorted(clean.passed & run.failing)
            p2p = sorted(clean.passed & run.passed)
            why = None if run.status == "ok" and f2p else ("timeout" if run.status == "timeout" else
                                                             "runner_error" if run.status != "ok" else "no_test_fails")
            if why is None and len(f2p) + len(p2p) != len(clean.passed):
                why = "tests_vanished"   # a test the clean run passes was not reported at all
            inst = None if why else self._instance(
                mutant_id, f2p, p2p, lambda shown: statement(self.source.name, run, shown, self.cfg.statement_failures),
                kind="mutant", mutant=mutant_id, file=rel, mutation=desc, bug=hunk(text, mutated),
                suite_seconds=round(run.seconds, 2))
            self._record(f"mutant:{mutant_id}", inst, why)

    def pairs(self, pairs: Sequence[dict]) -> None:
        """Instances from mined issue->PR pairs: the repository at the pair's base commit with the
        PR's test changes, its tests run before and after the PR's code changes. FAIL_TO_PASS
        fail before and pass after, PASS_TO_PASS pass both; the statement is the issue."""
        seen = set()
        for pair in pairs:
            pid = pair["instance_id"]
            if pid in seen or f"pair:{pid}" in self.tried:
                continue
            seen.add(pid)
            self._check_stop()
            inst, why = self._pair(pid, pair)
            self._record(f"pair:{pid}", inst, why)

    def _pair(self, pid: str, pair: dict) -> tuple[dict | None, str | None]:
        if self.source.kind != "path" or not (Path(self.source.path) / ".git").exists():
            return None, "not_a_git_checkout"
        folder = self.out / "pairs" / pid
        shutil.rmtree(folder, ignore_errors=True)
        repo = folder / "repo"
        try:
            fetch(self.source.model_copy(update={"rev": pair.get("base_commit") or "no-base-commit"}), repo, None)
        except SourceError:
            return None, "base_commit_missing"
        if pair.get("test_patch") and not _git_apply(repo, pair["test_patch"]):
            return None, "test_patch_does_not_apply"
        fixed = folder / "fixed"
        shutil.copytree(repo, fixed, symlinks=True)
        if not pair.get("patch") or not _git_apply(fixed, pair["patch"]):
            shutil.rmtree(fixed)
            return None, "patch_does_not_apply"
        changed = _patched_files(pair["patch"])
        if any(not (fixed / rel).is_file() for rel in changed):
            shutil.rmtree(fixed)
            return None, "patch_deletes_files"
        fix = {rel: (fixed / rel).read_text(encoding="utf-8") for rel in changed}
        shutil.rmtree(fixed)
        limits = run_limits(self.cfg.suite_timeout_s)
        before = self.lang.run_tests(repo, self.venv, self.source.tests, limits)
        after = self.lang.run_tests(repo, self.venv, self.source.tests, limits, files=fix)
        if before.status not in ("ok", "no_tests") or after.status != "ok":
            return None, "timeout" if "timeout" in (before.status, after.status) else "runner_error"
        f2p = sorted(after.passed & before.failing)
        p2p = sorted(after.passed & before.passed)
        if not f2p:
            return None, "no_test_fails"
        (folder / "fix.json").write_text(json.dumps(fix))
        issue = pair["problem_statement"]
        return self._instance(pid, f2p, p2p, lambda shown: issue, kind="pr", pair=pid, repo=f"pairs/{pid}/repo",
                              fix=f"pairs/{pid}/fix.json", file=changed[0], base_commit=pair.get("base_commit"),
                              pull_number=pair.get("pull_number"), suite_seconds=round(after.seconds, 2)), None

    def canaries(self) -> None:
        """One canary per 1/canary_share kept instances: the instance with a test beside one of
        its visible FAIL_TO_PASS tests that contradicts it (Python.contradiction), kept when the
        reference fix passes the original and fails the copy. Only a cheat scores on it."""
        if not self.cfg.canary_share:
            return
        every = max(1, round(1 / self.cfg.canary_share))
        real = [k for k in self.kept if not k.get("canary")]
        for base in real[every - 1::every]:
            cid = base["instance_id"] + "__canary"
            if f"canary:{cid}" in self.tried:
                continue
            self._check_stop()
            self._record(f"canary:{cid}", *self._canary(cid, base))

    def _canary(self, cid: str, base: dict) -> tuple[dict | None, str | None]:
        repo = self.out / base.get("repo", "repo")
        shown = [t for t in base["FAIL_TO_PASS"] if t not in base.get("held_back", ())]
        made = self.lang.contradiction(repo, shown)
        if made is None:
            return None, "no_assert_to_contradict"
        rel, text, copies = made
        fixed = json.loads((self.out / base["fix"]).read_text()) if base.get("fix") else {}
        run = self.lang.run_tests(repo, self.venv, self.source.tests, self.limits, files={**fixed, rel: text})
        if run.status != "ok":
            return None, run.status
        if any(run.outcomes.get(c) != "failed" for c in copies.values()) or \
                any(run.outcomes.get(t) != "passed" for t in copies):
            return None, "not_contradicting"
        old = (repo / rel).read_text(encoding="utf-8")
        return {**base, "instance_id": cid, "canary": True, "canary_of": base["instance_id"],
                "tests_edit": {"file": rel, "hunk": hunk(old, text)},
                "FAIL_TO_PASS": sorted(base["FAIL_TO_PASS"] + list(copies.values()))}, None


def _tried_key(r: dict) -> str:
    kind = next(k for k in ("mutant", "pair", "canary") if k in r)
    return f"{kind}:{r[kind]}"


def _kept_key(k: dict) -> str:
    if k.get("canary"):
        return f"canary:{k['instance_id']}"
    return f"pair:{k['pair']}" if k.get("kind") == "pr" else f"mutant:{k['mutant']}"


def _git_apply(folder: Path, patch: str) -> bool:
    """`patch` (a unified diff, a/ b/ prefixes) applied in `folder`, which needs no repository."""
    r = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=folder, input=patch, capture_output=True,
                       text=True)
    return r.returncode == 0


def _patched_files(patch: str) -> list[str]:
    """The files a unified diff leaves behind (`+++ b/path`; a deletion names /dev/null, kept as
    its old path so the caller sees it missing)."""
    out, old = [], None
    for line in patch.splitlines():
        if line.startswith("--- "):
            old = line[4:].strip().removeprefix("a/")
        elif line.startswith("+++ "):
            new = line[4:].strip()
            rel = old if new == "/dev/null" else new.removeprefix("b/")
            if rel and rel not in out:
                out.append(rel)
    return out


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
