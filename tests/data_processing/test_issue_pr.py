"""Issue -> PR mining on fixtures built from real exports (samples/github_issues, swebench_lite)."""
from __future__ import annotations

import copy
import json
import re

import pytest

from data_processing.common import SAMPLES_DIR
from data_processing.document import read_documents
from data_processing.issue_pr import IssuePRConfig, changed_tests, closing_references, fail_to_pass, run, split_files

HF = SAMPLES_DIR / "github_issues" / "hf_datasets_issues_5634-6249.jsonl"
SWE = SAMPLES_DIR / "swebench_lite" / "dev.jsonl"


def hf_objects():
    objs = [json.loads(l) for l in HF.read_text().splitlines()]
    return [o for o in objs if not o.get("pull_request")], [o for o in objs if o.get("pull_request")]


def swe_instances():
    return [json.loads(l) for l in SWE.read_text().splitlines()]


def rest_files(patch: str) -> list[dict]:
    """Cut a git diff into a `GET /pulls/{n}/files`-style list (filename, status, patch)."""
    files = []
    for chunk in re.split(r"(?m)^(?=diff --git )", patch):
        m = re.match(r"diff --git a/(\S+) b/(\S+)", chunk)
        if not m:
            continue
        head = chunk.split("\n@@")[0]
        status = "added" if "\nnew file mode" in head else "removed" if "\ndeleted file mode" in head else "modified"
        body = chunk[chunk.index("\n@@") + 1 :] if "\n@@" in chunk else ""
        f = {"filename": m.group(2), "status": status, "additions": 0, "deletions": 0}
        if body:
            f["patch"] = body.rstrip("\n")
        if m.group(1) != m.group(2):
            f.update(status="renamed", previous_filename=m.group(1))
        files.append(f)
    return files


def strip_index(diff: str) -> str:
    return "".join(l for l in diff.splitlines(True) if not l.startswith(("index ", "similarity index")))


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,expected",
    [
        ("Fixes #12", [("o/r", 12)]),
        ("this CLOSES: #12.", [("o/r", 12)]),
        ("resolved other/repo#7", [("other/repo", 7)]),
        ("Resolves https://github.com/Other/Repo/issues/9", [("other/repo", 9)]),
        ("fix #1, and fixed #2; closed #1", [("o/r", 1), ("o/r", 2)]),
        ("Close #3\nresolve: #4", [("o/r", 3), ("o/r", 4)]),
        ("see #12, related to #13, mentioned in #14", []),
        ("hotfix #12 and prefix#13", []),  # keyword must be a whole word
        ("Fixes #1, #2", [("o/r", 1)]),  # GitHub needs the keyword before each issue
    ],
)
def test_closing_keywords(text, expected):
    assert closing_references(text, "o/r") == expected


def test_split_reproduces_swebench_patch_and_tests():
    """Real SWE-bench Lite instances cut into REST file lists: the split gives back patch and
    test_patch (up to the `index` lines REST does not carry), and FAIL_TO_PASS names overlap."""
    hits = total = 0
    for inst in swe_instances():
        files = rest_files(inst["patch"]) + rest_files(inst["test_patch"])
        patch, test_patch, test_paths = split_files(files)
        assert strip_index(patch) == strip_index(inst["patch"]), inst["instance_id"]
        assert strip_index(test_patch) == strip_index(inst["test_patch"]), inst["instance_id"]
        # compare (file, function) pairs: a method changed in a hunk whose header shows only
        # the def cannot be qualified with its class, and parametrised ids are runtime names
        short = lambda names: {(n.split("::")[0], n.split("::")[-1].split("[")[0]) for n in names}  # noqa: E731
        ours, theirs = short(fail_to_pass(test_patch)), short(json.loads(inst["FAIL_TO_PASS"]))
        total += 1
        hits += bool(ours & theirs)
    assert hits >= 0.8 * total, f"FAIL_TO_PASS overlap on {hits}/{total} instances"


def test_changed_tests_names_added_and_modified():
    patch = (
        "@@ -10,6 +10,12 @@ def helper():\n"
        " x = 1\n"
        "+def test_new_thing():\n"
        "+    assert x\n"
        "@@ -40,7 +46,7 @@ class TestParser:\n"
        "     def test_parse(self):\n"
        "-        assert parse('a')\n"
        "+        assert parse('b')\n"
        "@@ -90,4 +90,3 @@ def test_removed_only():\n"
        "-def test_gone():\n"
        "-    pass\n"
    )
    assert changed_tests("tests/test_p.py", patch) == [
        "tests/test_p.py::test_new_thing",
        "tests/test_p.py::TestParser::test_parse",
        "tests/test_p.py::test_removed_only",
    ]


