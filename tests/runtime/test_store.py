"""The store contract, run against the local store and a real S3 server (SeaweedFS)."""
from __future__ import annotations

import json

import pytest

from runtime.store import CorruptArtifactError, LocalStore, S3Store, artifact_prefix


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    bucket = request.getfixturevalue("s3_env")
    return S3Store(f"s3://{bucket}/some/prefix")


def _tree(root, files):
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def test_publish_and_materialize_roundtrip(store, tmp_path):
    src = _tree(tmp_path / "out", {"a.txt": b"alpha", "sub/b.bin": bytes(range(256)) * 10})
    m = store.publish("ingest", "k1", src, metrics={"documents": 2}, parents={"up": "k0"}, stage_version="3")
    again = store.manifest("ingest", "k1")
    assert again is not None and again.digest == m.digest
    assert again.metrics == {"documents": 2} and again.parents == {"up": "k0"} and again.stage_version == "3"
    assert {f.path: f.size for f in again.files} == {"a.txt": 5, "sub/b.bin": 2560}
    local = store.materialize(again, tmp_path / "cache")
    assert (local / "a.txt").read_bytes() == b"alpha"
    assert (local / "sub/b.bin").read_bytes() == bytes(range(256)) * 10


def test_digest_ignores_upload_nonce(store, tmp_path):
    src = _tree(tmp_path / "out", {"x": b"same"})
    m1 = store.publish("s", "k1", src)
    m2 = store.publish("s", "k2", src)
    assert m1.data_prefix != m2.data_prefix and m1.digest == m2.digest


def test_missing_artifact_is_none(store):
    assert store.manifest("ingest", "nope") is None


def test_half_published_is_invisible_and_collected(store, tmp_path):
    src = _tree(tmp_path / "out", {"a.txt": b"alpha"})
    # A writer killed before the manifest: its data prefix exists, no manifest does.
    store.put_file(f"{artifact_prefix('ingest', 'k9')}/data-deadbeef0000/a.txt", src / "a.txt")
    assert store.manifest("ingest", "k9") is None
    assert [m.key for m in store.artifacts()] == []
    good = store.publish("ingest", "k1", src)
    removed = store.gc()
    assert removed == [f"{artifact_prefix('ingest', 'k9')}/data-deadbeef0000"]
    assert store.list(artifact_prefix("ingest", "k9")) == []
    assert [m.key for m in store.artifacts()] == ["k1"]
    store.verify(good)


def test_corrupt_file_is_named(store, tmp_path):
    src = _tree(tmp_path / "out", {"a.txt": b"alpha", "b.txt": b"beta"})
    m = store.publish("ingest", "k1", src)
    key = f"{artifact_prefix('ingest', 'k1')}/{m.data_prefix}/b.txt"
    store.put_bytes(key, b"BETA")
    with pytest.raises(CorruptArtifactError, match=r"b\.txt"):
        store.verify(m)
    with pytest.raises(CorruptArtifactError, match=r"b\.txt"):
        store.materialize(m, tmp_path / "cache")


def test_range_reads_and_listing(store, tmp_path):
    store.put_bytes("runs/r1.json", json.dumps({"a": 1}).encode())
    store.put_bytes("blob", bytes(range(100)))
    assert store.get_bytes("blob", 10, 20) == bytes(range(10, 20))
    assert store.get_bytes("blob", 95) == bytes(range(95, 100))
    assert store.get_json("runs/r1.json") == {"a": 1}
    assert store.get_json("runs/missing.json") is None
    assert store.list("runs/") == ["runs/r1.json"]
    with pytest.raises(FileNotFoundError):
        store.get_bytes("nope")


def test_push_pull_dir(store, tmp_path):
    src = _tree(tmp_path / "ck", {"state.json": b"{}", "shards/p0": b"0" * 10})
    store.push_dir(src, "checkpoints/x/k")
    assert store.pull_dir("checkpoints/x/k", tmp_path / "back") == 2
    assert (tmp_path / "back/shards/p0").read_bytes() == b"0" * 10


def test_s3_multipart_upload(s3_env, tmp_path, monkeypatch):
    monkeypatch.setattr(S3Store, "MULTIPART_THRESHOLD", 5 * 1024 * 1024)
    store = S3Store(f"s3://{s3_env}")
    big = tmp_path / "out" / "big.bin"
    big.parent.mkdir()
    big.write_bytes(b"x" * (12 * 1024 * 1024 + 7))
    m = store.publish("pretrain", "k", big.parent)
    store.verify(m)
    assert store.get_bytes(f"{artifact_prefix('pretrain', 'k')}/{m.data_prefix}/big.bin", 12 * 1024 * 1024) == b"x" * 7


def test_s3_wrong_credentials_rejected(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    store = S3Store(f"s3://{s3_env}")
    with pytest.raises(Exception, match="(?i)signature|denied|forbidden|invalid"):
        store.put_bytes("x", b"1")


def test_s3_repr_hides_credentials(s3_env):
    store = S3Store(f"s3://{s3_env}", credentials={"aws_secret_access_key": "SHOULD-NOT-SHOW", "aws_access_key_id": "k"})
    assert "SHOULD-NOT-SHOW" not in repr(store) and "SHOULD-NOT-SHOW" not in store.uri
