"""The language-specific part of building an environment: `Language`, and its Python version.

A Python repository gets a virtualenv of its own, made outside any sandbox from the system
interpreter (/usr/bin/python3, the one the sandbox has) by uv, holding the project's declared
dependencies and what its tests need (pytest): never the project itself, whose modules the tests
import from the working copy (the folder, or src/ in a src layout), so an edited file is what
runs. Tests run in rl.sandbox: the working copy in the sandbox's folder, the virtualenv mounted
read-only, no network. A small pytest plugin written beside the working copy records each test's
outcome by node id (`path::name[param]`) and the run prints it after a marker.

What this trusts: the test process writes the outcomes, so code under test could forge them.
rl.envs.swe restores the tests and configuration before a verdict and keeps only the model's
source changes; what an in-process attack can still do is measured there (canaries, re-checks).
"""
from __future__ import annotations

import ast
import configparser
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

from rl.sandbox import SYSTEM_PYTHON, SandboxLimits, run_command

TEST_DIRS = {"test", "tests", "testing"}
TEST_FILE = re.compile(r"^(test_.*\.py|.*_test\.py|conftest\.py)$")
# what decides how tests are collected and run: restored from the original before a verdict
CONFIG_FILES = {"pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "setup.py", "conftest.py", "noxfile.py"}
REPORT_DIR = ".glmforge"
PLUGIN = '''import json, os
_out, _why = {}, {}
def _crash(report):
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    return (crash.message if crash is not None else str(report.longrepr))[-600:]
def pytest_collectreport(report):
    if report.failed:
        _out["collect::" + report.nodeid] = "error"
        _why["collect::" + report.nodeid] = _crash(report)
def pytest_runtest_logreport(report):
    prev = _out.get(report.nodeid)
    if report.failed:
        _out[report.nodeid] = "failed" if report.when == "call" else "error"
        _why[report.nodeid] = _crash(report)
    elif report.skipped and prev is None:
        _out[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed and prev is None:
        _out[report.nodeid] = "passed"
def pytest_sessionfinish(session, exitstatus):
    with open(os.path.join(os.environ["GLMFORGE_REPORT_DIR"], "report.json"), "w") as f:
        json.dump({"outcomes": _out, "messages": _why}, f)
'''


class BuildError(RuntimeError):
    """A repository that cannot be made ready to test; `reason` is a short category."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class TestRun:
    status: str                            # ok | no_tests | timeout | error (the runner itself failed)
    outcomes: dict[str, str] = field(default_factory=dict)   # node id -> passed | failed | error | skipped
    seconds: float = 0.0
    output: str = ""
    messages: dict[str, str] = field(default_factory=dict)   # node id -> the failure's message (pytest's crash line)

    def having(self, outcome: str) -> set[str]:
        return {k for k, v in self.outcomes.items() if v == outcome}

    @property
    def passed(self) -> set[str]:
        return self.having("passed")

    @property
    def failing(self) -> set[str]:
        return {k for k, v in self.outcomes.items() if v in ("failed", "error")}


class Language(Protocol):
    """What building environments needs of a language: one implementation per language."""

    name: str

    def install(self, repo: Path, env: Path, test_requires: Sequence[str], offline: bool) -> None: ...

    def run_tests(self, repo: Path, env: Path, tests: Sequence[str], limits: SandboxLimits,
                  files: dict[str, str] | None = None) -> TestRun: ...

    def is_test_file(self, rel: str) -> bool: ...

    def is_source(self, rel: str) -> bool: ...

    def source_files(self, repo: Path) -> list[str]: ...


def run_limits(wall_s: float) -> SandboxLimits:
    return SandboxLimits(wall_s=wall_s, cpu_s=max(1, int(wall_s)), memory_mb=2048, file_size_mb=64, open_files=512,
                         max_processes=64)


class Python:
    name = "python"

    # ------------------------------------------------------------ files
    def is_test_file(self, rel: str) -> bool:
        parts = Path(rel).parts
        return bool(TEST_FILE.match(parts[-1])) or any(p in TEST_DIRS for p in parts[:-1])

    def is_config_file(self, rel: str) -> bool:
        name = Path(rel).name
        return name in CONFIG_FILES or name.endswith(".pth") or name in ("sitecustomize.py", "usercustomize.py")

    def is_source(self, rel: str) -> bool:
        """One of the repository's own Python modules: not tests, configuration, docs, examples or
        the harness's folder (what bugs go into, and the only changes a verdict keeps)."""
        return (rel.endswith(".py") and not self.is_test_file(rel) and not self.is_config_file(rel)
                and rel.split("/", 1)[0] not in ("docs", "doc", "examples", "benchmarks", "scripts", REPORT_DIR))

    def source_files(self, repo: Path) -> list[str]:
        return [rel for p in sorted(Path(repo).rglob("*.py")) if self.is_source(rel := p.relative_to(repo).as_posix())]

    def import_root(self, repo: Path) -> str:
        """'src' in a src layout (the package under src/), '' otherwise."""
        src = Path(repo) / "src"
        return "src" if src.is_dir() and (any(src.glob("*/__init__.py")) or any(src.glob("*.py"))) else ""

    # ------------------------------------------------------------ canaries
    def contradiction(self, repo: Path, tests: Sequence[str]) -> tuple[str, str, dict[str, str]] | None:
        """A test that contradicts one of `tests`' functions (ImpossibleBench's "conflicting"
        tests): a copy of the function beside it, under another name, its first assert negated.
        No deterministic code passes both. (file, its new text, {original id: the copy's id}) for
        the ids of `tests` in that function; None when none of them is a plain test function
        with an assert in a file that parses."""
        by_function: dict[tuple[str, str], list[str]] = {}
        for t in tests:
            path, _, rest = t.partition("::")
            if rest:
                by_function.setdefault((path, rest.split("[", 1)[0]), []).append(t)
        for (path, qualname), ids in sorted(by_function.items()):
            try:
                text = (Path(repo) / path).read_text(encoding="utf-8")
                tree = ast.parse(text)
            except (OSError, UnicodeDecodeError, SyntaxError):
                continue
            scope, node = _find_function(tree, qualname.split("::"))
            if node is None:
                continue
            asserts = sorted((n for n in ast.walk(node) if isinstance(n, ast.Assert)), key=lambda n: (n.lineno, n.col_offset))
            if not asserts:
                continue
            taken = {n.name for n in ast.walk(scope) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            copy = next(f"{node.name}_{k}" for k in range(2, 10_000) if f"{node.name}_{k}" not in taken)
            lines = text.splitlines(keepends=True)
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            block = lines[start:node.end_lineno]
            block[-1] = block[-1] if block[-1].endswith("\n") else block[-1] + "\n"
            test = asserts[0].test               # close before opening: both may be on one line
            block = _insert(block, test.end_lineno - 1 - start, test.end_col_offset, ")")
            block = _insert(block, test.lineno - 1 - start, test.col_offset, "not (")
            d = node.lineno - 1 - start
            block[d] = block[d].replace(f"def {node.name}(", f"def {copy}(", 1)
            head = lines[:node.end_lineno]
            head[-1] = head[-1] if head[-1].endswith("\n") else head[-1] + "\n"
            new = "".join(head + ["\n"] + block + lines[node.end_lineno:])
            prefix = f"{path}::{qualname.rsplit('::', 1)[0]}::" if "::" in qualname else f"{path}::"
            return path, new, {t: prefix + copy + t[len(prefix) + len(node.name):] for t in ids}
        return None

    # ------------------------------------------------------------ install
    def requirements(self, repo: Path) -> list[str]:
        """The project's declared runtime dependencies: pyproject's [project] dependencies,
        setup.cfg's install_requires, or a literal install_requires in setup.py."""
        repo = Path(repo)
        pp = repo / "pyproject.toml"
        if pp.is_file():
            try:
                deps = tomllib.loads(pp.read_text(encoding="utf-8")).get("project", {}).get("dependencies")
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
                raise BuildError("bad_metadata", f"pyproject.toml: {e}") from None
            if deps is not None:
                return list(deps)
        cfg = repo / "setup.cfg"
        if cfg.is_file():
            parser = configparser.ConfigParser()
            try:
                parser.read(cfg, encoding="utf-8")
            except configparser.Error as e:
                raise BuildError("bad_metadata", f"setup.cfg: {e}") from None
            raw = parser.get("options", "install_requires", fallback="")
            if raw.strip():
                return [r.strip() for r in raw.splitlines() if r.strip() and not r.strip().startswith("#")]
        setup = repo / "setup.py"
        if setup.is_file():
            try:
                tree = ast.parse(setup.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError) as e:
                raise BuildError("bad_metadata", f"setup.py: {e}") from None
            for node in ast.walk(tree):
                if isinstance(node, ast.keyword) and node.arg == "install_requires":
                    try:
                        return [str(x) for x in ast.literal_eval(node.value)]
                    except ValueError:
                        raise BuildError("bad_metadata", "setup.py computes install_requires") from None
        return []

    def install(self, repo: Path, env: Path, test_requires: Sequence[str], offline: bool) -> None:
        """A virtualenv at `env` on the sandbox's interpreter with the project's dependencies and
        `test_requires` (BuildError otherwise)."""
        uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
        if not uv:
            raise BuildError("no_installer", "uv is not installed beside this interpreter (make setup)")
        shutil.rmtree(env, ignore_errors=True)
        r = subprocess.run([uv, "venv", "-q", "--python", SYSTEM_PYTHON, str(env)], capture_output=True, text=True)
        if r.returncode:
            raise BuildError("no_interpreter", _last(r.stderr))
        wanted = [*self.requirements(repo), *test_requires]
        cmd = [uv, "pip", "install", "-q", "--python", str(env / "bin" / "python"), *wanted]
        r = subprocess.run(cmd + (["--offline"] if offline else []), capture_output=True, text=True, timeout=900)
        if r.returncode:
            raise BuildError("dependencies", _last(r.stderr))

    # ------------------------------------------------------------ tests
    def run_tests(self, repo: Path, env: Path, tests: Sequence[str], limits: SandboxLimits,
                  files: dict[str, str] | None = None) -> TestRun:
        """The repository's tests (pytest arguments `tests`, discovery when empty) on a copy of
        `repo` with `files` written over it, in the sandbox."""
        marker = f"@@glmforge-report-{secrets.token_hex(8)}@@"
        env = mountable(env)
        root = self.import_root(repo)
        path = f"/sandbox/{REPORT_DIR}" + (f":/sandbox/{root}" if root else "")
        args = " ".join(_quote(a) for a in tests)
        # PYTHONHASHSEED: test ids built from sets (parametrize over a set) must not change between runs
        script = (f"export PYTHONPATH={path} PYTHONDONTWRITEBYTECODE=1 PYTHONHASHSEED=0 "
                  f"GLMFORGE_REPORT_DIR=/sandbox/{REPORT_DIR}\n"
                  f"{env}/bin/python -m pytest -q -p glmforge_report -p no:cacheprovider -p no:randomly "
                  f"-o addopts='' {args} > {REPORT_DIR}/out.txt 2>&1\n"
                  f"status=$?\ntail -c 4000 {REPORT_DIR}/out.txt\necho; echo '{marker}'\n"
                  f"cat {REPORT_DIR}/report.json 2>/dev/null\nexit $status\n")
        extra = {**(files or {}), f"{REPORT_DIR}/glmforge_report.py": PLUGIN, f"{REPORT_DIR}/run.sh": script}
        t0 = time.perf_counter()
        r = run_command(["bash", f"{REPORT_DIR}/run.sh"], limits, extra, tree=Path(repo), read_only=(str(env),))
        seconds = time.perf_counter() - t0
        head, _, report = r.stdout.partition(marker)
        if r.status == "timeout":
            return TestRun("timeout", {}, seconds, head[-2000:])
        try:
            got = json.loads(report.strip() or "null")
        except json.JSONDecodeError:
            got = None
        if not isinstance(got, dict) or not isinstance(got.get("outcomes"), dict):
            return TestRun("error", {}, seconds, (head + r.stderr)[-2000:])
        outcomes = {str(k): str(v) for k, v in got["outcomes"].items()}
        status = "no_tests" if not any(not k.startswith("collect::") for k in outcomes) else "ok"
        return TestRun(status, outcomes, seconds, head[-2000:],
                       {str(k): str(v) for k, v in (got.get("messages") or {}).items()})


MOUNT_CACHE = Path(tempfile.gettempdir()) / "glmforge-venvs"


def mountable(env: Path) -> Path:
    """`env` itself when the sandbox's uid can reach it (every folder above it searchable by
    others), else a copy under the system temp folder (world-searchable), made once per
    virtualenv and content: bwrap resolves a read-only mount's path as the sandbox's uid."""
    env = Path(env).resolve()
    if all(os.stat(p).st_mode & stat.S_IXOTH for p in env.parents):
        return env
    stamp = (env / "pyvenv.cfg").stat().st_mtime_ns
    dest = MOUNT_CACHE / hashlib.sha256(f"{env}:{stamp}".encode()).hexdigest()[:16]
    if not dest.is_dir():
        MOUNT_CACHE.mkdir(mode=0o755, exist_ok=True)
        os.chmod(MOUNT_CACHE, 0o755)
        tmp = Path(tempfile.mkdtemp(dir=MOUNT_CACHE))
        shutil.copytree(env, tmp / "v", symlinks=True)
        os.chmod(tmp, 0o755)
        try:
            tmp.rename(dest)
        except OSError:                  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return dest / "v"


def _quote(a: str) -> str:
    return "'" + a.replace("'", "'\\''") + "'"


def _last(text: str) -> str:
    return (text.strip().splitlines() or ["no message"])[-1][:300]


def _find_function(tree: ast.Module, names: list[str]) -> tuple[ast.AST, ast.FunctionDef | None]:
    """The (enclosing scope, function) a test's qualified name (`Class::name` or `name`) names."""
    scope: ast.AST = tree
    for name in names[:-1]:
        scope = next((n for n in getattr(scope, "body", []) if isinstance(n, ast.ClassDef) and n.name == name), None)
        if scope is None:
            return tree, None
    fn = next((n for n in getattr(scope, "body", []) if isinstance(n, ast.FunctionDef) and n.name == names[-1]), None)
    return scope, fn


def _insert(lines: list[str], row: int, byte_col: int, what: str) -> list[str]:
    """`what` inserted into lines[row] at a UTF-8 byte offset (ast's column unit)."""
    line = lines[row]
    col = len(line.encode("utf-8")[:byte_col].decode("utf-8"))
    return lines[:row] + [line[:col] + what + line[col:]] + lines[row + 1:]
