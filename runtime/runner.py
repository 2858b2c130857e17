"""Running stages: keys, skip-if-published, checkpoint directories, publishing, run records.

Plain Python: tasks/ and flows/ wrap these calls in Prefect, tests call them directly.

A stage's key is sha256(stage name, stage version, its resolved config section (less its
operational fields: worker counts, cluster addresses; see runtime.stage.OPERATIONAL), the run seed
where the stage reads it, the content digests of its parent artifacts, the fingerprint of the
non-artifact files it reads, and the digest of its code). The store is the cache: when an
artifact with that key is published, the stage is skipped and the artifact reused — in a new
flow run, on another machine, after the Prefect database is gone.

Code digest: sha256 of the AST of the module that defines the stage function (docstrings and
comments excluded, so editing prose re-runs nothing). Code shared by many stages (model/,
kernels/, the training loop) is not in it: a change there that alters outputs bumps the
versions of the stages it affects. The checkpoint folder is keyed WITHOUT the code digest, so a
stage resumed after a bug fix continues from the checkpoint the failed attempt left (its
format is covered by `version`) and publishes under the new key.

The runner knows no concrete stage: it is given the stage list (glmforge.pipeline.STAGES for
the application, a few specs in tests).
"""
from __future__ import annotations

import ast
import contextlib
import datetime as dt
import functools
import hashlib
import inspect
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from pydantic import BaseModel

from runtime.gpus import claim_gpus, stage_gpus
from runtime.tracking import open_tracker
from runtime.shutdown import Preempted, stop_requested
from runtime.stage import ProgressFn, StageFn, StageSpec, Workdir, base_name, upstream
from runtime.store import Lease, Manifest, Store, default_home
from runtime.store.lease import pid_alive

log = logging.getLogger("glmforge")


def key_config(section: BaseModel) -> dict[str, Any]:
    """The config section as it enters the key: every field but the operational ones
    (runtime.stage.OPERATIONAL: worker counts, cluster addresses), which change how a stage
    runs and never its output."""
    skip = {name for name, f in type(section).model_fields.items()
            if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("operational")}
    return section.model_dump(mode="json", exclude=skip)


def stage_key(spec: StageSpec, section: BaseModel, seed: int, parents: dict[str, Manifest],
              with_code: bool = True) -> str:
    """The artifact key; with_code=False gives the checkpoint folder's key (see above)."""
    missing = set(spec.parents) - set(parents)
    assert not missing, f"{spec.name}: parent artifacts missing: {missing}"
    payload = {
        "stage": spec.name,
        "version": spec.version,
        "config": key_config(section),
        "inputs": {p: parents[p].digest for p in sorted(spec.parents)},
    }
    if spec.seeded:
        payload["seed"] = seed
    fingerprint = spec.fingerprint_fn
    if fingerprint is not None:
        payload["raw_inputs"] = fingerprint(section)
    if with_code:
        payload["code"] = code_digest(spec.run)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


