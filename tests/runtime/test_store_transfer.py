"""S3 transfer settings (boto3 TransferConfig) from the config to every upload and download, and
publishing with the manifest digests computed beside the uploads (issue 19)."""
from __future__ import annotations

import hashlib
import json
import logging
from concurrent.futures import Future

import boto3.s3.transfer
import pytest

from glmforge.config import ConfigError, S3TransferConfig, StoreConfig, load_config
from runtime.store import LocalStore, S3Store, StoreUnavailableError
from tasks.store import configured_store
from tests.conftest import free_port

MiB = 1024 * 1024
KNOBS = {"multipart_threshold": 6 * MiB, "multipart_chunksize": 5 * MiB, "max_concurrency": 3, "use_threads": True}


def _knobs(cfg) -> dict:
    return {k: getattr(cfg, k) for k in KNOBS}


def test_store_passes_the_configured_transfer_config_to_boto3(tmp_path, monkeypatch):
    store = configured_store(StoreConfig(uri="s3://b/p", transfer=S3TransferConfig(**KNOBS)))
    calls = []
    monkeypatch.setattr(store._client, "upload_file", lambda *a, **kw: calls.append(("up", kw["Config"])))

    def download(bucket, key, dest, Config):
        calls.append(("down", Config))
        open(dest, "wb").close()

    monkeypatch.setattr(store._client, "download_file", download)
    src = tmp_path / "f"
    src.write_bytes(b"x")
    store.put_file("k", src)
    store.get_file("k", tmp_path / "back")
    assert [c[0] for c in calls] == ["up", "down"]
    assert all(_knobs(c) == KNOBS for _, c in calls)


def test_publish_uploads_the_files_together_with_the_configured_transfer_config(tmp_path, monkeypatch):
    """publish -> put_files: one boto3 transfer manager for all the artifact's files, built with
    the store's TransferConfig; the manifest goes last, with every file's digest."""
    store = S3Store("s3://b/p", transfer=KNOBS)
    managers, uploads, puts = [], [], []

    class Manager:
        def __init__(self, client, config):
            managers.append(config)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def upload(self, path, bucket, key):
            uploads.append((bucket, key, open(path, "rb").read()))
            done = Future()
            done.set_result(None)
            return done

    monkeypatch.setattr(boto3.s3.transfer, "create_transfer_manager", Manager)
    monkeypatch.setattr(store, "put_bytes", lambda key, data: puts.append(key))
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    for rel in ("a.bin", "b.bin", "sub/c.json"):
        (src / rel).write_bytes(rel.encode() * 100)
    m = store.publish("s", "k", src)
    assert len(managers) == 1 and _knobs(managers[0]) == KNOBS
    assert [(b, k.rsplit("/", 1)[1]) for b, k, _ in uploads] == [("b", "a.bin"), ("b", "b.bin"), ("b", "c.json")]
    assert all(k.startswith(f"p/artifacts/s/k/{m.data_prefix}/") for _, k, _ in uploads)
    assert puts == ["artifacts/s/k/MANIFEST.json"]
    assert {f.path: f.sha256 for f in m.files} == {
        rel: hashlib.sha256(rel.encode() * 100).hexdigest() for rel in ("a.bin", "b.bin", "sub/c.json")}


def test_unreachable_server_during_put_files_is_store_unavailable(tmp_path):
    store = S3Store("s3://b/p", {"endpoint_url": f"http://127.0.0.1:{free_port()}", "aws_access_key_id": "k",
                                  "aws_secret_access_key": "s", "region_name": "us-east-1"},
                    connect_timeout=0.5, read_timeout=1, max_attempts=1, transfer=KNOBS)
    files = []
    for name in ("a", "b", "c"):
        (tmp_path / name).write_bytes(b"x")
        files.append((f"data/{name}", tmp_path / name))
    with pytest.raises(StoreUnavailableError, match="unreachable: upload s3://b/p/data/a"):
        store.put_files(files)


def test_transfer_defaults_match_the_config_and_unknown_knobs_are_refused():
    assert S3TransferConfig().model_dump() == S3Store.transfer_defaults()
    assert _knobs(S3Store("s3://b/p")._transfer) == S3Store.transfer_defaults()
    # one knob given: the others keep their defaults
    assert _knobs(S3Store("s3://b/p", transfer={"max_concurrency": 2})._transfer) == \
        {**S3Store.transfer_defaults(), "max_concurrency": 2}
    with pytest.raises(ValueError, match="max_concurency"):
        S3Store("s3://b/p", transfer={"max_concurency": 2})


def test_transfer_config_validation_and_sizes():
    t = S3TransferConfig(multipart_threshold="16MiB", multipart_chunksize="8 MB")
    assert (t.multipart_threshold, t.multipart_chunksize) == (16 * MiB, 8_000_000)
    for bad in ({"multipart_chunksize": "1MiB"}, {"multipart_chunksize": "6GiB"}, {"max_concurrency": 0},
                {"multipart_threshold": "lots"}, {"chunksize": MiB}):
        with pytest.raises(ValueError):
            S3TransferConfig(**bad)
    cfg = load_config("tiny", overrides=["store.transfer.multipart_chunksize=16MiB", "store.transfer.max_concurrency=4"])
    assert (cfg.store.transfer.multipart_chunksize, cfg.store.transfer.max_concurrency) == (16 * MiB, 4)
    with pytest.raises(ConfigError, match=r"--set store\.transfer\.max_concurrency=0: field store\.transfer\.max_concurrency"):
        load_config("tiny", overrides=["store.transfer.max_concurrency=0"])


def test_store_config_dump_and_logs_hold_no_credentials(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SHOULD-NOT-SHOW")
    cfg = StoreConfig(uri="s3://b/p", transfer=S3TransferConfig(**KNOBS))
    with caplog.at_level(logging.DEBUG, logger="glmforge"):
        store = configured_store(cfg)
    assert "SHOULD-NOT-SHOW" not in json.dumps(cfg.model_dump()) + repr(store) + caplog.text
    assert set(cfg.model_dump()) == {"uri", "credentials_block", "transfer"}


def test_failed_upload_publishes_nothing(tmp_path):
    class Failing(LocalStore):
        def put_file(self, key, src):
            if key.endswith("b.bin"):
                raise OSError("disk gone")
            super().put_file(key, src)

    src = tmp_path / "out"
    src.mkdir()
    for name in ("a.bin", "b.bin", "c.bin"):
        (src / name).write_bytes(name.encode() * 1000)
    store = Failing(tmp_path / "store")
    with pytest.raises(OSError, match="disk gone"):
        store.publish("s", "k", src)
    assert store.manifest("s", "k") is None


def test_s3_roundtrip_with_configured_multipart(s3_env, tmp_path):
    """Several multipart files (3 parts of 5 MiB in flight) and small ones: published with the
    digests hashed beside the uploads, downloaded with the same settings, verified."""
    store = configured_store(StoreConfig(uri=f"s3://{s3_env}/pipe", transfer=S3TransferConfig(**KNOBS)))
    src = tmp_path / "ckpt"
    (src / "optim").mkdir(parents=True)
    files = {"model-1.bin": bytes(range(256)) * (13 * MiB // 256) + b"tail",
             "optim/state.bin": b"\x07" * (11 * MiB + 3), "config.json": b"{}", "latest": b"step-3"}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    m = store.publish("pretrain", "k", src)
    assert {f.path: f.size for f in m.files} == {rel: len(d) for rel, d in files.items()}
    store.verify(m)
    back = store.materialize(store.manifest("pretrain", "k"), tmp_path / "cache")
    assert {rel: (back / rel).read_bytes() for rel in files} == files
