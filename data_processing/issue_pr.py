"""Mine GitHub issue -> pull-request pairs as software-engineering data (SWE-bench style).

Input (config `issues`): JSONL of GitHub REST objects as `GET /repos/{o}/{r}/issues` returns
them (PRs appear there with a `pull_request` field holding `merged_at`); objects from
`GET /repos/{o}/{r}/pulls` (with `head`/`base`/`merged_at`) and wrapper lines
`{"repo": ..., "object": {...}}` are accepted too. Optional `pr_files`: JSONL of PR file lists
as `GET /repos/{o}/{r}/pulls/{n}/files` returns them, one line per PR, either
`{"repo": "o/r", "number": n, "files": [...]}` or a recorded exchange
`{"url": ".../repos/o/r/pulls/n/files", "response": [...]}`.

Linking follows GitHub's closing keywords: close/closes/closed, fix/fixes/fixed,
resolve/resolves/resolved, any letter case, an optional colon, then `#N`, `owner/repo#N` or a
full `https://github.com/owner/repo/issues/N` URL. GitHub needs the keyword before each issue
("Fixes #1, fixes #2"), so a bare list after one keyword links only its first issue, and a
plain mention ("see #12", "related to #12") links nothing. Title and body of the PR are read.

Each PR's files are split by path into code and test changes (a path with a directory named
test/tests/testing, or a file test_*.py / *_test.py / *_tests.py / conftest.py). FAIL_TO_PASS
names the test functions the test patch adds or changes (`path::name`, or
`path::Class::name` inside a test class), read from `def test...` lines and hunk contexts.

One record per (issue, merged PR) pair, in SWE-bench field names. Skipped PRs are written to
skipped.jsonl with the reason (unmerged, bot author, unlinked, linked issue not in the input,
no file list, test-only, no code change); malformed input lines go to quarantine.jsonl with
file, line and reason. The pairs also become documents (SWE-style text) for the corpus.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from pydantic import Field, field_validator

from data_processing.common import StepConfig, content_digest, expand_path, write_jsonl
from data_processing.document import Document, ShardWriter
from runtime.stage import Workdir

_KEYWORD = r"(?:close[sd]?|fix(?:e[sd])?|resolve[sd]?)"
_REF = (
    r"(?:https?://github\.com/(?P<url_repo>[\w.-]+/[\w.-]+)/issues/(?P<url_num>\d+)"
    r"|(?P<x_repo>[\w.-]+/[\w.-]+)#(?P<x_num>\d+)"
    r"|#(?P<num>\d+))"
)
CLOSING_RE = re.compile(rf"(?<![\w/-]){_KEYWORD}:?\s+{_REF}(?![\w/])", re.IGNORECASE)

_TEST_DIRS = {"test", "tests", "testing"}
_TEST_FILE = re.compile(r"^(test_.*\.py|.*_tests?\.py|conftest\.py)$")
_DEF = re.compile(r"^(?P<indent>\s*)(?:async\s+)?def\s+(?P<name>\w+)\s*\(")
_CLASS = re.compile(r"^(?P<indent>\s*)class\s+(?P<name>\w+)")
_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@ ?(?P<ctx>.*)$")


class IssuePRConfig(StepConfig):
    issues: tuple[str, ...] = Field(description="JSONL files of GitHub REST issue/PR objects")
    pr_files: tuple[str, ...] = Field((), description=(
        "JSONL files of PR file lists (GET /repos/o/r/pulls/n/files), one line per PR"))
    default_repo: str | None = Field(default=None, description="owner/repo for objects that carry no URL")
    require_patch: bool = Field(default=True, description="skip pairs whose PR has no file list")
    shard_size: int = Field(default=10_000, ge=1, description="documents (one per pair) per output Parquet shard")

    @field_validator("issues")
    @classmethod
    def _issues(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("issues: name at least one JSONL file of GitHub REST objects")
        return v


# ---------------------------------------------------------------------------------------------
# Linking
def closing_references(text: str, repo: str) -> list[tuple[str, int]]:
    """(repo, issue number) pairs a PR text closes, in order, without duplicates."""
    out: list[tuple[str, int]] = []
    for m in CLOSING_RE.finditer(text or ""):
        if m.group("url_num"):
            ref = (m.group("url_repo").lower(), int(m.group("url_num")))
        elif m.group("x_num"):
            ref = (m.group("x_repo").lower(), int(m.group("x_num")))
        else:
            ref = (repo.lower(), int(m.group("num")))
        if ref not in out:
            out.append(ref)
    return out


def is_bot(user: dict | None) -> bool:
    user = user or {}
    return user.get("type") == "Bot" or str(user.get("login", "")).lower().endswith("[bot]")


# ---------------------------------------------------------------------------------------------
# Patches
def is_test_path(path: str) -> bool:
    parts = path.split("/")
    return any(p.lower() in _TEST_DIRS for p in parts[:-1]) or bool(_TEST_FILE.match(parts[-1]))


def file_diff(f: dict) -> str:
    """A git-style diff of one REST file entry (no `index` line: REST gives no blob pair)."""
    new = f["filename"]
    old = f.get("previous_filename") or new
    status = f.get("status", "modified")
    lines = [f"diff --git a/{old} b/{new}"]
    if status == "added":
        lines += ["new file mode 100644", "--- /dev/null", f"+++ b/{new}"]
    elif status == "removed":
        lines += ["deleted file mode 100644", f"--- a/{old}", "+++ /dev/null"]
    elif old != new and not f.get("patch"):  # pure rename: git prints no ---/+++ lines
        lines += ["similarity index 100%", f"rename from {old}", f"rename to {new}"]
    else:
        if old != new:
            lines += [f"rename from {old}", f"rename to {new}"]
        lines += [f"--- a/{old}", f"+++ b/{new}"]
    body = f.get("patch") or ""
    return "\n".join(lines) + "\n" + (body if body.endswith("\n") or not body else body + "\n")


def split_files(files: list[dict]) -> tuple[str, str, list[str]]:
    """(code patch, test patch, test file paths)."""
    code, test, test_paths = [], [], []
    for f in files:
        if not f.get("patch") and not f.get("previous_filename"):
            continue  # binary or too-large diffs carry no patch text
        if is_test_path(f["filename"]):
            test.append(file_diff(f))
            test_paths.append(f["filename"])
        else:
            code.append(file_diff(f))
    return "".join(code), "".join(test), test_paths


def changed_tests(path: str, patch: str) -> list[str]:
    """Test functions a file's diff adds or changes, as `path::name` / `path::Class::name`."""
    names: list[str] = []
    cls: tuple[int, str] | None = None      # (indent, name) of the enclosing class
    func: tuple[int, str] | None = None     # (indent, name) of the enclosing def

    def add(name: str | None) -> None:
        if not name:
            return
        full = f"{path}::{cls[1]}::{name}" if cls and func and func[0] > cls[0] else f"{path}::{name}"
        if full not in names:
            names.append(full)

    for line in patch.splitlines():
        h = _HUNK.match(line)
        if h:
            func = cls = None
            ctx = h.group("ctx")
            if (m := _DEF.match(ctx)):
                func = (len(m.group("indent")), m.group("name"))
            elif (m := _CLASS.match(ctx)):
                cls = (len(m.group("indent")), m.group("name"))
            continue
        if not line or line[0] not in " +-":
            continue
        sign, code = line[0], line[1:]
        if sign == "-":
            if func and func[1].startswith("test") and not _DEF.match(code):
                add(func[1])
            continue
        if code.strip():
            indent = len(code) - len(code.lstrip())
            if indent == 0 and (m := _CLASS.match(code)):  # pytest collects module-level classes
                cls, func = (indent, m.group("name")), None
                continue
            if (m := _DEF.match(code)):
                if cls and indent <= cls[0]:
                    cls = None
                func = (indent, m.group("name"))
                if sign == "+" and func[1].startswith("test"):
                    add(func[1])
                continue
            if func and indent <= func[0]:
                func = None
            if cls and indent <= cls[0]:
                cls = None
        if sign == "+" and func and func[1].startswith("test") and code.strip():
            add(func[1])
    return names


