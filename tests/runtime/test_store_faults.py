"""Faults, each with nothing lost: the S3 server stopped mid-publish and mid-mirror, a full
checkpoint disk, two runs of one stage at once, a corrupted byte in a published artifact."""
from __future__ import annotations

import builtins
import dataclasses
import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from glmforge.config import load_config
from glmforge.pipeline import STAGES, get_stage
from runtime.runner import Runner
from runtime.store import (
    CorruptArtifactError, Lease, LeaseTimeout, LocalStore, S3Store, StoreUnavailableError, artifact_prefix,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def jsonl(tmp_path):
    f = tmp_path / "raw" / "docs.jsonl"
    f.parent.mkdir()
    f.write_text("".join(json.dumps({"text": f"document number {i} " + "word " * (i % 7)}) + "\n" for i in range(50)))
    return f


def _cfg(jsonl):
    return load_config("tiny", overrides=[f"ingest.sources=[{{name: raw, path: '{jsonl}'}}]", "ingest.shard_size=10"])


def _clean_digest(tmp_path, cfg) -> str:
    """The artifact an undisturbed run publishes."""
    return Runner(cfg, LocalStore(tmp_path / "clean"), STAGES, home=tmp_path / "clean-home").run_stage(get_stage("ingest"), {}).manifest.digest


def _fast_s3(bucket: str) -> S3Store:
    return S3Store(f"s3://{bucket}/pipe", connect_timeout=1, read_timeout=5, max_attempts=2)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    return S3Store(f"s3://{request.getfixturevalue('s3_env')}/pipe")


# ---------------------------------------------------------------- S3 server stopped


def test_s3_stopped_mid_publish_then_retry_lands_complete_artifact(tmp_path, jsonl, seaweed_own, monkeypatch):
    server, bucket = seaweed_own
    cfg = _cfg(jsonl)
    store = _fast_s3(bucket)
    runner = Runner(cfg, store, STAGES, home=tmp_path / "home")
    key = runner.key(get_stage("ingest"), {})
    real_put_files = S3Store.put_files
    uploaded: list[str] = []

    def stop_after_first_data_file(self, items):
        (k, src), rest = items[0], items[1:]
        assert "/data-" in k and rest, "publish uploads the artifact's files together"
        self.put_file(k, src)
        uploaded.append(k)
        server.stop()  # the server dies in the middle of the artifact's upload
        real_put_files(self, rest)

    monkeypatch.setattr(S3Store, "put_files", stop_after_first_data_file)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError) as err:
        runner.run_stage(get_stage("ingest"), {})
    assert time.monotonic() - t0 < 15, "a stopped server must give an error, not a hang"
    assert server.endpoint in str(err.value) and "/data-" in str(err.value) and "unreachable" in str(err.value)
    monkeypatch.setattr(S3Store, "put_files", real_put_files)

    server.start()
    half = [k for k in store.list(artifact_prefix("ingest", key)) if "/data-" in k]
    assert half == uploaded, "the killed upload left its first file"
    assert store.manifest("ingest", key) is None and list(store.artifacts()) == []

    # The retry (what Prefect's task retries do), watched by a reader that must only ever see
    # no manifest or a complete, verifiable artifact.
    seen, stop = [], threading.Event()
    reader_store = _fast_s3(bucket)

    def reader():
        while not stop.is_set():
            m = reader_store.manifest("ingest", key)
            if m is not None:
                reader_store.verify(m)
                seen.append(m.digest)

    t = threading.Thread(target=reader)
    t.start()
    try:
        result = runner.run_stage(get_stage("ingest"), {})
    finally:
        stop.set()
        t.join()
    assert result.state == "done"
    store.verify(result.manifest)
    assert result.manifest.digest == _clean_digest(tmp_path, cfg)
    assert set(seen) <= {result.manifest.digest}
    orphan = "/".join(half[0].split("/")[:4])
    assert store.gc() == [orphan]
    assert store.list(orphan) == []
    local = store.materialize(store.manifest("ingest", key), tmp_path / "cache")
    assert sorted(p.name for p in local.iterdir() if p.name != ".verified") == sorted(f.path for f in result.manifest.files)


