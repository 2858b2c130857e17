"""terminal: shell tasks in a sandboxed working folder, checked by a verifier script.

Each task (TEMPLATES, seeded parameters) ships its folder as text files (Task.meta["files"]), an
instruction and its checks (meta["checks"], plain data such as ["file_equals", path, text]).
The model has one tool, run(command): `bash cmd.sh` in the folder through rl.sandbox.run_command
(fresh namespaces, limits, non-root uid, wall-clock kill); stdout and stderr come back merged,
first OUTPUT_CHARS characters, with the exit code.

State between commands: every sandbox run starts in a new temporary folder, so a run ends by
packing the working folder (tar.gz, base64 on stdout) and the next run unpacks it first; file
contents, modes and subfolders persist, the shell (cwd, variables, background jobs) does not -
every command starts in the folder's root. A command that times out or leaves a folder too big to
pack keeps the previous state (the observation says so).

The verdict is trusted code: final_reward reads the last packed folder here, as data (regular
files and folders under w/ only, sizes bounded; a symlink, device or path outside w/ does not
count), and evaluates the checks in this process (CHECKS). Nothing runs in a sandbox for it and
the expected values never enter one: the commands cannot see them, print their way to a pass
or replace the verifier. The final answer text is not read.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import random
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Callable, Sequence

from chat.template import ToolCall
from domains.task import Task
from rl.envs.base import StepResult, check_args, function_spec, register_env
from rl.rewards import RewardOutcome
from rl.sandbox import SandboxLimits, run_command

OUTPUT_CHARS = 4096

# A run: restore the folder, run the command in w/, pack w/ and the command's output and status.
_RUN = r"""set -u
if [ -f state.b64 ]; then base64 -d state.b64 | tar -xzf - && rm -rf .meta state.b64 || { echo "restore failed" >&2; exit 97; }; fi
mkdir -p w .meta
(cd w && bash ../cmd.sh) </dev/null >.meta/out.full 2>&1
echo $? >.meta/rc
head -c %d .meta/out.full >.meta/out; rm -f .meta/out.full cmd.sh
tar -czf - w .meta | base64 -w0
""" % OUTPUT_CHARS
WORDS = ("alpha", "bravo", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper", "kepler",
         "lumen", "maple", "nectar", "onyx", "pepper", "quartz", "raven", "sierra", "tango", "umber", "violet")
CITIES = ("Oslo", "Lima", "Cairo", "Perth", "Quito", "Dakar", "Hanoi", "Sofia")
Template = Callable[[random.Random], tuple[str, dict[str, str], list]]


def _eq_file(path: str, want: str) -> list:
    """The file exists and its text, trailing spaces of each line and trailing newlines removed, is want."""
    return ["file_equals", path, want.rstrip()]


def _csv(rng: random.Random) -> tuple[list[tuple[int, str, int]], str]:
    rows = [(i + 1, rng.choice(CITIES), rng.randint(1, 999)) for i in range(rng.randint(12, 30))]
    return rows, "id,city,amount\n" + "".join(f"{i},{c},{a}\n" for i, c, a in rows)


def t_count_lines(rng):
    rows, text = _csv(rng)
    city = rng.choice([r[1] for r in rows])
    n = sum(city in line for line in text.splitlines())
    return (f"Count the lines of data.csv that contain {city} and write the number to answer.txt.",
            {"data.csv": text}, [_eq_file("answer.txt", str(n))])


def t_sum_column(rng):
    rows, text = _csv(rng)
    return ("Add up the amount column of data.csv (skip the header) and write the total to total.txt.",
            {"data.csv": text}, [_eq_file("total.txt", str(sum(a for *_, a in rows)))])


def t_largest_file(rng):
    names = rng.sample(WORDS, 5)
    sizes = rng.sample(range(10, 400), 5)
    files = {f"logs/{n}.log": "x" * (s - 1) + "\n" for n, s in zip(names, sizes)}
    best = names[sizes.index(max(sizes))]
    return ("Find the largest file in the logs folder and write its file name (like name.log, without the "
            "folder) to answer.txt.", files, [_eq_file("answer.txt", f"{best}.log")])


def t_rename_ext(rng):
    names = rng.sample(WORDS, rng.randint(3, 6))
    files = {f"notes/{n}.txt": f"note {n} {rng.randint(0, 99)}\n" for n in names}
    check = [_eq_file(f"notes/{n}.md", files[f"notes/{n}.txt"]) for n in names]
    check.append(["no_file_ending", "notes", ".txt"])
    return "Rename every .txt file in the notes folder to the same name ending in .md.", files, check


def t_sort_unique(rng):
    names = [rng.choice(WORDS) for _ in range(rng.randint(10, 25))]
    return ("Write the names of names.txt to sorted.txt, sorted alphabetically, each name once.",
            {"names.txt": "\n".join(names) + "\n"}, [_eq_file("sorted.txt", "\n".join(sorted(set(names))))])


def t_replace_word(rng):
    old, new = rng.sample(WORDS, 2)
    files, total = {}, 0
    for n in rng.sample(WORDS, 3):
        k = rng.randint(1, 4)
        total += k
        files[f"src/{n}.py"] = "".join(f"{old}_{i} = {i}\n" for i in range(k))
    check = [["no_text_under", "src", old], ["lines_containing", "src", ".py", new, total]]
    return f"Replace the word {old} with {new} in every file of the src folder.", files, check


def t_count_ext(rng):
    files = {}
    n_py = 0
    for d in rng.sample(["app", "lib", "tests", "tools", "docs"], 3):
        for w in rng.sample(WORDS, rng.randint(2, 5)):
            ext = rng.choice(["py", "py", "txt", "md"])
            files[f"project/{d}/{w}.{ext}"] = f"# {w}\n"
            n_py += ext == "py"
    return ("Count the .py files anywhere under the project folder and write the number to answer.txt.",
            files, [_eq_file("answer.txt", str(n_py))])


def t_error_codes(rng):
    lines, codes = [], set()
    for _ in range(rng.randint(15, 30)):
        level = rng.choice(["INFO", "WARN", "ERROR"])
        code = f"E{rng.randint(100, 120)}"
        if level == "ERROR":
            codes.add(code)
        lines.append(f"{level} {code} {rng.choice(WORDS)} happened")
    if not codes:
        lines.append("ERROR E101 falcon happened")
        codes.add("E101")
    return ("app.log has lines 'LEVEL CODE message'. Write the distinct codes of the ERROR lines to errors.txt, "
            "one per line, sorted.", {"app.log": "\n".join(lines) + "\n"}, [_eq_file("errors.txt", "\n".join(sorted(codes)))])


def t_backup(rng):
    names = rng.sample(WORDS, 4)
    files = {f"conf/{n}.{'cfg' if i % 2 == 0 else 'ini'}": f"{n}={rng.randint(0, 9)}\n" for i, n in enumerate(names)}
    cfgs = [p for p in files if p.endswith(".cfg")]
    check = [c for p in cfgs for c in (_eq_file("backup/" + p.split("/")[1], files[p]), _eq_file(p, files[p]))]
    check.append(["entries", "backup", len(cfgs)])
    return "Copy every .cfg file of the conf folder into a new folder backup (keep the originals).", files, check


def t_make_exec(rng):
    a, b = rng.randint(2, 50), rng.randint(2, 50)
    script = f"#!/bin/bash\necho $(( {a} * {b} ))\n"
    check = [["executable", "tool.sh"], _eq_file("out.txt", str(a * b))]
    return "Make tool.sh executable, run it, and write what it prints to out.txt.", {"tool.sh": script}, check


TEMPLATES: dict[str, Template] = {
    "count_lines": t_count_lines, "sum_column": t_sum_column, "largest_file": t_largest_file,
    "rename_ext": t_rename_ext, "sort_unique": t_sort_unique, "replace_word": t_replace_word,
    "count_ext": t_count_ext, "error_codes": t_error_codes, "backup": t_backup, "make_exec": t_make_exec}


def make_task(template: str, seed: int | str) -> Task:
    instruction, files, checks = TEMPLATES[template](random.Random(f"{template}:{seed}"))
    listing = "\n".join(f"  {p}" for p in sorted(files))
    prompt = (f"You are in a Linux shell working folder holding:\n{listing}\n\n{instruction}\n"
              "Use the run tool for shell commands (each starts in the folder's root). Answer briefly when done.")
    return Task(TerminalEnv.name, prompt, "", {"template": template, "seed": str(seed), "files": files,
                                              "checks": checks})


def _unpack(blob: str) -> tuple[str, int]:
    """(output, exit code) from a packed state; ValueError when it is not a complete archive."""
    try:
        raw = base64.b64decode(blob.strip(), validate=True)
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar:
            def text(name: str) -> str:
                f = tar.extractfile(name)
                if f is None:
                    raise ValueError(f"{name} is not a file")
                return f.read().decode("utf-8", errors="replace")
            return text(".meta/out"), int(text(".meta/rc").strip())
    except (binascii.Error, tarfile.TarError, KeyError, EOFError, OSError) as e:
        raise ValueError(f"not a packed folder: {type(e).__name__}: {e}") from None


MAX_FOLDER_BYTES = 16 * 1024 * 1024     # what read_folder unpacks at most (a small archive can expand a lot)


@dataclass(frozen=True)
class Entry:
    data: bytes
    mode: int


def read_folder(blob: str) -> dict[str, Entry]:
    """The regular files under w/ of a packed state, by path relative to w/. The archive is the
    commands' output, so it is read as data: no extraction, members other than regular files
    skipped, at most MAX_FOLDER_BYTES read."""
    try:
        raw = base64.b64decode(blob.strip(), validate=True)
        out, total = {}, 0
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar:
            for m in tar:
                parts = PurePosixPath(m.name).parts
                if not m.isreg() or len(parts) < 2 or parts[0] != "w" or ".." in parts:
                    continue
                total += m.size
                if total > MAX_FOLDER_BYTES:
                    raise ValueError(f"more than {MAX_FOLDER_BYTES} bytes of files")
                out["/".join(parts[1:])] = Entry(tar.extractfile(m).read(), m.mode)
        return out
    except (binascii.Error, tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise ValueError(f"not a packed folder: {type(e).__name__}: {e}") from None


def _text(e: Entry) -> str:
    # what `sed -e "s/[[:space:]]*$//" FILE` inside "$(...)" gives: trailing spaces per line, then trailing newlines, dropped
    lines = e.data.decode("utf-8", errors="replace").split("\n")
    return "\n".join(line.rstrip() for line in lines).rstrip("\n")


def _under(folder: dict[str, Entry], top: str) -> dict[str, Entry]:
    return {p: e for p, e in folder.items() if p.startswith(top.rstrip("/") + "/")}


def check_file_equals(folder: dict[str, Entry], path: str, want: str) -> str:
    if path not in folder:
        return f"missing {path}"
    return "" if _text(folder[path]) == want else f"wrong content in {path}"


def check_no_file_ending(folder: dict[str, Entry], top: str, suffix: str) -> str:
    left = [p for p in _under(folder, top) if p.count("/") == top.count("/") + 1 and p.endswith(suffix)]
    return f"{suffix} files left in {top}" if left else ""


def check_no_text_under(folder: dict[str, Entry], top: str, text: str) -> str:
    hit = [p for p, e in _under(folder, top).items() if text.encode() in e.data]
    return f"{text} still in {top}" if hit else ""


def check_lines_containing(folder: dict[str, Entry], top: str, suffix: str, text: str, n: int) -> str:
    files = [e for p, e in _under(folder, top).items() if p.count("/") == top.count("/") + 1 and p.endswith(suffix)]
    got = sum(text in line for e in files for line in e.data.decode("utf-8", errors="replace").splitlines())
    return "" if got == n else f"wrong count of {text}"


def check_entries(folder: dict[str, Entry], top: str, n: int) -> str:
    names = {p[len(top) + 1:].split("/")[0] for p in _under(folder, top)}
    return "" if len(names) == n else f"{top} holds other files"


def check_executable(folder: dict[str, Entry], path: str) -> str:
    return "" if path in folder and folder[path].mode & 0o111 else f"{path} is not executable"


CHECKS: dict[str, Callable[..., str]] = {
    "file_equals": check_file_equals, "no_file_ending": check_no_file_ending, "no_text_under": check_no_text_under,
    "lines_containing": check_lines_containing, "entries": check_entries, "executable": check_executable}


@register_env("terminal")
class TerminalEnv:
    name = "terminal"

    def __init__(self, wall_s: float = 10.0, cpu_s: int = 10, memory_mb: int = 512, file_size_mb: int = 4):
        self.limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, file_size_mb=file_size_mb)
        self.tools = [function_spec("run", "Run a bash command in the working folder; returns its output and exit code.",
                                    {"command": "the bash command line"})]
        self.task: Task | None = None
        self.state: str | None = None          # base64 tar.gz of the folder; None = the task's files
        self.calls = 0

    def reset(self, task: Task) -> str:
        if task.domain != self.name:
            raise ValueError(f"terminal got a task of domain {task.domain!r}")
        if not isinstance(task.meta.get("files"), dict) or not isinstance(task.meta.get("checks"), list):
            raise ValueError(f"terminal task {task.meta.get('template')!r}: meta needs 'files' (dict) and 'checks' (list)")
        self.task, self.state, self.calls = task, None, 0
        return task.prompt

    def _files(self) -> dict[str, str]:
        if self.task is None:
            raise RuntimeError("terminal: reset() first")
        if self.state is None:
            return {f"w/{p}": t for p, t in self.task.meta["files"].items()}
        return {"state.b64": self.state}

    def run(self, command: str) -> str:
        r = run_command(["bash", "-c", _RUN], self.limits, {**self._files(), "cmd.sh": command + "\n"})
        if r.status == "timeout":
            return f"error: the command timed out after {self.limits.wall_s:g}s; its changes were discarded"
        if r.status != "ok":
            return f"error: the command could not finish ({r.status}): {r.stderr[-500:]}; its changes were discarded"
        try:
            out, rc = _unpack(r.stdout)
        except ValueError:
            return "error: the working folder grew too large to keep; the command's changes were discarded"
        self.state = r.stdout.strip()
        return f"{out}{'' if not out or out.endswith(chr(10)) else chr(10)}[exit code {rc}]"

    def step(self, calls: Sequence[ToolCall]) -> StepResult:
        obs = []
        for c in calls:
            self.calls += 1
            obs.append(check_args(c, self.tools) or self.run(str(c.arguments["command"])))
        return StepResult(obs, False, {"tool_calls": self.calls})

    def final_reward(self, answer: str) -> RewardOutcome:
        if self.task is None:
            raise RuntimeError("terminal: reset() first")
        if self.state is None:
            folder = {p: Entry(t.encode(), 0o644) for p, t in self.task.meta["files"].items()}
        else:
            try:
                folder = read_folder(self.state)
            except ValueError as e:
                return RewardOutcome(0.0, "ok", f"the working folder cannot be read: {e}")
        for check in self.task.meta["checks"]:
            problem = CHECKS[check[0]](folder, *check[1:])
            if problem:
                return RewardOutcome(0.0, "ok", f"check failed: {problem}")
        return RewardOutcome(1.0, "ok", f"all {len(self.task.meta['checks'])} checks pass after {self.calls} commands")

    @classmethod
    def tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        names = sorted(TEMPLATES)
        rng = random.Random(f"terminal:{split}:{seed}")
        # the split is part of every task's parameter seed, so train and held-out folders differ
        return [make_task(names[i % len(names)] if split == "heldout" else rng.choice(names),
                          hashlib.sha256(f"{split}:{seed}:{i}".encode()).hexdigest()[:12]) for i in range(n)]