@functools.lru_cache(maxsize=None)
def _module_digest(path: str) -> str:
    tree = ast.parse(Path(path).read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            body[0] = ast.Pass()   # a docstring is prose, not behaviour
    return hashlib.sha256(ast.dump(tree, annotate_fields=False).encode()).hexdigest()[:16]


def code_digest(fn: Callable[..., Any]) -> str:
    """Digest of the source module of a stage function (docstrings and comments excluded)."""
    fn = inspect.unwrap(fn)
    try:
        path = inspect.getsourcefile(fn)
        return _module_digest(path) if path else "no-source"
    except (OSError, TypeError):   # defined in `python -c`, a REPL, a C extension
        return "no-source"


@dataclass
class StageResult:
    name: str
    key: str
    state: str  # "done" (ran now) | "cached" (artifact reused)
    manifest: Manifest
    artifact: str


class _CheckpointMirror:
    """Mirrors a local checkpoint dir to the store (remote stores only), uploading changed files."""

    def __init__(self, store: Store, prefix: str, local: Path):
        self.store, self.prefix, self.local = store, prefix, local
        self.sent: dict[str, tuple[int, int]] = {}

    def restore(self) -> int:
        if any(self.local.iterdir()):
            return 0
        return self.store.pull_dir(self.prefix, self.local)

    def push(self) -> None:
        # Upload in modification order: a stage writes its state file (cursor, "latest" pointer)
        # after the data it refers to, so the remote copy never points at data not yet uploaded.
        files = [(p.stat(), p) for p in self.local.rglob("*") if p.is_file()]
        for st, p in sorted(files, key=lambda x: (x[0].st_mtime_ns, str(x[1]))):
            rel = p.relative_to(self.local).as_posix()
            if self.sent.get(rel) != (st.st_size, st.st_mtime_ns):
                self.store.put_file(f"{self.prefix}/{rel}", p)
                self.sent[rel] = (st.st_size, st.st_mtime_ns)
        # Then drop what the stage deleted locally (pruned checkpoints), never before the
        # newer state is up: the remote copy always holds one complete checkpoint.
        present = {p.relative_to(self.local).as_posix() for _, p in files}
        for rel in sorted(set(self.sent) - present):
            self.store.delete_prefix(f"{self.prefix}/{rel}")
            del self.sent[rel]


class Runner:
    def __init__(self, cfg: BaseModel, store: Store, stages: Sequence[StageSpec], home: Path | None = None,
                 lease_ttl: float | None = None, lease_wait: float | None = None):
        """`stages`: every stage the config has a section for, in execution order (parents
        first). lease_ttl / lease_wait: see stage_lease ($GLMFORGE_LEASE_TTL, 60 s;
        $GLMFORGE_LEASE_WAIT, 86400 s)."""
        self.cfg, self.store = cfg, store
        self.stages = list(stages)
        self.home = Path(home) if home else default_home()
        self.seed = cfg.run.seed  # type: ignore[attr-defined]
        self.lease_ttl = lease_ttl if lease_ttl is not None else float(os.environ.get("GLMFORGE_LEASE_TTL") or 60)
        self.lease_wait = lease_wait if lease_wait is not None else float(os.environ.get("GLMFORGE_LEASE_WAIT") or 86400)

    def stage_lease(self, spec: StageSpec, key: str) -> Lease:
        """The store-wide lock on running (stage, key). Two runs of one config on one store (two
        `glmforge run`, a retry on another machine) never run a stage twice at once: the second
        waits up to lease_wait seconds for the first, then finds its artifact published
        (cached) — or, when the first failed, runs the stage itself from its checkpoint. A
        holder that died without releasing stops blocking after lease_ttl seconds (at once on
        the same machine). Past lease_wait, LeaseTimeout names the holder."""
        return Lease(self.store, f"{spec.name}/{key}", ttl=self.lease_ttl)

    def section(self, spec: StageSpec) -> BaseModel:
        return getattr(self.cfg, spec.section)

    def key(self, spec: StageSpec, parents: dict[str, Manifest]) -> str:
        return stage_key(spec, self.section(spec), self.seed, parents)

    def work_key(self, spec: StageSpec, parents: dict[str, Manifest]) -> str:
        """The key of the stage's working folder and mirrored checkpoint: the artifact key
        without the code digest, so a fixed stage resumes its checkpoint (see above)."""
        return stage_key(spec, self.section(spec), self.seed, parents, with_code=False)

    def workdir_root(self, spec: StageSpec, parents: dict[str, Manifest]) -> Path:
        return self.home / "work" / spec.name / self.work_key(spec, parents)

    def run_stage(
        self, spec: StageSpec, parents: dict[str, Manifest], progress: ProgressFn | None = None,
        run: StageFn | None = None,
    ) -> StageResult:
        """Run `spec` unless its artifact is published. `run` replaces the stage function for
        this call (the Prefect layer passes the Dask path of a stage whose config asks for it);
        it must write what spec.run writes: the key is spec's either way."""
        key = self.key(spec, parents)
        published = self.store.manifest(spec.name, key)
        if published is not None:
            log.info("%s: artifact %s already published, skipping", spec.name, key)
            return StageResult(spec.name, key, "cached", published, self.store.artifact_uri(spec.name, key))
        with self.stage_lease(spec, key).held(self.lease_wait):
            published = self.store.manifest(spec.name, key)  # published by the run we waited for
            if published is not None:
                log.info("%s: artifact %s published by another run, skipping", spec.name, key)
                return StageResult(spec.name, key, "cached", published, self.store.artifact_uri(spec.name, key))
            return self._run_unlocked(spec, key, parents, progress, run)

    def _run_unlocked(
        self, spec: StageSpec, key: str, parents: dict[str, Manifest], progress: ProgressFn | None,
        run: StageFn | None = None,
    ) -> StageResult:
        root = self.workdir_root(spec, parents)
        out, ckpt = root / "out", root / "checkpoint"
        shutil.rmtree(out, ignore_errors=True)  # outputs are rebuilt each attempt; state lives in ckpt
        out.mkdir(parents=True)
        ckpt.mkdir(parents=True, exist_ok=True)
        # A local checkpoint survives a crash; with a remote store it is mirrored there too, so
        # a retry on another machine resumes from it.
        remote = self.store.local_path("") is None
        remote_ckpt = f"checkpoints/{spec.name}/{root.name}"
        mirror = _CheckpointMirror(self.store, remote_ckpt, ckpt) if remote else None
        if mirror and mirror.restore():
            log.info("%s: restored checkpoint from %s", spec.name, self.store.uri)
        workdir = Workdir(
            out=out,
            checkpoint=ckpt,
            progress=progress or (lambda d, t, s: None),
            persist_checkpoint=mirror.push if mirror else (lambda: None),
            seed=self.seed if spec.seeded else None,
        )
        inputs = {base_name(p): self.store.materialize(m, self.home / "cache") for p, m in parents.items()}
        with _own_thread_count(), claim_gpus(spec.name, stage_gpus(spec, self.section(spec))):
            metrics = (run or spec.run)(self.section(spec), inputs, workdir)
        manifest = self.store.publish(
            spec.name,
            key,
            out,
            metrics=json.loads(json.dumps(metrics, default=str)),
            parents={p: m.key for p, m in parents.items()},
            stage_version=spec.version,
            config=self.section(spec).model_dump(mode="json"),
        )
        shutil.rmtree(root, ignore_errors=True)
        if mirror:
            self.store.delete_prefix(remote_ckpt)
        return StageResult(spec.name, key, "done", manifest, self.store.artifact_uri(spec.name, key))

    def published_upstream(self, name: str) -> dict[str, Manifest]:
        """Manifests of every stage `name` depends on (not itself), for the current config.

        Raises ValueError naming the first upstream stage without a published artifact."""
        found: dict[str, Manifest] = {}
        for spec in upstream(self.stages, name):
            if spec.name == name:
                break
            parents = {p: found[p] for p in spec.parents}
            key = self.key(spec, parents)
            m = self.store.manifest(spec.name, key)
            if m is None:
                raise ValueError(
                    f"stage {name!r} needs {spec.name!r}, which has no published artifact for this "
                    f"config (key {key}) in {self.store.uri}; run `glmforge run --until {spec.name}` first"
                )
            found[spec.name] = m
        return found


# ---------------------------------------------------------------- run records


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# Guards a record between the heartbeat thread (which saves it) and the run (which edits it).
_record_lock = threading.RLock()
HEARTBEAT_S = 30.0   # default $GLMFORGE_HEARTBEAT_S
STALE_BEATS = 3      # a "running" record whose heartbeat is older than this many periods is dead


def _alive_here(host: str | None, pid: int | None) -> bool | None:
    """Whether pid runs on this host; None when the record is from another host."""
    if not pid or host != socket.gethostname():
        return None
    if not pid_alive(pid):
        return False
    try:  # a zombie has exited
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


@dataclass
class RunRecord:
    """What `glmforge status` shows: one pipeline run, its stages and their states.

    state: running | completed | failed | interrupted. A running record carries the pid and
    host of its process and a heartbeat (UTC time) that `execute` refreshes every heartbeat_s
    seconds; `public()` shows a running record whose process is gone (same host) or whose
    heartbeat is older than STALE_BEATS periods as interrupted."""

    id: str
    config: dict[str, Any]
    source: dict[str, Any]
    started: str = field(default_factory=_now)
    finished: str | None = None
    state: str = "running"
    stages: list[dict[str, Any]] = field(default_factory=list)
    heartbeat: str | None = None
    heartbeat_s: float | None = None
    pid: int | None = None
    host: str | None = None
    home: str | None = None         # the run's GLMFORGE_HOME: where its stages' checkpoints are
    tracking: dict[str, Any] | None = None  # the tracker's parent run (runtime.tracking): uri, run_id, link

    @classmethod
    def new(cls, cfg: BaseModel, source: dict[str, Any], stage_names: list[str]) -> "RunRecord":
        rec = cls(id=uuid.uuid4().hex[:12], config=cfg.model_dump(mode="json"), source=source)
        rec.stages = [
            {"name": n, "key": None, "state": "not run", "metrics": {}, "artifact": None, "error": None}
            for n in stage_names
        ]
        return rec

    def stage(self, name: str) -> dict[str, Any]:
        with _record_lock:
            return self._stage(name)

    def _stage(self, name: str) -> dict[str, Any]:
        for s in self.stages:
            if s["name"] == name:
                return s
        entry = {"name": name, "key": None, "state": "not run", "metrics": {}, "artifact": None, "error": None}
        self.stages.append(entry)
        return entry

    def mark(self, result: StageResult) -> None:
        self.stage(result.name).update(
            key=result.key, state=result.state, metrics=result.manifest.metrics, artifact=result.artifact, error=None
        )

    def fail(self, name: str, key: str | None, error: BaseException, state: str = "failed") -> None:
        with _record_lock:
            self.stage(name).update(key=key, state=state, error=f"{type(error).__name__}: {error}")

    def save(self, store: Store, latest: bool = True) -> None:
        with _record_lock:
            data = json.loads(json.dumps(self.__dict__))
        store.put_json(f"runs/{self.id}.json", data)
        if latest:
            store.put_bytes("runs/LATEST", self.id.encode())

    def shown_state(self, now: float | None = None) -> str:
        """The state to show: a running record whose process is gone is interrupted."""
        if self.state != "running" or self.heartbeat is None:
            return self.state
        if _alive_here(self.host, self.pid) is False:
            return "interrupted"
        beat = dt.datetime.fromisoformat(self.heartbeat).timestamp()
        period = self.heartbeat_s or HEARTBEAT_S
        if (now if now is not None else time.time()) - beat > STALE_BEATS * period:
            return "interrupted"
        return self.state

    @classmethod
    def load(cls, store: Store, run_id: str | None = None) -> "RunRecord | None":
        if run_id is None:
            try:
                run_id = store.get_bytes("runs/LATEST").decode().strip()
            except FileNotFoundError:
                return None
        data = store.get_json(f"runs/{run_id}.json")
        return cls(**data) if data else None

    def public(self, store: Store | None = None) -> dict[str, Any]:
        """The `status --json` object. With the run's store: a running or interrupted stage also
        gets the step it reached, its last checkpoint's step (stage_progress) and, interrupted,
        the command that continues it."""
        shown = self.shown_state()
        stages = []
        for s in self.stages:
            entry = {**{k: s[k] for k in ("name", "key", "state", "metrics", "artifact", "error")},
                     "started": s.get("started"), "seconds": s.get("seconds")}
            if s["state"] == "running" and shown != "running":
                entry["state"] = "interrupted"          # its process is gone
            if entry["state"] in ("running", "interrupted") and store is not None and s.get("work_key"):
                entry.update(stage_progress(store, Path(self.home) if self.home else None, s["name"], s["work_key"]))
                if entry["state"] == "interrupted":
                    entry["resume"] = f"glmforge resume {s['name']} --run {self.id}"
            stages.append(entry)
        return {"run": {"id": self.id, "state": shown, "started": self.started, "finished": self.finished,
                        "heartbeat": self.heartbeat, **self.source}, "stages": stages}


def stage_progress(store: Store, home: Path | None, stage: str, work_key: str) -> dict[str, Any]:
    """How far a stage that has not published got: `step`, the last step in its metrics.jsonl,
    `checkpoint_step`, its newest complete checkpoint's (the `latest` pointer,
    training.checkpoint), and `checkpoint_chunks`, the chunks a chunked stage's cursor holds
    (a `*.cursor.json` with "chunks": rl-prompts, self-distill), from its working folder when
    this machine has it, else from the checkpoint mirrored to a remote store. None where nothing
    is recorded."""
    out: dict[str, Any] = {"step": None, "checkpoint_step": None, "checkpoint_chunks": None}
    folder = home / "work" / stage / work_key / "checkpoint" if home else None
    if folder is not None and folder.is_dir():
        metrics_path = folder / "metrics.jsonl"
        if metrics_path.is_file():
            out["step"] = _last_step(metrics_path.read_text(errors="replace"))
        latest = sorted(folder.rglob("latest"), key=lambda p: len(p.parts))
        if latest:
            out["checkpoint_step"] = _tag_step(latest[0].read_text())
        cursors = sorted(folder.glob("*.cursor.json"))
        if cursors:
            out["checkpoint_chunks"] = _chunks(cursors[0].read_text())
        return out
    if store.local_path("") is None:                # a remote store holds the mirrored checkpoint
        prefix = f"checkpoints/{stage}/{work_key}/"
        try:
            names = store.list(prefix)
            latest = sorted((n for n in names if n.rsplit("/", 1)[-1] == "latest"), key=lambda n: n.count("/"))
            if latest:
                out["checkpoint_step"] = _tag_step(store.get_bytes(latest[0]).decode())
            if prefix + "metrics.jsonl" in names:
                out["step"] = _last_step(store.get_bytes(prefix + "metrics.jsonl").decode(errors="replace"))
            cursors = sorted(n for n in names if n.count("/") == prefix.count("/") and n.endswith(".cursor.json"))
            if cursors:
                out["checkpoint_chunks"] = _chunks(store.get_bytes(cursors[0]).decode(errors="replace"))
        except Exception as e:                      # a status must show, whatever the store says
            log.warning("%s: checkpoint in %s not readable: %s", stage, store.uri, e)
    return out


def _chunks(text: str) -> int | None:
    try:
        n = json.loads(text).get("chunks")
    except (json.JSONDecodeError, AttributeError):
        return None
    return n if isinstance(n, int) else None


def _last_step(text: str) -> int | None:
    for line in reversed(text.splitlines()):
        try:
            step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            continue                                # a line cut by a kill
        if isinstance(step, int):
            return step
    return None


def _tag_step(tag: str) -> int | None:
    tag = tag.strip()
    return int(tag[5:]) if tag.startswith("step_") and tag[5:].isdigit() else None


class Heartbeat:
    """Refreshes record.heartbeat (and saves the record) every `period` seconds from a
    daemon thread while the run's process lives; stops with the `with` block."""

    def __init__(self, record: RunRecord, store: Store, period: float | None = None):
        self.record, self.store = record, store
        self.period = period if period is not None else float(os.environ.get("GLMFORGE_HEARTBEAT_S") or HEARTBEAT_S)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="run-heartbeat", daemon=True)

    def _stamp(self) -> None:
        with _record_lock:
            self.record.heartbeat = dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")

    def __enter__(self) -> "Heartbeat":
        with _record_lock:
            self.record.pid, self.record.host = os.getpid(), socket.gethostname()
            self.record.heartbeat_s = self.period
        self._stamp()
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._done.wait(self.period):
            self._stamp()
            try:
                # not LATEST: a run started since is the latest, this one only stays alive
                self.record.save(self.store, latest=False)
            except Exception as e:  # a store hiccup must not end the run; the next beat retries
                log.warning("run %s: heartbeat not saved: %s", self.record.id, e)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def ended_state(error: BaseException) -> str:
    """failed for an error of the stage; interrupted for a stop request (a signal, Ctrl-C,
    Preempted, Prefect's TerminationSignal, SystemExit) — the stage did nothing wrong."""
    return "failed" if isinstance(error, Exception) and not isinstance(error, Preempted) else "interrupted"


