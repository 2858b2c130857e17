"""Exact and MinHash dedup on real stdlib modules with planted near-duplicates."""
from __future__ import annotations

import random
import shutil

import numpy as np
import pytest

from data_processing import dedup_exact, minhash
from data_processing.document import Document, read_documents
from data_processing.minhash import MinHashConfig, minhash_signatures, text_signatures
from runtime.stage import Workdir

from .conftest import stdlib_docs, write_docs


def edit_words(text: str, rate: float, rng: random.Random) -> str:
    """Replace a `rate` share of the words: a near-duplicate (word 5-gram Jaccard ~0.6-0.8)."""
    words = text.split()
    for _ in range(max(1, int(len(words) * rate))):
        words[rng.randrange(len(words))] = rng.choice(["foo", "bar", "qux", "zap"])
    return " ".join(words)


# ---------------------------------------------------------------------------------------------
def test_exact_dedup_normalisation_and_first_kept(tmp_path, workdir):
    docs = stdlib_docs(5)
    variant = Document("z-variant", "  " + docs[1].text.upper().replace("\n", "\r\n") + "\n", "x")  # NFKC/casefold/ws
    punct = Document("y-punct", docs[2].text + "!", "x")  # punctuation differs: not an exact duplicate
    src = write_docs(tmp_path / "in", docs + [variant, punct, Document("c-copy", docs[0].text, "x")])
    m = dedup_exact.run(dedup_exact.DedupExactConfig(), {"quality": src}, workdir)
    kept = [d.id for d in read_documents(workdir.out)]
    removed = {d.id: d.metadata["removed_reason"] for d in read_documents(workdir.out / "removed")}
    assert kept == [d.id for d in docs] + ["y-punct"]  # first occurrences, input order
    assert removed == {"z-variant": f"duplicate_of:{docs[1].id}", "c-copy": f"duplicate_of:{docs[0].id}"}
    assert m["removed"] == 2 and m["documents_in"] == 8


def test_exact_dedup_is_idempotent(tmp_path):
    docs = stdlib_docs(6)
    src = write_docs(tmp_path / "in", docs + docs[:3])
    w1, w2 = Workdir.at(tmp_path / "a"), Workdir.at(tmp_path / "b")
    dedup_exact.run(dedup_exact.DedupExactConfig(), {"p": src}, w1)
    m2 = dedup_exact.run(dedup_exact.DedupExactConfig(), {"p": w1.out}, w2)
    assert m2["removed"] == 0
    assert [d.text for d in read_documents(w1.out)] == [d.text for d in read_documents(w2.out)]


# ---------------------------------------------------------------------------------------------
def test_signature_estimates_jaccard():
    cfg = MinHashConfig(bands=32, rows=8)  # 256 hashes: tighter estimate for the check
    a = stdlib_docs(1)[0].text
    b = edit_words(a, 0.02, random.Random(0))
    sa, sb = minhash.shingle_hashes(a), minhash.shingle_hashes(b)
    true_j = len(np.intersect1d(sa, sb)) / len(np.union1d(sa, sb))
    sig = text_signatures([a, b], cfg)
    est = (sig[0] == sig[1]).mean()
    assert abs(est - true_j) < 0.08, (est, true_j)
    # unrelated modules share (almost) nothing
    c = stdlib_docs(2)[1].text
    assert (text_signatures([a, c], cfg)[0] == text_signatures([a, c], cfg)[1]).mean() < 0.1


def test_minhash_recall_and_precision_on_planted_near_duplicates(tmp_path, workdir):
    """120 distinct stdlib modules + 30 near-duplicates (1% of words replaced, Jaccard ~0.8-0.9).
    Known answer: every planted copy removed (recall 1.0 at this edit rate), no original
    removed (precision: distinct modules kept)."""
    rng = random.Random(7)
    originals = stdlib_docs(120)
    planted = [Document(f"zz-dup-{i:03d}", edit_words(originals[i * 4].text, 0.01, rng), "planted") for i in range(30)]
    src = write_docs(tmp_path / "in", originals + planted, shard_size=40)
    m = minhash.run(MinHashConfig(), {"dedup-exact": src}, workdir)
    removed = {d.id: d.metadata["removed_reason"] for d in read_documents(workdir.out / "removed")}
    planted_removed = [i for i in range(30) if f"zz-dup-{i:03d}" in removed]
    originals_removed = [d.id for d in originals if d.id in removed]
    assert len(planted_removed) >= 29, f"recall {len(planted_removed)}/30"
    assert originals_removed == [], f"distinct modules removed: {originals_removed}"
    assert removed["zz-dup-000"] == f"near_duplicate_of:{originals[0].id}"
    assert m["clusters"] >= 29 and m["removed"] == len(removed)


