"""Dedup fanned out as Prefect tasks on 2 local Dask workers equals the single-process steps."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_processing import dedup_exact, minhash
from data_processing import sharded_dedup as sd
from data_processing.document import Document, read_documents, read_shard, shard_paths
from runtime.stage import Workdir

from .conftest import stdlib_docs, write_docs
from .test_dedup import edit_words


def corpus() -> list[Document]:
    """60 stdlib modules, exact copies (case/whitespace variants) and near-duplicates (1% and
    3% of words edited) placed in other shards than their originals, and two empty texts."""
    rng = random.Random(3)
    docs = stdlib_docs(60, max_chars=20_000)
    extra = []
    for i in range(0, 60, 5):
        extra.append(Document(f"zz-exact-{i:02d}", "  " + docs[i].text.upper() + "\n", "x"))
        extra.append(Document(f"zz-near-{i:02d}", edit_words(docs[i + 1].text, 0.01 + 0.02 * (i % 2), rng), "x",
                              {"quality": {"score": 0.9 if i % 10 == 0 else 0.1}}))
    extra += [Document("zz-empty-a", "", "x"), Document("zz-empty-b", "...", "x")]
    out = docs + extra
    random.Random(5).shuffle(out)
    return out


def contents(directory):
    return [[(d.id, d.text, d.source, d.metadata) for d in read_shard(p)] for p in shard_paths(directory)]


def assert_same_output(single, dask):
    assert [p.name for p in shard_paths(single)] == [p.name for p in shard_paths(dask)]
    assert contents(single) == contents(dask)
    assert [p.name for p in shard_paths(single / "removed")] == [p.name for p in shard_paths(dask / "removed")]
    assert contents(single / "removed") == contents(dask / "removed")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_docs(tmp_path_factory.mktemp("in"), corpus(), shard_size=13)


@pytest.mark.slow
def test_dedup_on_two_dask_workers_equals_single_process(src, tmp_path, prefect_server):
    from tasks.dask_dedup import DaskSettings, run_dedup

    settings = DaskSettings(workers=2, processes=False, partitions=3)
    # exact
    w = Workdir.at(tmp_path / "exact")
    m1 = dedup_exact.run(dedup_exact.DedupExactConfig(shard_size=10), {"p": src}, w)
    m2 = run_dedup("dedup-exact", src, tmp_path / "exact-dask", tmp_path / "s1", settings, shard_size=10)
    assert m1["removed"] >= 12, m1  # the planted exact copies
    assert m1 == m2
    assert_same_output(w.out, tmp_path / "exact-dask")
    # minhash on exact's output, with a seed and threshold other than the defaults
    cfg = minhash.MinHashConfig(seed=7, shard_size=9, verify_threshold=0.85)  # rejects some candidates
    w = Workdir.at(tmp_path / "mh")
    m1 = minhash.run(cfg, {"p": tmp_path / "exact-dask"}, w)
    m2 = run_dedup("dedup-minhash", tmp_path / "exact-dask", tmp_path / "mh-dask", tmp_path / "s2", settings,
                   shard_size=9, minhash=cfg)
    assert m1["removed"] >= 5 and m1["candidate_pairs"] > m1["verified_pairs"], m1
    assert m1 == m2
    assert_same_output(w.out, tmp_path / "mh-dask")


def test_arrow_allocates_from_the_system_allocator():
    """pyarrow's bundled mimalloc crashed a Dask worker thread of this suite (data_processing/__init__):
    importing the package, or the curate CLI before pyarrow, puts Arrow on the system allocator."""
    assert pa.default_memory_pool().backend_name == "system"
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    for module in ("data_processing.sharded_dedup", "glmforge.curate"):
        probe = f"import {module}, pyarrow; print(pyarrow.default_memory_pool().backend_name)"
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "system", module


def test_shard_steps_hold_one_band_and_pick_the_kept_member_by_quality(src, tmp_path):
    """The shard-level steps without Prefect: signatures stay in per-shard files, and the kept
    member of a near-duplicate cluster is the higher quality score (zz-near-00 beats its
    original, which has no score)."""
    cfg = minhash.MinHashConfig()
    sp = sd.plan(src)
    scratch = str(tmp_path / "s")
    for i, (s, o) in enumerate(zip(sp.shards, sp.offsets)):
        sd.minhash_shard(s, i, o, cfg, scratch)
    assert len(list((tmp_path / "s" / "sigs").glob("*.npy"))) == len(sp.shards)
    for b in range(cfg.bands):
        sd.minhash_band(b, len(sp.shards), scratch)
    sd.minhash_split_pairs(cfg.bands, sp, scratch)
    for i in range(len(sp.shards)):
        sd.minhash_verify(i, sp, cfg.verify_threshold, scratch)
    sd.minhash_cluster(sp, scratch)
    reasons = {}
    for f in (tmp_path / "s" / "dups").glob("*.parquet"):
        t = pq.read_table(f)
        reasons.update(zip(t.column("row").to_pylist(), t.column("reason").to_pylist()))
    ids = [d.id for d in read_documents(src)]
    removed = {ids[r]: why for r, why in reasons.items()}
    assert removed[stdlib_docs(2, max_chars=20_000)[1].id] == "near_duplicate_of:zz-near-00"
    assert "zz-near-00" not in removed


def test_bad_shard_names_file_and_row(tmp_path):
    import pyarrow as pa

    d = tmp_path / "in"
    d.mkdir()
    pq.write_table(pa.table({"id": ["a", ""], "text": ["x", "y"]}), d / "part-00000.parquet")
    sp = sd.plan(d)
    with pytest.raises(ValueError, match=r"part-00000.parquet: row 1: field 'id'"):
        sd.exact_partition(sp.shards[0], 0, 0, 2, str(tmp_path / "s"))
    pq.write_table(pa.table({"id": ["a"]}), d / "part-00001.parquet")
    with pytest.raises(ValueError, match=r"part-00001.parquet: not a document shard, missing column\(s\) \['text'\]"):
        sd.plan(d)


def test_dask_section_is_validated_and_stays_out_of_the_stage_key():
    from pydantic import ValidationError

    from data_processing.common import DaskConfig
    from glmforge.pipeline import BY_NAME as STEPS
    from runtime.runner import stage_key

    assert DaskConfig(address="tcp://scheduler:8786", shards_per_task=4).address == "tcp://scheduler:8786"
    for bad in ({"address": "scheduler"}, {"address": "tcp://scheduler:8786", "workers": 4},
                {"workers": 0}, {"shards_per_task": 0}, {"threads": 2}):
        with pytest.raises(ValidationError):
            DaskConfig(**bad)
    with pytest.raises(ValidationError, match="backend: numpy"):
        minhash.MinHashConfig(backend="datasketch", dask={})
    spec = STEPS["dedup-minhash"]
    parents = {"dedup-exact": type("M", (), {"digest": "d"})()}
    plain = stage_key(spec, minhash.MinHashConfig(), 0, parents)
    assert stage_key(spec, minhash.MinHashConfig(dask={"workers": 3, "shards_per_task": 8}, workers=4), 0,
                     parents) == plain
    assert stage_key(spec, minhash.MinHashConfig(seed=2), 0, parents) != plain
    spec = STEPS["dedup-exact"]
    parents = {"quality": parents["dedup-exact"]}
    assert (stage_key(spec, dedup_exact.DedupExactConfig(dask={"address": "tcp://h:8786"}), 0, parents)
            == stage_key(spec, dedup_exact.DedupExactConfig(), 0, parents))


@pytest.mark.slow
def test_pipeline_dedup_stages_on_dask_publish_the_single_process_artifacts(src, tmp_path, prefect_server,
                                                                           monkeypatch):
    """dedup-exact then dedup-minhash as the pipeline runs them (Prefect tasks through the
    runner), once in one process and once with `dask:` on 2 local workers, 2 shards per task:
    same keys, byte-identical files (equal content digests), same metrics."""
    from prefect import flow

    import tasks.dask_dedup as cd

    on_dask = []
    run_dedup = cd.run_dedup
    monkeypatch.setattr(cd, "run_dedup", lambda step, *a, **k: on_dask.append(step) or run_dedup(step, *a, **k))

    from glmforge.config import RetryConfig, load_config
    from glmforge.pipeline import STAGES, get_stage
    from runtime.runner import Runner
    from runtime.store import LocalStore
    from tasks.stage_task import run_in_prefect

    base = ["dedup_exact.shard_size=10", "dedup_minhash.shard_size=9", "dedup_minhash.seed=7",
            "dedup_minhash.verify_threshold=0.85"]
    dask = "{workers: 2, processes: false, shards_per_task: 2}"
    results = {}
    for name, overrides in (("single", base),
                            ("dask", [*base, f"dedup_exact.dask={dask}", f"dedup_minhash.dask={dask}"])):
        cfg = load_config("tiny", overrides=overrides)
        store = LocalStore(tmp_path / name / "store")
        runner = Runner(cfg, store, STAGES, home=tmp_path / name / "home")
        quality = store.publish("quality", "q", src)

        @flow
        def dedup():
            exact = run_in_prefect(get_stage("dedup-exact"), RetryConfig(retries=0), runner, {"quality": quality})
            mh = run_in_prefect(get_stage("dedup-minhash"), RetryConfig(retries=0), runner,
                                {"dedup-exact": exact.manifest})
            return exact, mh

        results[name] = dedup()
    assert on_dask == ["dedup-exact", "dedup-minhash"]  # only the run configured for it
    for single, distributed in zip(results["single"], results["dask"]):
        assert single.state == distributed.state == "done"
        assert single.key == distributed.key
        assert single.manifest.files == distributed.manifest.files  # names, sizes, sha256
        assert single.manifest.digest == distributed.manifest.digest
        assert single.manifest.metrics == distributed.manifest.metrics
    exact, mh = results["dask"]
    assert exact.manifest.metrics["removed"] >= 12 and mh.manifest.metrics["removed"] >= 5
    assert mh.manifest.config["dask"]["workers"] == 2  # recorded, though not in the key
    assert any(f.path.startswith("removed/") for f in mh.manifest.files)
