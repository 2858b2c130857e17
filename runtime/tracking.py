"""Experiment tracking: a pipeline run as a parent run of the tracker, each stage a child run.

`tracking:` in the config picks the backend (`none`, the default, or `mlflow` with its URI).
`execute` (runtime.runner) calls the tracker at three points: the run starts (`begin`), a stage
ends (`stage`: done, cached or failed), the run ends (`end`). What a stage's child run holds is
read from its published artifact, so a stage run on another machine (a Prefect worker, a
cluster rank) is logged the same way:
- params: the stage's resolved config (flattened), its key, its parents' keys, the preset or
  config file, the git commit;
- metrics: every numeric field of the artifact's metrics.jsonl at its `step` (loss, lr, grad
  norm, tokens/s, RL rewards per domain, IcePop/IS masked shares, staleness, ...), and the
  stage's summary metrics (the manifest's) under `summary/`;
- artifacts: the artifact's plots (PNG) and Markdown files (gates.md), and the run report at the
  end; rollout samples (samples.jsonl) as a table.
A cached stage's child run links the run that produced its artifact (tag `glmforge.produced_by`)
instead of a second copy. Tracking never fails a stage: a tracker that does not answer is a
warning (one per stage) after a retry, and the pipeline goes on.

A second backend (W&B, Aim) is one more class with the four methods of `Tracker`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from runtime.store.manifest import artifact_prefix

log = logging.getLogger("glmforge")
REPO = Path(__file__).resolve().parent.parent


class TrackingConfig(BaseModel):
    """Where runs are tracked. Operational: never part of a stage's key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["none", "mlflow"] = Field("none", description=(
        "none: metrics.jsonl, TensorBoard, Prefect artifacts and the run report only; mlflow: also an MLflow "
        "tracking server (a parent run per pipeline run, a child run per stage)"))
    uri: str | None = Field(None, description=(
        "the MLflow tracking URI (http://host:5000); None: $MLFLOW_TRACKING_URI. Credentials go in "
        "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or _TOKEN), never in the URI"))
    experiment: str = Field("glmforge", min_length=1, description="the MLflow experiment the runs go to")
    timeout_s: float = Field(10.0, gt=0, description="seconds one request to the tracker may take")


def masked(uri: str) -> str:
    """The URI (a tracking server's, a database's) with any password in it replaced by ***."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()


def flatten(d: dict[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, name + sep, sep))
        else:
            out[name] = v
    return out


_NOT_IN_NAMES = re.compile(r"[^\w\-. :/]")


def mlflow_name(key: str) -> str:
    """A metric or param name MLflow takes: at most 250 characters of letters, digits, _ - . space
    : and /, anything else (a histogram bin's "(0,1/4]") as _."""
    return _NOT_IN_NAMES.sub("_", key)[:250]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


class Tracker:
    """What execute calls. The base class tracks nothing (`tracking.backend: none`)."""

    def begin(self, record: Any, runner: Any) -> dict[str, Any] | None:
        """Start tracking the run; what the run record keeps of it (RunRecord.tracking)."""
        return None

    def stage(self, spec: Any, result: Any, runner: Any, seconds: float | None) -> None: ...

    def stage_failed(self, spec: Any, error: BaseException, runner: Any) -> None: ...

    def end(self, record: Any) -> None: ...


def log_report(record: Any, report: Path) -> None:
    """Attach the run report to the run's tracker run, when the run was tracked."""
    tracked = record.tracking or {}
    if tracked.get("backend") == "mlflow":
        cfg = TrackingConfig(**(record.config.get("tracking") or {}))
        MLflowTracker(cfg).log_report(tracked["run_id"], report)


def open_tracker(cfg: TrackingConfig | None) -> Tracker:
    if cfg is None or cfg.backend == "none":
        return Tracker()
    return MLflowTracker(cfg)


class TrackerUnavailable(RuntimeError):
    """The tracking server did not answer when the run started (one line, before any stage)."""


def check_tracking(cfg: TrackingConfig) -> None:
    """Refuse, in one line, a tracking server that does not answer (before anything starts)."""
    if cfg.backend != "mlflow":
        return
    uri = cfg.uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise TrackerUnavailable("tracking.backend=mlflow needs tracking.uri (or $MLFLOW_TRACKING_URI)")
    if not uri.startswith(("http://", "https://")):
        return                              # a file store or a managed scheme: MLflow's client checks it
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=cfg.timeout_s) as r:
            if r.status == 200:
                return
            why = f"HTTP {r.status}"
    except OSError as e:
        why = str(getattr(e, "reason", e))
    raise TrackerUnavailable(f"tracking.uri {masked(uri)} does not answer ({why}): start the MLflow server "
                             "or set tracking.backend=none")