def test_keep_rule_prefers_quality_then_lowest_id():
    roots = np.array([0, 0, 0, 3])
    keep = minhash.choose_kept(roots, ["b", "a", "c", "d"], [0.5, 0.5, 0.9, 0.0])
    assert keep.tolist() == [False, False, True, True]
    keep = minhash.choose_kept(roots, ["b", "a", "c", "d"], [0.5, 0.5, 0.1, 0.0])
    assert keep.tolist() == [False, True, False, True]


def test_signatures_per_shard_match_and_parallel_run_is_identical(tmp_path):
    docs = stdlib_docs(40)
    src = write_docs(tmp_path / "in", docs + [Document("dup", docs[0].text + " extra", "x")], shard_size=10)
    cfg = MinHashConfig()
    per_shard = np.concatenate([minhash_signatures(p, cfg) for p in sorted(src.glob("part-*.parquet"))])
    assert np.array_equal(per_shard, text_signatures([d.text for d in docs] + [docs[0].text + " extra"], cfg))
    w1, w2 = Workdir.at(tmp_path / "serial"), Workdir.at(tmp_path / "pool")
    m1 = minhash.run(cfg, {"p": src}, w1)
    m2 = minhash.run(cfg.model_copy(update={"workers": 2}), {"p": src}, w2)
    assert m1 == m2 and m1["removed"] == 1
    assert [d.id for d in read_documents(w1.out)] == [d.id for d in read_documents(w2.out)]


def test_datasketch_backend_finds_the_same_planted_pairs(tmp_path):
    rng = random.Random(3)
    originals = stdlib_docs(30)
    planted = [Document(f"zz-{i}", edit_words(originals[i].text, 0.01, rng), "p") for i in range(10)]
    texts = [d.text for d in originals + planted]
    for cfg in (MinHashConfig(), MinHashConfig(backend="datasketch")):
        roots, _ = minhash.cluster(text_signatures(texts, cfg), cfg)
        assert [int(roots[30 + i]) for i in range(10)] == list(range(10)), cfg.backend
        assert len(set(roots[:30].tolist())) == 30


def test_redis_lsh_storage(tmp_path):
    redis = pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server on this machine")
    import subprocess
    import time

    port = 6391
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        for _ in range(50):
            try:
                redis.Redis(port=port).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        originals = stdlib_docs(10)
        texts = [d.text for d in originals] + [edit_words(originals[0].text, 0.01, random.Random(0))]
        cfg = MinHashConfig(backend="datasketch", lsh_storage="redis", redis_url=f"redis://127.0.0.1:{port}/0")
        roots, _ = minhash.cluster(text_signatures(texts, cfg), cfg)
        assert int(roots[10]) == 0 and len(set(roots[:10].tolist())) == 10
    finally:
        proc.terminate()
        proc.wait()


def test_minhash_config_rejects_redis_with_numpy_backend():
    with pytest.raises(ValueError, match="backend: datasketch"):
        MinHashConfig(lsh_storage="redis")
    with pytest.raises(ValueError):
        MinHashConfig(bands=0)
    with pytest.raises(ValueError):
        MinHashConfig(bandz=3)


def test_minhash_resumes_from_per_shard_signature_checkpoints(tmp_path):
    docs = stdlib_docs(30)
    src = write_docs(tmp_path / "in", docs + [Document("dup", docs[0].text, "x")], shard_size=10)
    wd = Workdir.at(tmp_path / "w")
    m1 = minhash.run(MinHashConfig(), {"p": src}, wd)
    ckpt = wd.checkpoint / "signatures"
    assert sorted(p.name for p in ckpt.iterdir()) == [f"part-0000{i}.npy" for i in range(4)]
    # a retried attempt reuses finished shards: prove it by planting a marker signature that
    # makes shard 1's first document identical to document 0
    sig = np.load(ckpt / "part-00001.npy")
    sig[0] = np.load(ckpt / "part-00000.npy")[0]
    np.save(ckpt / "part-00001.npy", sig)
    shutil.rmtree(wd.out)
    wd.out.mkdir()
    m2 = minhash.run(MinHashConfig(), {"p": src}, wd)
    assert m2["removed"] == m1["removed"] + 1


def test_number_normalisation_is_opt_in():
    """A real GSM8K solution with every number changed: different data by default, a
    duplicate under datatrove-style normalisation (numbers -> 0)."""
    import re as _re

    from .conftest import gsm8k_records

    a = " ".join(r["question"] + " " + r["answer"] for r in gsm8k_records(3))
    b = _re.sub(r"\d+", lambda m: str(int(m.group()) + 7), a)
    default, normed = MinHashConfig(), MinHashConfig(norm_numbers=True)
    sd, sn = text_signatures([a, b], default), text_signatures([a, b], normed)
    assert (sd[0] == sd[1]).mean() < 0.6
    assert (sn[0] == sn[1]).mean() == 1.0