def test_s3_stopped_mid_checkpoint_mirror_resumes_elsewhere(tmp_path, jsonl, seaweed_own, monkeypatch):
    server, bucket = seaweed_own
    cfg = _cfg(jsonl)
    store = _fast_s3(bucket)
    spec = get_stage("ingest")
    real_put = S3Store.put_file
    mirrored: list[str] = []

    def stop_mid_third_push(self, k, src):
        if k.endswith("/cursor.json") and "cursor.json" in mirrored:
            server.stop()  # push 2 sent its shard, not yet the cursor that points at it
        real_put(self, k, src)
        if k.startswith("checkpoints/"):
            mirrored.append(k.rsplit("/", 1)[1])

    monkeypatch.setattr(S3Store, "put_file", stop_mid_third_push)
    with pytest.raises(StoreUnavailableError, match="checkpoints/ingest/"):
        Runner(cfg, store, STAGES, home=tmp_path / "machine-a").run_stage(spec, {})
    monkeypatch.setattr(S3Store, "put_file", real_put)
    assert mirrored.count("cursor.json") == 1 and mirrored[-1].startswith("part-00001"), mirrored
    server.start()
    runner = Runner(cfg, store, STAGES)
    key = runner.key(spec, {})
    assert store.manifest("ingest", key) is None

    seen = []

    def spy(cfg_, inputs, wd):
        seen.append(json.loads((wd.checkpoint / "cursor.json").read_text())["shard"])
        return spec.run(cfg_, inputs, wd)

    result = Runner(cfg, store, STAGES, home=tmp_path / "machine-b").run_stage(dataclasses.replace(spec, runner=spy), {})
    assert seen == [1]  # the last cursor the store got: one shard done
    assert result.manifest.digest == _clean_digest(tmp_path, cfg)
    store.verify(result.manifest)
    assert store.list(f"checkpoints/ingest/{runner.work_key(spec, {})}") == []