def split_diff_by_file(test_patch: str) -> list[tuple[str, str]]:
    out = []
    for chunk in re.split(r"(?m)^(?=diff --git )", test_patch):
        m = re.match(r"diff --git a/\S+ b/(\S+)", chunk)
        if m:
            out.append((m.group(1), chunk))
    return out


def fail_to_pass(test_patch: str) -> list[str]:
    return [n for path, chunk in split_diff_by_file(test_patch) for n in changed_tests(path, chunk)]


# ---------------------------------------------------------------------------------------------
# Reading inputs
@dataclass
class Issue:
    repo: str
    number: int
    title: str
    body: str
    created_at: str | None
    user: dict
    is_pr: bool
    merged_at: str | None = None
    base_commit: str | None = None
    html_url: str = ""
    where: str = ""


@dataclass
class Inputs:
    issues: dict[tuple[str, int], Issue] = field(default_factory=dict)
    prs: dict[tuple[str, int], Issue] = field(default_factory=dict)
    files: dict[tuple[str, int], list[dict]] = field(default_factory=dict)
    quarantine: list[dict] = field(default_factory=list)


_REPO_FROM_URL = re.compile(r"(?:api\.github\.com/repos|github\.com)/([\w.-]+/[\w.-]+?)(?:/|$)")