def test_char_shingles_catch_small_edits():
    a = stdlib_docs(1)[0].text
    b = edit_words(a, 0.01, random.Random(1))
    cfg = MinHashConfig(shingle="char", ngram=5, bands=26, rows=11)  # OLMo-3 / Marin setting
    s = text_signatures([a, b, stdlib_docs(2)[1].text], cfg)
    assert (s[0] == s[1]).mean() > 0.8 and (s[0] == s[2]).mean() < 0.5


def _edge_texts() -> list[str]:
    return ["", "   ...  ", "two words", "ΣΑΣ ΟΔΟΣ Σ ünïcode İstanbul", "one two three four",
            "one two three four five", "1,000 and 2.5 and 3 numbers " * 3, "x" * 70_000 + " tail words here ok"]


@pytest.mark.parametrize("cfg", [MinHashConfig(), MinHashConfig(norm_numbers=True, ngram=3),
                                 MinHashConfig(shingle="char", bands=26, rows=11)], ids=["word", "word-norm", "char"])
def test_batched_signatures_equal_the_per_document_reference(cfg, monkeypatch):
    """The fast path (batches of documents, hash blocks) computes the reference's numbers bit
    for bit, so it finds the same clusters: on planted near-duplicates, on edge cases (empty,
    shorter than ngram, non-ASCII, one long word), and with tiny batches and blocks so that
    documents straddle both."""
    rng = random.Random(5)
    originals = stdlib_docs(25)
    planted = [edit_words(originals[i].text, 0.01, rng) for i in range(0, 25, 3)]
    texts = _edge_texts() + [d.text for d in originals] + planted + _edge_texts()
    ref = minhash.reference_signatures(texts, cfg)
    assert np.array_equal(text_signatures(texts, cfg), ref)
    monkeypatch.setattr(minhash, "_BATCH_BYTES", 5000)
    monkeypatch.setattr(minhash, "_BLOCK", 100)
    fast = text_signatures(texts, cfg)
    assert np.array_equal(fast, ref)
    assert (fast[0] == 0xFFFFFFFF).all()  # nothing to shingle: matches nothing
    assert (fast[1] == 0xFFFFFFFF).all() == (cfg.shingle == "word")  # punctuation only: no words
    roots, _ = minhash.cluster(fast, cfg)
    assert np.array_equal(roots, minhash.cluster(ref, cfg)[0])
    if cfg.shingle == "word":  # every planted copy joins its original's cluster, nothing else merges
        n = len(_edge_texts())
        for k, i in enumerate(range(0, 25, 3)):
            assert roots[n + 25 + k] == roots[n + i]
        assert len(set(roots[n : n + 25].tolist())) == 25


def test_datasketch_backend_equals_datasketch_minhash():
    """backend: datasketch is datasketch.MinHash over the shingles (8-byte little-endian)."""
    from datasketch import MinHash

    cfg = MinHashConfig(backend="datasketch", bands=4, rows=4)
    texts = [d.text for d in stdlib_docs(3)] + ["short text", ""]
    sigs = text_signatures(texts, cfg)
    for t, s in zip(texts, sigs):
        hashes = minhash.shingle_hashes(t, cfg.shingle, cfg.ngram, cfg.norm_numbers)
        if not hashes.size:
            assert (s == 0xFFFFFFFF).all()
            continue
        m = MinHash(num_perm=cfg.num_perm, seed=cfg.seed)
        for h in hashes:
            m.update(int(h).to_bytes(8, "little"))
        assert np.array_equal(s, m.hashvalues.astype(np.uint32))


def test_candidate_pairs_are_np_unique_of_the_band_pairs():
    """lsh_candidate_pairs dedups pairs by one int64 key: np.unique(pairs, axis=0), rows and order."""
    rng = np.random.default_rng(3)
    for n in [1, 2, 7, 60]:
        sigs = rng.integers(0, 3, size=(n, 8)).astype(np.uint32)
        index = np.arange(n, dtype=np.int64)
        pairs = [minhash.bucket_pairs(minhash.band_keys(sigs, b, 2, w, index), index)
                 for b, w in enumerate(minhash.band_weights(4, 2))]
        pairs = [p for p in pairs if len(p)]
        want = np.unique(np.sort(np.concatenate(pairs), axis=1), axis=0) if pairs else np.empty((0, 2), dtype=np.int64)
        got = minhash.lsh_candidate_pairs(sigs, 4, 2)
        assert got.dtype == want.dtype and np.array_equal(got, want)
