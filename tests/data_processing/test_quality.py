"""fastText quality classifiers trained on real text; scoring, filtering, up-sampling, artifacts."""
from __future__ import annotations

import pytest

from data_processing.common import TextSource
from data_processing.document import Document, read_documents
from data_processing.quality import ClassifierConfig, QualityConfig, bucket_weight, run

from .conftest import gsm8k_records, write_docs

SHAKESPEARE = "{samples}/tinyshakespeare/input.txt"
GSM8K = "{samples}/gsm8k/train.jsonl"


def small_cfg(**kw) -> QualityConfig:
    """knowledge-style classifier: stdlib docstrings (reference prose) vs Shakespeare dialogue."""
    clf = ClassifierConfig(
        name="knowledge",
        positives=(TextSource(path="{stdlib}", glob="*.py", unit="docstring", min_chars=120, limit=600),),
        negatives=(TextSource(path=SHAKESPEARE, unit="paragraph", min_chars=120, limit=600),),
        bucket=20_000,
        dim=16,
    )
    return QualityConfig(classifiers=(clf,), **kw)


def corpus(tmp_path):
    # held-out real text: GSM8K is in neither class; Shakespeare paragraphs from the end of
    # the file (the classifier saw the first 600 long ones); stdlib docstrings of packages.
    from data_processing.common import read_text_source

    shakes = read_text_source(TextSource(path=SHAKESPEARE, unit="paragraph", min_chars=300))[-40:]
    docs_ = read_text_source(TextSource(path="{stdlib}", glob="*/*.py", unit="docstring", min_chars=300, limit=40))
    docs = [Document(f"s{i:03d}", t, "shakespeare") for i, t in enumerate(shakes)]
    docs += [Document(f"d{i:03d}", t, "docstring") for i, t in enumerate(docs_)]
    return write_docs(tmp_path / "in", docs), docs


def test_quality_upsample_scores_every_doc_and_publishes_artifacts(tmp_path, workdir):
    src, docs = corpus(tmp_path)
    m = run(small_cfg(mode="upsample"), {"ingest": src}, workdir)
    out = list(read_documents(workdir.out))
    assert len(out) == len(docs) and m["removed"] == 0
    by_src = {"shakespeare": [], "docstring": []}
    for d in out:
        q = d.metadata["quality"]
        assert set(q) == {"scores", "score", "weight"} and 0 <= q["score"] <= 1
        assert q["weight"] == bucket_weight(q["score"], (0.25, 0.5, 0.75), (0.5, 1.0, 1.5, 2.0))
        by_src[d.source].append(q["score"])
    # known answer: unseen docstrings score far above unseen Shakespeare
    assert sum(by_src["docstring"]) / 40 > 0.8 and sum(by_src["shakespeare"]) / 40 < 0.2
    c = m["classifiers"]["knowledge"]
    assert c["precision"] > 0.9 and c["recall"] > 0.9 and c["heldout"] >= 200
    model = workdir.out / "classifiers" / "knowledge.bin"
    assert model.exists() and c["model_bytes"] == model.stat().st_size < 20_000_000
    assert (workdir.out / "quality_histogram.png").read_bytes()[:4] == b"\x89PNG"


def test_quality_filter_mode_drops_with_reason(tmp_path, workdir):
    src, docs = corpus(tmp_path)
    m = run(small_cfg(mode="filter", threshold=0.5), {"ingest": src}, workdir)
    kept = list(read_documents(workdir.out))
    removed = list(read_documents(workdir.out / "removed"))
    assert m["kept"] + m["removed"] == len(docs) == len(kept) + len(removed)
    assert sum(d.source == "shakespeare" for d in removed) >= 36  # most of the 40
    assert sum(d.source == "docstring" for d in kept) >= 36
    assert all(d.metadata["removed_reason"].startswith("quality_below_threshold") for d in removed)


def test_text_sources_read_real_fields():
    from data_processing.common import read_text_source

    t = read_text_source(TextSource(path=GSM8K, fields=("question", "answer"), limit=3))
    rec = gsm8k_records(1)[0]
    assert t[0] == rec["question"] + "\n\n" + rec["answer"]
    shuffled = read_text_source(TextSource(path=GSM8K, fields=("question",), transform="shuffle_words", limit=1))[0]
    assert sorted(shuffled.split()) == sorted(rec["question"].split()) and shuffled != rec["question"]


def test_quality_config_errors_are_clear():
    src = TextSource(path=SHAKESPEARE)
    with pytest.raises(ValueError, match="bucket_weights"):
        QualityConfig(classifiers=(ClassifierConfig(name="a", positives=(src,), negatives=(src,)),), bucket_weights=(1.0,))
    with pytest.raises(ValueError, match="unique"):
        c = ClassifierConfig(name="a", positives=(src,), negatives=(src,))
        QualityConfig(classifiers=(c, c))
    with pytest.raises(ValueError, match="letters"):
        ClassifierConfig(name="a/b", positives=(src,), negatives=(src,))
    with pytest.raises(ValueError, match="does not exist"):
        from data_processing.common import read_text_source

        read_text_source(TextSource(path="/nonexistent/x.jsonl"))