def test_s3_store_timeouts_are_configurable(monkeypatch):
    monkeypatch.setenv("GLMFORGE_S3_CONNECT_TIMEOUT", "1.5")
    monkeypatch.setenv("GLMFORGE_S3_READ_TIMEOUT", "7")
    monkeypatch.setenv("GLMFORGE_S3_MAX_ATTEMPTS", "3")
    st = S3Store("s3://b/p")
    conf = st._client.meta.config
    assert (conf.connect_timeout, conf.read_timeout, conf.retries["total_max_attempts"]) == (1.5, 7, 3)
    assert S3Store("s3://b/p", max_attempts=9)._client.meta.config.retries["total_max_attempts"] == 9
    monkeypatch.setenv("GLMFORGE_S3_READ_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="GLMFORGE_S3_READ_TIMEOUT"):
        S3Store("s3://b/p")


# ---------------------------------------------------------------- full checkpoint disk


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 256 KiB folder: a tmpfs when we may mount one (root, as here and in CI), else a write
    hook that raises ENOSPC past the same budget."""
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)], capture_output=True)
    if r.returncode == 0:
        yield d
        subprocess.run(["umount", "-l", str(d)], check=True)
        return
    import torch

    budget = {"left": 256 * 1024}
    real_open, real_save = builtins.open, torch.save

    class Limited:
        def __init__(self, f):
            self._f = f

        def write(self, b):
            budget["left"] -= len(b)
            if budget["left"] < 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self._f.write(b)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return self._f.__exit__(*a)

    def hooked_open(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        return Limited(f) if ("w" in mode or "a" in mode) and str(d) in str(Path(file).resolve()) else f

    def save_through_open(obj, f, *a, **kw):
        if isinstance(f, (str, Path)):
            with hooked_open(f, "wb") as fh:
                return real_save(obj, fh, *a, **kw)
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(builtins, "open", hooked_open)
    monkeypatch.setattr(torch, "save", save_through_open)
    yield d


def test_checkpoint_disk_full_clear_error_previous_loads(small_disk):
    import torch

    from rl import trainer
    from training import checkpoint

    root = small_disk / "ckpt"
    small = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(small.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    trainer.save(root, 10, trainer.Policy(small, opt, gen), {"acc": 0.5}, keep_last=3)
    big = torch.nn.Linear(256, 256)  # 257 KiB of weights: cannot fit next to the first one
    with pytest.raises(checkpoint.CheckpointSpaceError) as err:
        trainer.save(root, 20, trainer.Policy(big, torch.optim.SGD(big.parameters(), lr=0.1), gen), {}, keep_last=3)
    msg = str(err.value)
    assert str(root.resolve()) in msg and "step_00000020" in msg and "step_00000010" in msg
    assert err.value.errno == errno.ENOSPC
    assert not (root / "step_00000020").exists()  # the partial one is gone, its space free again
    tag, meta = checkpoint.select_resume(root)
    assert (tag, meta["step"]) == ("step_00000010", 10)
    state = torch.load(root / tag / "state.pt" if (root / tag / "state.pt").exists()
                       else next((root / tag).glob("*.pt")), weights_only=False)
    assert torch.equal(state["model"]["weight"], small.weight)


def test_finalize_disk_full_keeps_latest(small_disk):
    from training import checkpoint

    root = small_disk / "ckpt"
    for step in (1, 2):
        (root / checkpoint.tag_for(step)).mkdir(parents=True)
        (root / checkpoint.tag_for(step) / "w.bin").write_bytes(b"x" * 1000)
        checkpoint.finalize(root, checkpoint.tag_for(step), {"step": step}, keep_last=5)
    (root / checkpoint.tag_for(3)).mkdir()
    with pytest.raises(checkpoint.CheckpointSpaceError, match=str(root.resolve())):
        with checkpoint.saving(root, checkpoint.tag_for(3)):
            with open(root / checkpoint.tag_for(3) / "w.bin", "wb") as f:
                f.write(b"x" * 300 * 1024)  # more than the disk holds
    assert (root / checkpoint.LATEST).read_text() == checkpoint.tag_for(2)
    assert checkpoint.select_resume(root)[0] == checkpoint.tag_for(2)
    # Other errors are not dressed up as a full disk.
    with pytest.raises(ValueError):
        with checkpoint.saving(root, checkpoint.tag_for(4)):
            raise ValueError("not about space")


# ---------------------------------------------------------------- leases


def test_lease_exclusive_release_and_timeout(store):
    a, b = Lease(store, "s/k", ttl=30), Lease(store, "s/k", ttl=30)
    a.acquire(wait=0)
    assert not b.try_acquire() and b.holder["owner"] == a.owner
    with pytest.raises(LeaseTimeout, match=f"owner {a.owner}.*leases/s/k/"):
        b.acquire(wait=0.3, poll=0.1)
    a.release()
    assert b.try_acquire()
    b.release()
    assert [k.rsplit("/", 1)[1] for k in store.list("leases/s/k/")] == ["0000000001"]  # old generations cleaned


def test_a_lease_just_created_by_another_thread_is_not_taken_for_a_leftover(tmp_path):
    """The race above, made certain: thread A has created its generation and not yet returned when
    thread B (same process, same pid) reads it. B must see a live holder, not an earlier attempt
    of this process that never released (which B would supersede: two winners)."""
    store = LocalStore(tmp_path / "store")
    a, b = Lease(store, "race/window", ttl=30), Lease(store, "race/window", ttl=30)
    create = store.create_exclusive
    b_won = []

    def create_then_b_looks(key, data):
        made = create(key, data)
        if made and not b_won:
            b_won.append(b.try_acquire())
        return made

    store.create_exclusive = create_then_b_looks
    assert a.try_acquire()
    assert b_won == [False] and b.holder["owner"] == a.owner
    a.release()


def test_lease_race_has_one_winner(store):
    for round_ in range(3):
        leases = [Lease(store, f"race/{round_}", ttl=30) for _ in range(6)]
        barrier = threading.Barrier(len(leases))
        won = []

        def go(lease):
            barrier.wait()
            if lease.try_acquire():
                won.append(lease)

        threads = [threading.Thread(target=go, args=(lease,)) for lease in leases]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(won) == 1
        won[0].release()


def test_stale_lease_expires(store):
    # A holder on another machine that stopped heartbeating: it blocks until its expiry.
    rec = {"owner": "ghost", "machine": "elsewhere/0", "pid": 1, "generation": 0,
           "expires": time.time() + 1.0, "released": False}
    store.create_exclusive("leases/s/k/0000000000", json.dumps(rec).encode())
    lease = Lease(store, "s/k", ttl=30)
    assert not lease.try_acquire()
    lease.acquire(wait=10, poll=0.1)
    # not before the ghost's expiry (measured from the expiry itself: on a loaded machine the
    # create and the first try can take most of the second), and not long after it
    assert rec["expires"] <= time.time() < rec["expires"] + 4
    lease.release()
    # A holder killed on this machine: its pid is gone, no need to wait for the expiry.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    from runtime.store.lease import _machine

    rec = {"owner": "dead", "machine": _machine(), "pid": dead.pid, "generation": 2,
           "expires": time.time() + 3600, "released": False}
    store.create_exclusive("leases/s/k/0000000002", json.dumps(rec).encode())
    assert Lease(store, "s/k", ttl=30).try_acquire()


def test_lease_heartbeat_keeps_it_alive(store):
    # ttl 3 s, renewed every 1 s: a loaded machine's slow S3 put must not look like a dead holder
    a = Lease(store, "s/hb", ttl=3.0)
    a.acquire(wait=0)
    time.sleep(4.5)  # past the ttl: only the heartbeat keeps it
    assert not Lease(store, "s/hb", ttl=3.0).try_acquire()
    a.release()


def test_two_runners_do_not_run_a_stage_twice(tmp_path, jsonl, store):
    cfg = _cfg(jsonl)
    spec = get_stage("ingest")
    spans, results, lock = [], {}, threading.Lock()

    def slow(cfg_, inputs, wd):
        t0 = time.monotonic()
        time.sleep(0.8)
        out = spec.run(cfg_, inputs, wd)
        with lock:
            spans.append((t0, time.monotonic()))
        return out

    slow_spec = dataclasses.replace(spec, runner=slow)

    def go(name):
        results[name] = Runner(cfg, store, STAGES, home=tmp_path / name, lease_ttl=5).run_stage(slow_spec, {})

    threads = [threading.Thread(target=go, args=(n,)) for n in ("a", "b")]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(spans) == 1, spans
    assert sorted(r.state for r in results.values()) == ["cached", "done"]
    assert results["a"].manifest.digest == results["b"].manifest.digest


_PROC = textwrap.dedent("""
    import dataclasses, json, os, sys, time
    from glmforge.config import load_config
    from glmforge.pipeline import STAGES, get_stage
    from runtime.runner import Runner
    from runtime.store import LocalStore
    jsonl, store, home, spans, sleep = sys.argv[1:6]
    spec = get_stage("ingest")
    def slow(cfg_, inputs, wd):
        t0 = time.time()
        with open(spans, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "start": t0}) + "\\n")
        time.sleep(float(sleep))
        out = spec.run(cfg_, inputs, wd)
        with open(spans, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "end": time.time()}) + "\\n")
        return out
    cfg = load_config("tiny", overrides=[f"ingest.sources=[{{name: raw, path: '{jsonl}'}}]", "ingest.shard_size=10"])
    r = Runner(cfg, LocalStore(store), STAGES, home=home).run_stage(dataclasses.replace(spec, runner=slow), {})
    print("STATE", r.state, flush=True)