class MLflowTracker(Tracker):
    """MLflow through its REST client (mlflow-skinny's MlflowClient: no global state, so several
    runs in one process do not share an active run)."""

    def __init__(self, cfg: TrackingConfig):
        self.cfg = cfg
        self.uri = cfg.uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not self.uri:
            raise ValueError("tracking.backend=mlflow needs tracking.uri (or $MLFLOW_TRACKING_URI)")
        # one try per request: a tracker that is down costs the stage seconds, not MLflow's minutes of backoff
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(cfg.timeout_s)))
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        self.experiment_id: str | None = None
        self.parent: str | None = None

    # -- the calls execute makes ------------------------------------------------------------

    def begin(self, record: Any, runner: Any) -> dict[str, Any]:
        """Find or create the experiment and the run's parent run (a resumed run reuses its own).
        Raises TrackerUnavailable when the server does not answer: before any stage runs."""
        try:
            self.experiment_id = self._experiment()
            self.parent = self._find(f"tags.`glmforge.run_id` = '{record.id}' and tags.`glmforge.kind` = 'pipeline'")
        except Exception as e:
            raise TrackerUnavailable(f"tracking.uri {masked(self.uri)} does not answer: {type(e).__name__}: "
                                     f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
        if self.parent is None:
            source = record.source or {}
            tags = {"glmforge.run_id": record.id, "glmforge.kind": "pipeline", "mlflow.runName": f"glmforge {record.id}",
                    "glmforge.store": str(runner.store.uri)}
            commit = git_commit()
            if commit:
                tags["mlflow.source.git.commit"] = commit
            run = self.client.create_run(self.experiment_id, tags=tags, run_name=f"glmforge {record.id}")
            self.parent = run.info.run_id
            params = {"seed": getattr(runner.cfg.run, "seed", None),
                      **{f"source.{k}": v for k, v in flatten(source).items()}}
            self._log_batch(self.parent, params=params)
        else:
            self.client.set_terminated(self.parent, "RUNNING")
        link = f"{masked(self.uri).rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.parent}"
        log.info("tracking: MLflow run %s", link)
        return {"backend": "mlflow", "uri": masked(self.uri), "experiment_id": self.experiment_id,
                "run_id": self.parent, "link": link}

    def stage(self, spec: Any, result: Any, runner: Any, seconds: float | None) -> None:
        state = "cached" if result.state == "cached" else "done"
        run = self._safely(spec.name, lambda: self._child(spec.name, result.key, {"glmforge.state": state,
                                                                                "glmforge.artifact": result.artifact}))
        if run is None:
            return
        if self._safely(spec.name, lambda: self._fill(run, spec, result, runner, seconds)) is None:
            try:
                self.client.set_terminated(run, "FAILED")   # what was logged stays; the run says it is partial
            except Exception:
                pass

    def stage_failed(self, spec: Any, error: BaseException, runner: Any) -> None:
        def go() -> None:
            run = self._child(spec.name, None, {"glmforge.state": "failed"})
            self.client.set_tag(run, "glmforge.error", f"{type(error).__name__}: {error}"[:4000])
            self.client.set_terminated(run, "FAILED" if isinstance(error, Exception) else "KILLED")
        self._safely(spec.name, go)

    def end(self, record: Any) -> None:
        if self.parent is None:
            return
        status = {"completed": "FINISHED", "failed": "FAILED"}.get(record.state, "KILLED")
        self._safely("the run", lambda: self.client.set_terminated(self.parent, status))

    def log_report(self, run_id: str, report: Path) -> None:
        """The run report (glmforge.report's page) as an artifact of the parent run."""
        def go() -> None:
            self.client.log_artifact(run_id, str(report), "report")
            self.client.set_tag(run_id, "glmforge.report", str(report))
        self._safely("the run report", go)

    # -- pieces ------------------------------------------------------------------------------

    def _safely(self, what: str, fn: Callable[[], Any]) -> Any:
        """fn(), retried once; True for a fn that returns None. A tracker that still fails is one
        warning and None, never the stage's error."""
        for attempt in (1, 2):
            try:
                out = fn()
                return True if out is None else out
            except Exception as e:
                if attempt == 2:
                    log.warning("tracking: %s not logged to MLflow at %s (%s: %s); the pipeline goes on", what,
                                masked(self.uri), type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
                    return None
                time.sleep(1.0)
        return None

    def _experiment(self) -> str:
        found = self.client.get_experiment_by_name(self.cfg.experiment)
        if found is not None:
            return found.experiment_id
        return self.client.create_experiment(self.cfg.experiment)

    def _find(self, query: str) -> str | None:
        runs = self.client.search_runs([self.experiment_id], filter_string=query, max_results=1,
                                       order_by=["attributes.start_time DESC"])
        return runs[0].info.run_id if runs else None

    def _child(self, stage: str, key: str | None, tags: dict[str, str]) -> str:
        all_tags = {"mlflow.parentRunId": self.parent, "glmforge.kind": "stage", "glmforge.stage": stage, **tags}
        if key:
            all_tags["glmforge.key"] = key
        return self.client.create_run(self.experiment_id, tags=all_tags, run_name=stage).info.run_id

    def _fill(self, run: str, spec: Any, result: Any, runner: Any, seconds: float | None) -> None:
        m = result.manifest
        if result.state == "cached":
            produced = self._find(f"tags.`glmforge.stage` = '{spec.name}' and tags.`glmforge.key` = '{result.key}' "
                                  "and tags.`glmforge.state` = 'done'")
            self.client.set_tag(run, "glmforge.produced_by", produced or "unknown (not tracked)")
            self.client.set_terminated(run, "FINISHED")
            return
        params = {**{f"config.{k}": v for k, v in flatten(m.config).items()}, "key": result.key,
                  **{f"parent.{p}": k for p, k in m.parents.items()}, "stage_version": m.stage_version}
        summary = {f"summary/{k}": v for k, v in flatten(m.metrics, sep="/").items() if _number(v)}
        if seconds is not None:
            summary["summary/seconds"] = seconds
        self._log_batch(run, params=params, metrics=[(k, v, 0) for k, v in summary.items()])
        files = {f.path: f for f in m.files}
        base = f"{artifact_prefix(m.stage, m.key)}/{m.data_prefix}"
        if "metrics.jsonl" in files:
            self._log_steps(run, runner.store.get_bytes(f"{base}/metrics.jsonl").decode())
        with tempfile.TemporaryDirectory(prefix="glmforge-track-") as tmp:
            for path, f in files.items():
                if path.endswith((".png", ".md")) and f.size < 20_000_000:
                    local = Path(tmp) / path
                    local.parent.mkdir(parents=True, exist_ok=True)
                    local.write_bytes(runner.store.get_bytes(f"{base}/{path}"))
                    self.client.log_artifact(run, str(local), str(Path(path).parent) if "/" in path else None)
        for path in files:
            if Path(path).name == "samples.jsonl":
                self._log_samples(run, runner.store.get_bytes(f"{base}/{path}").decode(), path)
        self.client.set_terminated(run, "FINISHED")

    def _log_steps(self, run: str, text: str) -> None:
        """Every numeric field of each metrics.jsonl record, at the record's step."""
        now = int(time.time() * 1000)
        metrics = []
        for i, line in enumerate(text.splitlines()):
            try:
                rec = json.loads(line)
            except ValueError:
                continue                # a cut last line of a killed run: the rest is still logged
            step = rec.get("step", i)
            if not isinstance(step, int):
                continue
            for k, v in flatten(rec, sep="/").items():
                if k != "step" and _number(v):
                    metrics.append((k, v, step))
        self._log_batch(run, metrics=metrics, timestamp=now)

    def _log_samples(self, run: str, text: str, path: str) -> None:
        rows = []
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        if not rows:
            return
        columns = sorted({k for r in rows for k in r})
        table = {c: [r.get(c) if isinstance(r.get(c), (str, int, float, bool, type(None))) else json.dumps(r.get(c))
                     for r in rows] for c in columns}
        self.client.log_table(run, data=table, artifact_file=str(Path(path).with_suffix(".json")))

    def _log_batch(self, run: str, params: dict[str, Any] | None = None,
                   metrics: list[tuple[str, float, int]] | None = None, timestamp: int | None = None) -> None:
        """In MLflow's batch limits (100 params, 1000 metrics a call; values cut to its 6000 characters)."""
        from mlflow.entities import Metric, Param

        ps = [Param(mlflow_name(k), str(v)[:6000]) for k, v in (params or {}).items()]
        ts = timestamp or int(time.time() * 1000)
        ms = [Metric(mlflow_name(k), float(v), ts, int(s)) for k, v, s in (metrics or [])]
        for i in range(0, len(ps), 100):
            self.client.log_batch(run, params=ps[i:i + 100])
        for i in range(0, len(ms), 1000):
            self.client.log_batch(run, metrics=ms[i:i + 1000])