def _repo_of(obj: dict, wrapper_repo: str | None, default: str | None) -> str | None:
    for key in ("repository_url", "html_url", "url"):
        v = obj.get(key)
        if isinstance(v, str) and (m := _REPO_FROM_URL.search(v)):
            return m.group(1)
    return wrapper_repo or default


def _jsonl(path: Path) -> Iterator[tuple[int, Any | None, str | None]]:
    """(line number, parsed object or None, error or None) for every non-empty line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line), None
            except json.JSONDecodeError as e:
                yield lineno, None, f"invalid JSON: {e.msg} at column {e.colno}"


def parse_issue(obj: Any, default_repo: str | None) -> Issue:
    """One REST issue/PR object -> Issue; raises ValueError naming the bad field."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    wrapper_repo = None
    if "object" in obj and isinstance(obj["object"], dict):
        wrapper_repo = obj.get("repo") if isinstance(obj.get("repo"), str) else None
        obj = obj["object"]
    num = obj.get("number")
    if not isinstance(num, int) or isinstance(num, bool):
        raise ValueError("field 'number': missing or not an integer")
    title = obj.get("title")
    if not isinstance(title, str):
        raise ValueError("field 'title': missing or not a string")
    body = obj.get("body")
    if body is not None and not isinstance(body, str):
        raise ValueError("field 'body': not a string")
    user = obj.get("user")
    if user is not None and not isinstance(user, dict):
        raise ValueError("field 'user': not an object")
    repo = _repo_of(obj, wrapper_repo, default_repo)
    if not repo:
        raise ValueError("field 'repository_url': missing, and no default_repo configured")
    pr = obj.get("pull_request")
    is_pulls_object = "head" in obj and "base" in obj
    merged_at = (pr or {}).get("merged_at") if isinstance(pr, dict) else obj.get("merged_at") if is_pulls_object else None
    base = obj.get("base") if is_pulls_object else None
    return Issue(
        repo=repo.lower(),
        number=num,
        title=title,
        body=body or "",
        created_at=obj.get("created_at"),
        user=user or {},
        is_pr=isinstance(pr, dict) or is_pulls_object,
        merged_at=merged_at,
        base_commit=(base or {}).get("sha") if isinstance(base, dict) else None,
        html_url=obj.get("html_url") or "",
    )


_FILES_URL = re.compile(r"/repos/([\w.-]+/[\w.-]+)/pulls/(\d+)/files")


