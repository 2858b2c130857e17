"""Stage keys, skipping, publishing and run records, without Prefect."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from glmforge.config import load_config
from glmforge.pipeline import STAGE_NAMES, STAGES, get_stage
from runtime.runner import Runner, RunRecord, code_digest, execute, stage_key
from runtime.store import LocalStore, Manifest


@pytest.fixture
def jsonl(tmp_path):
    f = tmp_path / "raw" / "docs.jsonl"
    f.parent.mkdir()
    f.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(50)))
    return f


def _cfg(jsonl, *extra):
    return load_config("tiny", overrides=[f"ingest.sources=[{{name: raw, path: '{jsonl}'}}]", "ingest.shard_size=10", *extra])


def _runner(tmp_path, cfg):
    return Runner(cfg, LocalStore(tmp_path / "store"), STAGES, home=tmp_path / "home")


def test_key_changes_one_field_at_a_time(jsonl):
    spec = get_stage("ingest")
    base = _cfg(jsonl)
    k = stage_key(spec, base.ingest, base.run.seed, {})
    assert stage_key(spec, base.ingest, base.run.seed, {}) == k
    assert stage_key(spec, _cfg(jsonl, "ingest.shard_size=11").ingest, 0, {}) != stage_key(spec, base.ingest, 0, {})
    assert stage_key(dataclasses.replace(spec, version="999"), base.ingest, base.run.seed, {}) != k
    jsonl.write_text(jsonl.read_text() + '{"text": "one more"}\n')  # raw data changed
    assert stage_key(spec, base.ingest, base.run.seed, {}) != k


def test_run_seed_is_in_the_keys_of_the_stages_that_read_it_only():
    """The seed rule: curation stages take their seeds from their own sections (in their keys);
    training and RL stages read run.seed, so it is in theirs."""
    cfg = load_config("tiny")
    parents = {p: Manifest(p, "k", "d", files=[]) for s in STAGES for p in s.parents}
    changed = {s.name for s in STAGES
               if stage_key(s, getattr(cfg, s.section), 0, parents, with_code=False)
               != stage_key(s, getattr(cfg, s.section), 1, parents, with_code=False)}
    curation = {"ingest", "quality", "dedup-exact", "dedup-minhash", "dedup-semantic", "issue-pr",
                "decontaminate", "tokenize", "pack", "swe-envs"}       # swe-envs: its own seed, as curation
    assert changed == set(STAGE_NAMES) - curation
    assert not any(get_stage(n).seeded for n in curation)


def test_the_key_covers_the_stage_code_but_not_its_prose(tmp_path, jsonl, monkeypatch):
    import importlib
    import sys

    for i, body in enumerate(['"""one"""\ndef run(cfg, inputs, wd):\n    return {"x": 1}\n',
                              '"""two: docs edited"""\ndef run(cfg, inputs, wd):  # comment\n    return {"x": 1}\n',
                              '"""two"""\ndef run(cfg, inputs, wd):\n    return {"x": 2}\n']):
        (tmp_path / f"stage_mod_{i}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    runs = [importlib.import_module(f"stage_mod_{i}").run for i in range(3)]
    assert code_digest(runs[0]) == code_digest(runs[1]) != code_digest(runs[2])
    cfg = _cfg(jsonl)
    spec = get_stage("ingest")
    keys = [stage_key(dataclasses.replace(spec, runner=r), cfg.ingest, 0, {}) for r in runs]
    assert keys[0] == keys[1] != keys[2]
    # the checkpoint folder does not follow the code: a fixed stage resumes its checkpoint
    runner = _runner(tmp_path, cfg)
    roots = {runner.workdir_root(dataclasses.replace(spec, runner=r), {}) for r in runs}
    assert len(roots) == 1
    for i in range(3):
        sys.modules.pop(f"stage_mod_{i}", None)


def test_a_stage_that_sets_torch_threads_does_not_set_them_for_the_next(tmp_path, jsonl):
    import torch

    spec = get_stage("ingest")
    before = torch.get_num_threads()
    one_thread = dataclasses.replace(spec, runner=lambda *a: torch.set_num_threads(1) or spec.run(*a))
    assert _runner(tmp_path, _cfg(jsonl)).run_stage(one_thread, {}).state == "done"
    assert torch.get_num_threads() == before


def test_key_depends_on_parent_digest(jsonl):
    child = dataclasses.replace(get_stage("ingest"), name="child", parents=("ingest",), fingerprint=None)
    cfg = _cfg(jsonl)
    m1 = Manifest("ingest", "a", "data-1", files=[])
    m2 = Manifest("ingest", "b", "data-2", files=[])  # same (empty) content, other key and nonce
    m3 = Manifest("ingest", "a", "data-1", files=[__import__("runtime.store").store.FileEntry("x", 1, "00")])
    key = lambda m: stage_key(child, cfg.ingest, 0, {"ingest": m})
    assert key(m1) == key(m2) != key(m3)


def test_second_run_is_cached_and_does_no_work(tmp_path, jsonl, monkeypatch):
    cfg = _cfg(jsonl)
    calls = []
    spec = get_stage("ingest")
    counting = dataclasses.replace(spec, runner=lambda *a: calls.append(1) or spec.run(*a))
    first = _runner(tmp_path, cfg).run_stage(counting, {})
    second = _runner(tmp_path, cfg).run_stage(counting, {})  # a new runner: nothing in memory
    assert (first.state, second.state, len(calls)) == ("done", "cached", 1)
    assert first.manifest.digest == second.manifest.digest
    assert first.manifest.metrics["documents"] == 50
    assert not _runner(tmp_path, cfg).workdir_root(spec, {}).exists()  # workdir cleaned up


def test_failed_publish_leaves_no_artifact_and_retry_succeeds(tmp_path, jsonl, monkeypatch):
    cfg = _cfg(jsonl)
    runner = _runner(tmp_path, cfg)
    real = LocalStore.put_bytes

    def die_on_manifest(self, key, data):
        if key.endswith("MANIFEST.json"):
            raise KeyboardInterrupt("killed before the manifest")
        return real(self, key, data)

    monkeypatch.setattr(LocalStore, "put_bytes", die_on_manifest)
    with pytest.raises(KeyboardInterrupt):
        runner.run_stage(get_stage("ingest"), {})
    monkeypatch.setattr(LocalStore, "put_bytes", real)
    assert list(runner.store.artifacts()) == []
    result = runner.run_stage(get_stage("ingest"), {})
    assert result.state == "done"
    assert len(runner.store.gc()) == 1  # the orphaned upload of the killed attempt
    runner.store.verify(result.manifest)


def test_execute_records_failure_and_status(tmp_path, jsonl):
    cfg = _cfg(jsonl)
    runner = _runner(tmp_path, cfg)
    spec = get_stage("ingest")
    boom = dataclasses.replace(spec, runner=lambda *a: (_ for _ in ()).throw(RuntimeError("disk on fire")))
    record = RunRecord.new(cfg, {"preset": "tiny"}, ["ingest"])
    with pytest.raises(RuntimeError):
        execute(runner, [boom], record)
    saved = RunRecord.load(runner.store)
    assert saved.state == "failed"
    assert saved.stages[0]["state"] == "failed" and "disk on fire" in saved.stages[0]["error"]
    execute(runner, [spec], saved)
    public = RunRecord.load(runner.store).public()
    assert public["run"]["state"] == "completed"
    assert public["stages"][0]["state"] == "done" and public["stages"][0]["metrics"]["documents"] == 50


def test_published_upstream_names_missing_parent(tmp_path, jsonl):
    runner = _runner(tmp_path, _cfg(jsonl))
    with pytest.raises(ValueError, match="needs 'ingest'.*glmforge run --until ingest"):
        runner.published_upstream("quality")


def test_remote_store_mirrors_checkpoint_and_resumes_elsewhere(tmp_path, jsonl, s3_env, monkeypatch):
    """With S3, a stage's checkpoint is mirrored to the store: a retry on another machine (a new
    home directory) restores it and continues instead of starting over."""
    from runtime.store import S3Store
    import data_processing.ingest as ingest

    cfg = _cfg(jsonl)
    store = S3Store(f"s3://{s3_env}/pipeline")
    real, calls = ingest._save_cursor, {"n": 0}

    def crash_on_third(path, c):
        real(path, c)
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("machine lost")

    monkeypatch.setattr(ingest, "_save_cursor", crash_on_third)
    first = Runner(cfg, store, STAGES, home=tmp_path / "machine-a")
    with pytest.raises(KeyboardInterrupt):
        first.run_stage(get_stage("ingest"), {})
    key = first.work_key(get_stage("ingest"), {})
    assert store.list(f"checkpoints/ingest/{key}/cursor.json")
    monkeypatch.setattr(ingest, "_save_cursor", real)

    seen = []
    spec = get_stage("ingest")
    def spy(cfg_, inputs, wd):
        seen.append(json.loads((wd.checkpoint / "cursor.json").read_text())["shard"])
        return spec.run(cfg_, inputs, wd)

    result = Runner(cfg, store, STAGES, home=tmp_path / "machine-b").run_stage(dataclasses.replace(spec, runner=spy), {})
    # The third checkpoint died before it was mirrored: machine b continues from the second.
    assert seen == [2] and result.manifest.metrics["documents"] == 50
    assert store.list(f"checkpoints/ingest/{key}") == []  # cleaned after publishing
    clean = Runner(cfg, LocalStore(tmp_path / "other"), STAGES, home=tmp_path / "c").run_stage(spec, {})
    assert clean.manifest.digest == result.manifest.digest


def test_checkpoint_mirror_uploads_in_write_order_and_prunes(tmp_path):
    from runtime.runner import _CheckpointMirror

    remote = LocalStore(tmp_path / "remote")
    local = tmp_path / "ckpt"
    (local / "step_1").mkdir(parents=True)
    (local / "step_1" / "weights").write_bytes(b"w1")
    (local / "latest").write_text("step_1")
    uploads = []
    real = remote.put_file
    remote.put_file = lambda key, src: (uploads.append(key), real(key, src))[1]
    mirror = _CheckpointMirror(remote, "checkpoints/s/k", local)
    mirror.push()
    assert uploads == ["checkpoints/s/k/step_1/weights", "checkpoints/s/k/latest"]
    mirror.push()
    assert len(uploads) == 2  # unchanged files are not sent again
    (local / "step_2").mkdir()
    (local / "step_2" / "weights").write_bytes(b"w2")
    os.utime(local / "step_2" / "weights", ns=(10**18, 10**18))
    (local / "latest").write_text("step_2")
    os.utime(local / "latest", ns=(10**18 + 1, 10**18 + 1))
    for p in (local / "step_1").iterdir():
        p.unlink()
    (local / "step_1").rmdir()
    mirror.push()
    assert uploads[2:] == ["checkpoints/s/k/step_2/weights", "checkpoints/s/k/latest"]
    assert remote.list("checkpoints/s/k") == ["checkpoints/s/k/latest", "checkpoints/s/k/step_2/weights"]


def test_a_stop_whose_exception_was_lost_starts_no_further_stage(tmp_path, jsonl):
    """Prefect's SIGTERM handler raises in whatever frame runs; inside a weakref callback the
    exception is dropped. Its wrapper (flows.end_to_end) notes the signal first, and the runner
    starts no stage after it: the run ends interrupted, not completed."""
    import signal

    from prefect.exceptions import TerminationSignal
    from prefect.utilities import engine

    import flows.end_to_end  # noqa: F401 (wraps Prefect's handler on import)
    from runtime import shutdown
    from runtime.stage import resolve

    cfg = _cfg(jsonl)
    runner = _runner(tmp_path, cfg)
    record = RunRecord.new(cfg, {"preset": "tiny"}, ["ingest", "quality"])
    ingest = get_stage("ingest")
    real = resolve(ingest.runner)

    def ingest_then_sigterm_lost(*args):
        out = real(*args)
        try:
            engine._prefect_sigterm_handler(signal.SIGTERM)      # what SIGTERM runs in a flow ...
        except TerminationSignal:
            pass                                                  # ... its exception dropped
        return out

    shutdown.reset()
    try:
        with pytest.raises(KeyboardInterrupt, match="before quality"):
            execute(runner, [dataclasses.replace(ingest, runner=ingest_then_sigterm_lost), get_stage("quality")],
                    record)
        assert shutdown.received() == [signal.SIGTERM]
    finally:
        shutdown.reset()
    saved = RunRecord.load(runner.store)
    assert saved.state == "interrupted"
    assert [s["state"] for s in saved.stages][:2] == ["done", "interrupted"]


def test_progress_of_an_interrupted_stage_reads_its_steps_its_checkpoint_and_its_chunk_cursor(tmp_path):
    """What `glmforge status` says of a stage that did not publish: the training loop's last step
    and `latest` checkpoint, or a chunked stage's cursor (rl-prompts, self-distill)."""
    from runtime.runner import stage_progress

    store = LocalStore(tmp_path / "store")
    train = tmp_path / "home" / "work" / "sft" / "k1" / "checkpoint"
    train.mkdir(parents=True)
    (train / "metrics.jsonl").write_text('{"step": 3}\n{"step": 4}\n{"ste')      # a line cut by a kill
    (train / "latest").write_text("step_00000004")
    chunked = tmp_path / "home" / "work" / "self-distill@2" / "k2" / "checkpoint"
    chunked.mkdir(parents=True)
    (chunked / "rows.cursor.json").write_text(json.dumps({"chunks": 2, "bytes": 100}))
    home = tmp_path / "home"
    assert stage_progress(store, home, "sft", "k1") == {"step": 4, "checkpoint_step": 4, "checkpoint_chunks": None}
    assert stage_progress(store, home, "self-distill@2", "k2") == {"step": None, "checkpoint_step": None,
                                                                  "checkpoint_chunks": 2}
    assert stage_progress(store, home, "rl-prompts", "none") == {"step": None, "checkpoint_step": None,
                                                                 "checkpoint_chunks": None}
