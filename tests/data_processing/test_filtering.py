"""The keep-or-drop base: kept/removed shards, drop reasons and count metrics, the same for every step."""
from __future__ import annotations

import numpy as np
import pytest

from data_processing.document import Document, read_documents, read_shard, shard_paths
from data_processing.filtering import count_metrics, filter_documents, write_decisions


def docs(n: int) -> list[Document]:
    return [Document(f"d{i}", f"text {i}", "src", {"k": i}) for i in range(n)]


def test_kept_and_removed_shards_reasons_and_metrics(tmp_path):
    verdicts = [True, (False, "duplicate_of:d0"), True, (False, "duplicate_of:d0"), (False, "too_short")]
    counts = write_decisions(zip(docs(5), verdicts), tmp_path, "step-x", shard_size=2)
    assert [d.id for d in read_documents(tmp_path)] == ["d0", "d2"]
    assert [p.name for p in shard_paths(tmp_path)] == ["part-00000.parquet"]
    removed = list(read_documents(tmp_path / "removed"))
    assert [p.name for p in shard_paths(tmp_path / "removed")] == ["part-00000.parquet", "part-00001.parquet"]
    assert [(d.id, d.metadata) for d in removed] == [
        ("d1", {"k": 1, "removed_reason": "duplicate_of:d0", "removed_by": "step-x"}),
        ("d3", {"k": 3, "removed_reason": "duplicate_of:d0", "removed_by": "step-x"}),
        ("d4", {"k": 4, "removed_reason": "too_short", "removed_by": "step-x"}),
    ]
    assert dict(counts.reasons) == {"duplicate_of:d0": 2, "too_short": 1}
    assert counts.metrics() == {"documents_in": 5, "kept": 2, "removed": 3, "removal_rate": 0.6}


def test_per_document_keep_function_and_progress(tmp_path):
    seen = []
    counts = filter_documents(
        docs(2500), lambda d: True if d.metadata["k"] % 4 else (False, "k%4==0"), tmp_path, "s", 1000,
        progress=lambda done, total, desc: seen.append((done, total, desc)), total=2500,
    )
    assert counts.metrics() == {"documents_in": 2500, "kept": 1875, "removed": 625, "removal_rate": 0.25}
    assert seen == [(1000, 2500, "s"), (2000, 2500, "s"), (2500, 2500, "s")]


def test_empty_input_writes_both_directories(tmp_path):
    counts = write_decisions([], tmp_path / "out", "s", 10)
    assert (tmp_path / "out").is_dir() and (tmp_path / "out" / "removed").is_dir()
    assert shard_paths(tmp_path / "out") == [] and counts.metrics() == count_metrics(0, 0)
    assert count_metrics(0, 0) == {"documents_in": 0, "kept": 0, "removed": 0, "removal_rate": 0.0}


@pytest.mark.parametrize("bad", [False, (False, ""), (True, "why"), np.True_, 1, "drop"])
def test_a_drop_needs_a_reason_and_a_keep_is_true(tmp_path, bad):
    with pytest.raises(TypeError, match="True or \\(False, reason\\)"):
        write_decisions([(docs(1)[0], bad)], tmp_path, "s", 10)


def _shards(tmp_path, pieces: list[list[Document]]):
    from data_processing.document import write_shard

    (tmp_path / "in").mkdir()
    for i, part in enumerate(pieces):
        write_shard(tmp_path / "in" / f"part-{i:05d}.parquet", part)
    return shard_paths(tmp_path / "in")


def test_decisions_over_whole_shards_write_what_one_document_at_a_time_does(tmp_path):
    from data_processing.filtering import write_shard_decisions

    all_docs = docs(11)
    verdicts = [True if i % 3 else (False, f"dup_of:d{i + 1}") for i in range(11)]
    shards = _shards(tmp_path, [all_docs[:4], all_docs[4:9], all_docs[9:]])
    a = write_decisions(zip(all_docs, verdicts), tmp_path / "a", "s", shard_size=3)
    b = write_shard_decisions(shards, verdicts, tmp_path / "b", "s", shard_size=3)
    assert a == b
    for sub in ("", "removed"):
        pa_, pb = shard_paths(tmp_path / "a" / sub), shard_paths(tmp_path / "b" / sub)
        assert [p.name for p in pa_] == [p.name for p in pb]
        assert list(read_documents(tmp_path / "a" / sub)) == list(read_documents(tmp_path / "b" / sub))


def test_decisions_over_a_shard_with_an_empty_id_name_it(tmp_path):
    from data_processing.filtering import write_shard_decisions

    shards = _shards(tmp_path, [[Document("a", "x"), Document("", "text of the bad one")]])
    with pytest.raises(ValueError, match=r"part-00000.parquet: document with text 'text of the bad one'"):
        write_shard_decisions(shards, [True, True], tmp_path / "out", "s", shard_size=3)


def test_rows_given_as_tables_make_the_shards_documents_do(tmp_path):
    from data_processing.document import ShardWriter, documents_table

    all_docs = docs(10)
    one = ShardWriter(tmp_path / "one", 4)
    one.write_all(all_docs)
    one.close()
    tables = ShardWriter(tmp_path / "tables", 4)
    for lo, hi in ((0, 1), (1, 6), (6, 6), (6, 10)):
        tables.write_table(documents_table(all_docs[lo:hi]))
    tables.close()
    assert [p.name for p in shard_paths(tmp_path / "one")] == [p.name for p in shard_paths(tmp_path / "tables")]
    for p, q in zip(shard_paths(tmp_path / "one"), shard_paths(tmp_path / "tables")):
        assert list(read_shard(p)) == list(read_shard(q))
