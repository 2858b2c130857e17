"""Bad input gives a clear error naming file / line / field, or goes to quarantine."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_processing import dedup_exact, minhash
from data_processing.common import TextSource, read_text_source
from data_processing.minhash import MinHashConfig, minhash_signatures
from runtime.stage import Workdir


def bad_shard(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    table = pa.table({"id": ["a", "b"], "text": ["fine text here", None], "source": ["s", "s"], "metadata": ["{}", "{}"]})
    pq.write_table(table, d / "part-00000.parquet")
    return d


def test_non_string_text_names_shard_and_document(tmp_path):
    d = bad_shard(tmp_path)
    with pytest.raises(ValueError, match=r"part-00000\.parquet.*'b'.*'text' must be a string"):
        dedup_exact.run(dedup_exact.DedupExactConfig(), {"p": d}, Workdir.at(tmp_path / "w"))
    with pytest.raises(ValueError, match=r"part-00000\.parquet: row 1: field 'text'"):
        minhash_signatures(d / "part-00000.parquet", MinHashConfig())


def test_missing_column_and_empty_dir(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    with pytest.raises(ValueError, match="no part-\\*.parquet shards"):
        dedup_exact.run(dedup_exact.DedupExactConfig(), {"p": d}, Workdir.at(tmp_path / "w"))
    pq.write_table(pa.table({"id": ["a"]}), d / "part-00000.parquet")
    with pytest.raises(ValueError, match="missing column"):
        minhash.run(MinHashConfig(), {"p": d}, Workdir.at(tmp_path / "w2"))


def test_malformed_jsonl_source_names_file_and_line(tmp_path):
    f = tmp_path / "pos.jsonl"
    f.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"pos\.jsonl:2: invalid JSON"):
        read_text_source(TextSource(path=str(f)))


def test_config_typos_and_bad_values_are_rejected():
    with pytest.raises(ValueError, match="extra"):
        dedup_exact.DedupExactConfig(shard_sise=3)
    with pytest.raises(ValueError, match="shard_size"):
        dedup_exact.DedupExactConfig(shard_size=0)
    cfg = MinHashConfig()
    with pytest.raises(ValueError):
        cfg.bands = 3  # frozen