# ---------------------------------------------------------------------------------------------
def build_fixture(tmp_path):
    """Real huggingface/datasets issue + PR objects re-targeted at SWE-bench repos, with the
    instances' real patches as file lists; PR bodies carry the tricky cases."""
    issues, prs = hf_objects()
    merged = next(p for p in prs if p["pull_request"]["merged_at"])
    insts = swe_instances()
    lines, files = [], []

    def issue_obj(repo, number, inst):
        o = copy.deepcopy(issues[number % len(issues)])
        o.update(number=number, title=inst["problem_statement"].splitlines()[0], body=inst["problem_statement"],
                 repository_url=f"https://api.github.com/repos/{repo}", html_url=f"https://github.com/{repo}/issues/{number}")
        return o

    def pr_obj(repo, number, body, merged_at="2023-03-15T17:00:00Z", user=None):
        o = copy.deepcopy(merged)
        o.update(number=number, body=body, repository_url=f"https://api.github.com/repos/{repo}",
                 html_url=f"https://github.com/{repo}/pull/{number}")
        o["pull_request"] = dict(o["pull_request"], merged_at=merged_at)
        if user:
            o["user"] = user
        return o

    cases = {
        # name: (body, extra)
        "keyword": "Fixes #{a}",
        "case_colon": "This PR RESOLVES: #{a}",
        "cross_repo": "closed {repo}#{a}",
        "url": "Resolves https://github.com/{repo}/issues/{a}",
        "two": "fix #{a} and closes #{b}",
        "mention": "Related to #{a}, see also #{b}",
        "unmerged": "Fixes #{a}",
        "bot": "Fixes #{a}",
        "test_only": "Fixes #{a}",
    }
    expected = {}
    for k, (name, body) in enumerate(cases.items()):
        inst = insts[k]
        repo = inst["repo"]
        pr_num = int(inst["instance_id"].rsplit("-", 1)[1])
        a, b = 1001 + 10 * k, 1002 + 10 * k  # cases may share a repo: distinct issue numbers
        lines.append(issue_obj(repo, a, inst))
        lines.append(issue_obj(repo, b, insts[k + 1]))
        pr = pr_obj(repo, pr_num, body.format(repo=repo, a=a, b=b),
                    merged_at=None if name == "unmerged" else "2023-03-15T17:00:00Z",
                    user={"login": "dependabot[bot]", "type": "Bot"} if name == "bot" else None)
        lines.append(pr)
        fl = rest_files(inst["test_patch"]) if name == "test_only" else rest_files(inst["patch"]) + rest_files(inst["test_patch"])
        files.append({"repo": repo, "number": pr_num, "files": fl})
        expected[name] = (repo, pr_num, inst, a)
    f_issues, f_files = tmp_path / "issues.jsonl", tmp_path / "files.jsonl"
    bad = ['{"number": 5, "title": ', '[1, 2]', json.dumps({"number": "7", "title": "x"}),
           json.dumps({"number": 8, "title": "no repo anywhere"})]
    f_issues.write_text("\n".join([json.dumps(o) for o in lines] + bad) + "\n")
    f_files.write_text("\n".join(json.dumps(x) for x in files) + "\n" + json.dumps({"repo": "a/b", "number": 1, "files": [{"patch": "x"}]}) + "\n")
    return f_issues, f_files, expected, len(lines)


def test_issue_pr_stage_links_skips_and_quarantines(tmp_path, workdir):
    f_issues, f_files, exp, n_good = build_fixture(tmp_path)
    m = run(IssuePRConfig(issues=(str(f_issues),), pr_files=(str(f_files),)), {}, workdir)
    pairs = [json.loads(l) for l in (workdir.out / "pairs.jsonl").read_text().splitlines()]
    skipped = {(s["repo"], s["pr"]): s["reason"] for s in map(json.loads, (workdir.out / "skipped.jsonl").read_text().splitlines())}
    quarantine = [json.loads(l) for l in (workdir.out / "quarantine.jsonl").read_text().splitlines()]

    got = {(p["repo"], p["pull_number"]): p for p in pairs if len([q for q in pairs if q["instance_id"] == p["instance_id"]]) == 1}
    for name in ("keyword", "case_colon", "cross_repo", "url"):
        repo, num, inst, a = exp[name]
        p = got[(repo, num)]
        owner, r = repo.split("/")
        assert p["instance_id"] == f"{owner}__{r}-{num}" == inst["instance_id"]
        assert p["issue_numbers"] == [a]
        assert p["problem_statement"].startswith(inst["problem_statement"].splitlines()[0])
        assert strip_index(p["patch"]) == strip_index(inst["patch"])
        assert strip_index(p["test_patch"]) == strip_index(inst["test_patch"])
        assert p["PASS_TO_PASS"] == [] and p["created_at"]
    repo, num, _, a = exp["two"]
    assert sorted(p["issue_numbers"][0] for p in pairs if p["pull_number"] == num and p["repo"] == repo) == [a, a + 1]
    assert skipped[exp["mention"][:2]] == "unlinked"
    assert skipped[exp["unmerged"][:2]] == "unmerged"
    assert skipped[exp["bot"][:2]] == "bot_author"
    assert skipped[exp["test_only"][:2]] == "test_only"
    assert m["pairs"] == 6 and m["quarantined"] == 5  # 4 single links + 2 from "two"

    where = {(q["file"].split("/")[-1], q["line"]): q["reason"] for q in quarantine}
    assert "invalid JSON" in where[("issues.jsonl", n_good + 1)]
    assert "expected a JSON object" in where[("issues.jsonl", n_good + 2)]
    assert "'number'" in where[("issues.jsonl", n_good + 3)]
    assert "repository_url" in where[("issues.jsonl", n_good + 4)]
    assert "'filename'" in where[("files.jsonl", 10)]
    docs = list(read_documents(workdir.out))
    assert len(docs) == 6 and all(d.source == "issue-pr" and "Patch:\n" in d.text for d in docs)


def test_real_exports_tiny_preset(workdir, tiny):
    """The shipped exports: 51 PR bodies in the hf file say fix/close/resolve #N with N present."""
    m = run(tiny.issue_pr, {}, workdir)
    assert 40 <= m["pairs"] <= 80
    assert m["skipped_by_reason"]["unmerged"] > 100 and m["quarantined"] == 0


def test_missing_input_file_is_a_clear_error(tmp_path, workdir):
    with pytest.raises(ValueError, match="does not exist"):
        run(IssuePRConfig(issues=(str(tmp_path / "nope.jsonl"),)), {}, workdir)