def execute(
    runner: Runner,
    specs: list[StageSpec],
    record: RunRecord,
    run_one: Callable[[StageSpec, dict[str, Manifest]], StageResult] | None = None,
) -> dict[str, StageResult]:
    """Run `specs` in order, updating and saving the run record after each stage.

    `run_one` lets tasks/ route each stage through a Prefect task; by default stages run inline.
    The record always ends completed, failed or interrupted (see ended_state), whatever raised."""
    run_one = run_one or (lambda spec, parents: runner.run_stage(spec, parents))
    results: dict[str, StageResult] = {}
    record.state = "running"
    tracker = open_tracker(getattr(runner.cfg, "tracking", None))
    with Heartbeat(record, runner.store):
        try:
            record.tracking = tracker.begin(record, runner) or record.tracking
            record.save(runner.store)
            for spec in specs:
                parents: dict[str, Manifest] | None = None
                # the stage's wall time in this run (a cached one: its look-up), for `glmforge report`
                began = time.monotonic()
                with _record_lock:
                    record.stage(spec.name).update(started=_now(), seconds=None)
                try:
                    if stop_requested():
                        # a stop signal whose exception was lost (runtime.shutdown.note): no new stage
                        raise KeyboardInterrupt(f"stopped by a signal before {spec.name}")
                    if set(spec.parents) <= set(results):
                        parents = {p: results[p].manifest for p in spec.parents}
                    else:
                        # Resuming one stage (or a partial list): its parents come from the store.
                        upstream_found = runner.published_upstream(spec.name)
                        parents = {p: upstream_found[p] for p in spec.parents}
                    # `glmforge status` shows it running, and finds its checkpoint by the work key
                    with _record_lock:
                        record.stage(spec.name).update(state="running", work_key=runner.work_key(spec, parents),
                                                       error=None)
                        record.home = str(runner.home)
                    record.save(runner.store, latest=False)
                    res = run_one(spec, parents)
                except BaseException as e:
                    try:
                        key = runner.key(spec, parents) if parents is not None else None
                    except Exception:
                        key = None
                    with _record_lock:
                        record.fail(spec.name, key, e, ended_state(e))
                        record.stage(spec.name)["seconds"] = round(time.monotonic() - began, 3)
                    tracker.stage_failed(spec, e, runner)
                    raise
                results[spec.name] = res
                with _record_lock:
                    record.mark(res)
                    record.stage(spec.name)["seconds"] = round(time.monotonic() - began, 3)
                record.save(runner.store)
                tracker.stage(spec, res, runner, record.stage(spec.name)["seconds"])
        except BaseException as e:
            with _record_lock:
                record.state, record.finished = ended_state(e), _now()
            _save_on_the_way_out(record, runner.store)
            tracker.end(record)
            raise
    record.state, record.finished = "completed", _now()
    record.save(runner.store)
    tracker.end(record)
    return results


def _save_on_the_way_out(record: RunRecord, store: Store) -> None:
    """Save the final state even when a second Ctrl-C lands during the save."""
    for _ in range(3):
        try:
            record.save(store)
            return
        except KeyboardInterrupt:
            continue
        except Exception as e:
            log.warning("run %s: final state %s not saved: %s", record.id, record.state, e)
            return


@contextlib.contextmanager
def _own_thread_count():
    """A stage may set torch's thread count for itself (rl-reasoning's `threads: 1`); the stages
    after it in the same process get the count they would have had alone."""
    import torch

    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
