"""SemDeDup with the offline model2vec embedder (distilled once from all-MiniLM-L6-v2, cached)."""
from __future__ import annotations

import numpy as np

from data_processing.document import Document, read_documents
from data_processing.semantic import SemanticConfig, kmeans, run, semdedup

from .conftest import gsm8k_records, write_docs


def reworded(q: str) -> str:
    """Same content, different surface: case, spacing and punctuation changed."""
    return q.lower().replace(",", " ,").replace("?", " ?").replace("  ", " ") + " Please answer."


def test_semdedup_removes_planted_rewordings_keeps_distinct(tmp_path, workdir):
    recs = gsm8k_records(300)
    docs = [Document(f"q{i:03d}", r["question"], "gsm8k") for i, r in enumerate(recs)]
    planted = [Document(f"zz{i:03d}", reworded(recs[i * 10]["question"]), "planted") for i in range(20)]
    src = write_docs(tmp_path / "in", docs + planted, shard_size=100)
    m = run(SemanticConfig(clusters=8, threshold=0.95), {"dedup-minhash": src}, workdir)
    removed = {d.id: d.metadata["removed_reason"] for d in read_documents(workdir.out / "removed")}
    recall = sum(f"zz{i:03d}" in removed for i in range(20)) / 20
    wrongly = [d.id for d in docs if d.id in removed]
    assert recall >= 0.95, recall
    assert len(wrongly) <= 3, wrongly  # distinct real questions kept (precision)
    assert removed["zz000"].startswith("semantic_duplicate_of:q000")
    assert m["removed"] == len(removed)


def test_keep_rule_highest_quality_first():
    e = np.array([[1.0, 0.0], [0.999, 0.0447], [0.0, 1.0]], dtype=np.float32)
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    cfg = SemanticConfig(clusters=1, threshold=0.9)
    keep, _, dup = semdedup(e, ["a", "b", "c"], [0.1, 0.9, 0.0], cfg)
    assert keep.tolist() == [False, True, True] and dup[0] == 1
    keep, _, _ = semdedup(e, ["a", "b", "c"], [0.5, 0.5, 0.0], cfg)
    assert keep.tolist() == [True, False, True]  # tie -> lowest id kept


def test_kmeans_is_seeded():
    x = np.random.default_rng(0).normal(size=(200, 8)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    assert np.array_equal(kmeans(x, 5, 10, 3), kmeans(x, 5, 10, 3))
