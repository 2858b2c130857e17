"""Document shards: metadata decoded only when read, written back unchanged when it was not."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from data_processing.document import SCHEMA, Document, read_ids_and_metadata, read_shard, write_shard


def test_metadata_passes_through_as_stored_and_changes_when_edited(tmp_path):
    stored = '{"z": 1, "a": {"k": [1, 2]}}'              # not sorted: a shard written by someone else
    src = tmp_path / "part-00000.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "a", "text": "t", "source": "", "metadata": stored}], SCHEMA), src)
    (doc,) = read_shard(src)
    assert doc.metadata_json() == stored                 # never decoded: the same string goes on
    out = tmp_path / "out" / "part-00000.parquet"
    out.parent.mkdir()
    write_shard(out, [doc])
    assert pq.read_table(out).column("metadata").to_pylist() == [stored]

    (doc,) = read_shard(src)
    doc.metadata["quality"] = 0.5                        # read and edited: encoded again, sorted
    write_shard(out, [doc])
    assert pq.read_table(out).column("metadata").to_pylist() == ['{"a": {"k": [1, 2]}, "quality": 0.5, "z": 1}']
    assert list(read_ids_and_metadata(out.parent)) == [("a", '{"a": {"k": [1, 2]}, "quality": 0.5, "z": 1}')]


def test_documents_compare_by_content_whether_or_not_their_metadata_was_decoded(tmp_path):
    doc = Document("a", "text", "src", {"line": 3})
    path = _write(tmp_path / "part-00000.parquet", [doc])
    (back,) = read_shard(path)
    assert back == doc and back.metadata == {"line": 3}
    assert Document("a", "text") != Document("a", "text", metadata={"line": 1})


def _write(path, docs):
    write_shard(path, docs)
    return path


def test_filter_rows_is_table_filter(tmp_path):
    import random

    from data_processing.document import bool_array, filter_rows

    rng = random.Random(0)
    for n in [0, 1, 2, 5, 40]:
        table = pa.table({"id": [f"d{i}" for i in range(n)], "text": ["x" * (i % 3) for i in range(n)]})
        for p in [0.0, 0.5, 0.9, 1.0]:
            keep = [rng.random() < p for _ in range(n)]
            got, want = filter_rows(table, keep), table.filter(bool_array(keep))
            assert got.equals(want)
            assert [c.num_chunks for c in got.columns] == [c.num_chunks for c in want.columns]  # same shard bytes


def test_uncompressed_shards_only_in_the_named_folders(tmp_path):
    from data_processing.document import ShardWriter, uncompressed_shards

    docs = [Document(f"d{i}", "some text " * 50) for i in range(4)]
    scratch, kept = tmp_path / "scratch", tmp_path / "kept"
    with uncompressed_shards(scratch):
        for folder in (scratch, scratch / "sub", kept):
            w = ShardWriter(folder, 10)
            w.write_all(docs)
            w.close()
    codec = {f: pq.ParquetFile(f / "part-00000.parquet").metadata.row_group(0).column(1).compression
             for f in (scratch, scratch / "sub", kept)}
    assert codec == {scratch: "UNCOMPRESSED", scratch / "sub": "ZSTD", kept: "ZSTD"}
    assert [d.text for d in read_shard(scratch / "part-00000.parquet")] == [d.text for d in docs]
    w = ShardWriter(tmp_path / "after", 10)
    w.write_all(docs)
    w.close()
    after = pq.ParquetFile(tmp_path / "after" / "part-00000.parquet")
    assert after.metadata.row_group(0).column(1).compression == "ZSTD"