""")


def _spawn(tmp_path, jsonl, spans, sleep):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", _PROC, str(jsonl), str(tmp_path / "store"), str(tmp_path / "home"),
                             str(spans), str(sleep)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_processes_same_store_and_a_killed_holder(tmp_path, jsonl):
    spans = tmp_path / "spans.jsonl"
    a, b = _spawn(tmp_path, jsonl, spans, 1.0), _spawn(tmp_path, jsonl, spans, 1.0)
    outs = [p.communicate(timeout=60)[0] for p in (a, b)]
    assert a.returncode == b.returncode == 0, outs
    assert sorted(o.strip().splitlines()[-1] for o in outs) == ["STATE cached", "STATE done"], outs
    lines = [json.loads(x) for x in spans.read_text().splitlines()]
    assert len([x for x in lines if "start" in x]) == 1, lines

    # A holder SIGKILLed mid-stage leaves its lease; the next run on this machine takes it at
    # once (its pid is gone) instead of waiting for the ttl, and finishes the stage.
    spans.unlink()
    jsonl.write_text(jsonl.read_text() + '{"text": "a new document"}\n')  # a new key: not cached
    killed = _spawn(tmp_path, jsonl, spans, 30)
    deadline = time.monotonic() + 30
    while not (spans.exists() and spans.read_text()):
        assert time.monotonic() < deadline and killed.poll() is None
        time.sleep(0.1)
    killed.kill()
    killed.wait()
    t0 = time.monotonic()
    nxt = _spawn(tmp_path, jsonl, spans, 0)
    out = nxt.communicate(timeout=60)[0]
    assert nxt.returncode == 0 and out.strip().splitlines()[-1] == "STATE done", out
    assert time.monotonic() - t0 < 30  # well under the 60 s default ttl


# ---------------------------------------------------------------- corrupted byte


def _flip_byte(store, manifest) -> str:
    """Flip one byte in the middle of the artifact's largest file; returns its store name."""
    f = max(manifest.files, key=lambda e: e.size)
    key = f"{artifact_prefix(manifest.stage, manifest.key)}/{manifest.data_prefix}/{f.path}"
    data = bytearray(store.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    store.put_bytes(key, bytes(data))
    return key


def test_corrupted_byte_is_refused_by_every_reader(tmp_path, jsonl, store, monkeypatch):
    from typer.testing import CliRunner

    from glmforge.cli import app

    cfg = _cfg(jsonl)
    runner = Runner(cfg, store, STAGES, home=tmp_path / "home")
    m = runner.run_stage(get_stage("ingest"), {}).manifest
    if isinstance(store, S3Store):  # a verified copy in the cache from before the damage
        store.materialize(m, tmp_path / "home" / "cache")
    bad = _flip_byte(store, m)
    name = bad.rsplit("/", 1)[1]

    with pytest.raises(CorruptArtifactError, match=f"{bad}: .*(sha256|digest)"):
        store.materialize(m, tmp_path / "fresh-cache")
    with pytest.raises(CorruptArtifactError, match=bad):
        store.verify(m)

    res = CliRunner().invoke(app, ["artifacts", "verify", "--store", store.uri])
    assert res.exit_code == 1 and "CORRUPT" in res.output and bad in res.output, res.output

    # The next stage reads it through the runner: refused, nothing published for it.
    child = get_stage("quality")
    with pytest.raises(CorruptArtifactError, match=name):
        Runner(cfg, store, STAGES, home=tmp_path / "home2").run_stage(child, {"ingest": m})
    assert [a.stage for a in store.artifacts()] == ["ingest"]


def test_corrupted_cache_copy_is_fetched_again(tmp_path, jsonl, s3_env):
    store = S3Store(f"s3://{s3_env}/pipe")
    m = Runner(_cfg(jsonl), store, STAGES, home=tmp_path / "home").run_stage(get_stage("ingest"), {}).manifest
    local = store.materialize(m, tmp_path / "cache")
    f = max(m.files, key=lambda e: e.size)
    data = bytearray((local / f.path).read_bytes())
    data[0] ^= 0xFF
    (local / f.path).write_bytes(bytes(data))
    again = store.materialize(m, tmp_path / "cache")
    store._check(again / f.path, f, f.path)  # intact again, from the store