def parse_files_line(obj: Any) -> tuple[tuple[str, int], list[dict]] | None:
    """A PR's file list, or None for a recorded exchange of another endpoint (skipped)."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "url" in obj and "response" in obj:
        m = _FILES_URL.search(str(obj["url"]))
        if not m:
            return None
        key, files = (m.group(1).lower(), int(m.group(2))), obj["response"]
    else:
        if not isinstance(obj.get("repo"), str) or not isinstance(obj.get("number"), int):
            raise ValueError("fields 'repo' (owner/name) and 'number' (int) are required")
        key, files = (obj["repo"].lower(), obj["number"]), obj.get("files")
    if not isinstance(files, list):
        raise ValueError("file list: expected a JSON array of file objects")
    for i, f in enumerate(files):
        if not isinstance(f, dict) or not isinstance(f.get("filename"), str):
            raise ValueError(f"file #{i}: field 'filename' missing or not a string")
        if f.get("patch") is not None and not isinstance(f["patch"], str):
            raise ValueError(f"file #{i} ({f['filename']}): field 'patch' is not a string")
    return key, files


def read_inputs(issue_paths: Iterable[Path], file_paths: Iterable[Path], default_repo: str | None = None) -> Inputs:
    inp = Inputs()
    for path in issue_paths:
        for lineno, obj, err in _jsonl(path):
            try:
                if err:
                    raise ValueError(err)
                it = parse_issue(obj, default_repo)
            except ValueError as e:
                inp.quarantine.append({"file": str(path), "line": lineno, "reason": str(e)})
                continue
            it.where = f"{path}:{lineno}"
            table = inp.prs if it.is_pr else inp.issues
            old = table.get((it.repo, it.number))
            # the same PR may come from /issues and /pulls: keep what each one knows
            if old is not None:
                it.merged_at = it.merged_at or old.merged_at
                it.base_commit = it.base_commit or old.base_commit
            table[(it.repo, it.number)] = it
    for path in file_paths:
        for lineno, obj, err in _jsonl(path):
            try:
                if err:
                    raise ValueError(err)
                parsed = parse_files_line(obj)
            except ValueError as e:
                inp.quarantine.append({"file": str(path), "line": lineno, "reason": str(e)})
                continue
            if parsed is not None:
                inp.files.setdefault(*parsed)
    return inp


# ---------------------------------------------------------------------------------------------
# Mining
def mine(inp: Inputs, require_patch: bool = True) -> tuple[list[dict], list[dict]]:
    """(SWE-bench records, skipped PRs with reasons)."""
    records: list[dict] = []
    skipped: list[dict] = []
    for (repo, num), pr in sorted(inp.prs.items()):
        def skip(reason: str, **extra: Any) -> None:
            skipped.append({"repo": repo, "pr": num, "reason": reason, "where": pr.where, **extra})

        if is_bot(pr.user):
            skip("bot_author", login=pr.user.get("login"))
            continue
        if not pr.merged_at:
            skip("unmerged")
            continue
        refs = closing_references(f"{pr.title}\n{pr.body}", repo)
        if not refs:
            skip("unlinked")
            continue
        linked = [inp.issues[r] for r in refs if r in inp.issues]
        if not linked:
            skip("issue_not_found", refs=[f"{r}#{n}" for r, n in refs])
            continue
        files = inp.files.get((repo, num))
        if files is None and require_patch:
            skip("no_file_list")
            continue
        patch, test_patch, test_paths = split_files(files or [])
        if files is not None and not patch:
            skip("test_only" if test_patch else "no_code_change")
            continue
        owner, name = repo.split("/", 1)
        for issue in linked:
            records.append(
                {
                    "instance_id": f"{owner}__{name}-{num}",
                    "repo": repo,
                    "pull_number": num,
                    "issue_numbers": [issue.number],
                    "problem_statement": f"{issue.title}\n{issue.body}".strip() + "\n",
                    "patch": patch,
                    "test_patch": test_patch,
                    "created_at": pr.created_at,
                    "base_commit": pr.base_commit,
                    "FAIL_TO_PASS": fail_to_pass(test_patch),
                    "PASS_TO_PASS": [],
                }
            )
    return records, skipped


def record_text(r: dict) -> str:
    """SWE-style training text: the issue, then the fix and its tests."""
    parts = [f"Repository: {r['repo']}", f"Issue:\n{r['problem_statement']}"]
    if r["patch"]:
        parts.append(f"Patch:\n{r['patch']}")
    if r["test_patch"]:
        parts.append(f"Test patch:\n{r['test_patch']}")
    return "\n".join(parts)


def input_files(cfg: IssuePRConfig) -> tuple[list[Path], list[Path]]:
    """(issue/PR export files, PR file-list files), each checked to exist."""
    issue_paths = [expand_path(p) for p in cfg.issues]
    file_paths = [expand_path(p) for p in cfg.pr_files]
    for p in issue_paths + file_paths:
        if not p.is_file():
            raise ValueError(f"issue-pr: input file {p} does not exist")
    return issue_paths, file_paths


def fingerprint(cfg: IssuePRConfig) -> str:
    """Content digest of the export files, in config order: part of the stage key, so an
    edited export re-runs mining instead of serving the cached result."""
    issue_paths, file_paths = input_files(cfg)
    return content_digest(issue_paths + file_paths)


def run(cfg: IssuePRConfig, inputs: dict[str, Path], workdir: Workdir) -> dict:
    issue_paths, file_paths = input_files(cfg)
    inp = read_inputs(issue_paths, file_paths, cfg.default_repo)
    records, skipped = mine(inp, cfg.require_patch)
    write_jsonl(workdir.out / "pairs.jsonl", records)
    write_jsonl(workdir.out / "skipped.jsonl", skipped)
    write_jsonl(workdir.out / "quarantine.jsonl", inp.quarantine)
    writer = ShardWriter(workdir.out, cfg.shard_size)
    for k, r in enumerate(records):
        iid = f"{r['instance_id']}-issue{r['issue_numbers'][0]}"
        writer.write(Document(iid, record_text(r), "issue-pr", {"instance_id": r["instance_id"], "repo": r["repo"]}))
        if k % 1000 == 0:
            workdir.progress(k, len(records), "issue-pr documents")
    writer.close()
    reasons: dict[str, int] = {}
    for s in skipped:
        reasons[s["reason"]] = reasons.get(s["reason"], 0) + 1
    return {
        "issues": len(inp.issues),
        "pull_requests": len(inp.prs),
        "file_lists": len(inp.files),
        "pairs": len(records),
        "with_patch": sum(1 for r in records if r["patch"]),
        "with_fail_to_pass": sum(1 for r in records if r["FAIL_TO_PASS"]),
        "skipped": len(skipped),
        "skipped_by_reason": reasons,
        "quarantined": len(inp.quarantine),
    }

