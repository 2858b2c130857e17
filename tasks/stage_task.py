"""One Prefect task per pipeline stage, all built the same way from the stage registry.

A per-stage module would repeat these lines once per stage; the StageSpec already says
everything that differs (name, section, version), so one factory serves them all."""
from __future__ import annotations

import base64
import contextlib
import json
import logging
from typing import Any, ContextManager

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency
from prefect.exceptions import CancelledRun, TerminationSignal
from prefect.states import Cancelled, Completed

from glmforge.config import RetryConfig
from runtime.gpus import CONCURRENCY_LIMIT, stage_gpus, visible_gpus
from runtime.runner import Runner, StageResult
from runtime.shutdown import CancelledByUser, Preempted
from runtime.stage import StageFn, StageSpec
from runtime.store import Manifest, artifact_prefix
from tasks.progress import StageProgress, artifact_key


def _flatten(metrics: dict[str, Any], prefix: str = "") -> list[dict[str, str]]:
    rows = []
    for k, v in metrics.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            rows.extend(_flatten(v, name + "."))
        else:
            rows.append({"metric": name, "value": json.dumps(v) if isinstance(v, (list, dict)) else str(v)})
    return rows


def publish_prefect_artifacts(runner: Runner, result: StageResult) -> None:
    """Metrics as a table artifact, and any PNG the stage wrote as a markdown image."""
    m: Manifest = result.manifest
    create_table_artifact(
        key=artifact_key(result.name, "metrics"),
        table=_flatten(m.metrics) or [{"metric": "(none)", "value": ""}],
        description=f"{result.name} ({result.state}) — {result.artifact}",
    )
    base = f"{artifact_prefix(m.stage, m.key)}/{m.data_prefix}"
    for f in m.files:
        if f.path.endswith(".png") and f.size < 2_000_000:
            data = base64.b64encode(runner.store.get_bytes(f"{base}/{f.path}")).decode()
            # the whole path: dsa-adapt writes loss.png, full/loss.png and swa/loss.png
            slug = f.path[:-4]
            create_markdown_artifact(
                key=artifact_key(result.name, slug),
                markdown=f"### {result.name}: {f.path}\n\n![{f.path}](data:image/png;base64,{data})",
            )


class CancelIsNotAnError(logging.Filter):
    """A user's cancel is not an error, but Prefect's engines log it as one: every final state but
    Completed at ERROR ("Finished in state Cancelled"), and a flow run that returned Cancelled
    under a worker as "Engine execution exited with unexpected exception" with the CancelledRun
    traceback. Both are logged at INFO, the second as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        error = record.exc_info[1] if record.exc_info else None
        if str(record.msg).startswith("Finished in state Cancelled"):
            record.levelno, record.levelname = logging.INFO, "INFO"
        elif isinstance(error, CancelledRun):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args, record.exc_info, record.exc_text = "Flow run ended Cancelled.", None, None, None
        return True


for _name in ("prefect.task_runs", "prefect.flow_runs"):
    logging.getLogger(_name).addFilter(CancelIsNotAnError())


def _retry_unless_preempted(task, task_run, state) -> bool:
    """A preempted stage is not retried in this process (it is being shut down: a pod eviction,
    `docker stop`); it ends Failed with a "Preempted" message, and the rerun (the automation of
    deployments/automations.yaml, or `glmforge resume`) continues from the checkpoint it wrote."""
    data = getattr(state, "data", None)
    return not isinstance(data, Preempted) and "Preempted" not in (state.message or "")


def engine(spec: StageSpec, section: Any) -> StageFn | None:
    """The stage function to run in place of spec.run, or None for spec.run itself: the Dask
    path of a stage whose section has a `dask:` entry (tasks/dask_dedup.py for the dedup stages,
    tasks/dask_swe.py for swe-envs). Same files and metrics, same key (the entry is operational)."""
    if getattr(section, "dask", None) is None:
        return None
    if spec.name == "swe-envs":
        from tasks.dask_swe import stage_runner as swe_runner  # prefect-dask and dask, only when asked for

        return swe_runner()
    from tasks.dask_dedup import STEPS, stage_runner

    return stage_runner(spec.name) if spec.name in STEPS else None


def gpus_to_hold(spec: StageSpec, runner: Runner, parents: dict[str, Manifest]) -> int:
    """The slots of `glmforge-gpus` a stage holds: its GPUs on a machine that has GPUs, none for
    a stage whose artifact is already published (it will not run)."""
    if not visible_gpus() or runner.store.manifest(spec.name, runner.key(spec, parents)) is not None:
        return 0
    return stage_gpus(spec, runner.section(spec))


def gpu_slots(n: int) -> ContextManager:
    """n slots of the global concurrency limit `glmforge-gpus` (created by `glmforge serve`, or
    `prefect gcl create glmforge-gpus --limit N` for a cluster's N GPUs) while the block runs;
    waits while they are taken. The slots are leased: a run whose machine died gives them back
    when its lease lapses."""
    return concurrency(CONCURRENCY_LIMIT, occupy=n) if n > 0 else contextlib.nullcontext()


def stage_task(spec: StageSpec, settings: RetryConfig):
    """The Prefect task that runs `spec`: retries from config, our own store-level cache."""

    @task(
        name=spec.name,
        retries=settings.retries,
        retry_delay_seconds=settings.retry_delay_seconds,
        retry_condition_fn=_retry_unless_preempted,
        cache_policy=NO_CACHE,  # the artifact store is the cache (see runtime.runner)
        persist_result=False,
    )
    def run(runner: Runner, parents: dict[str, Manifest]):
        logger = get_run_logger()
        progress = StageProgress(spec.name)
        try:
            with gpu_slots(gpus_to_hold(spec, runner, parents)):
                result = runner.run_stage(spec, parents, progress=progress, run=engine(spec, runner.section(spec)))
        except (Preempted, KeyboardInterrupt, TerminationSignal):
            if not cancel_requested():
                raise                    # a preemption: Failed, and the automation reruns it
            message = cancelled_message(spec.name)
            logger.info(message)
            return Cancelled(message=message)
        finally:
            progress.close()
        publish_prefect_artifacts(runner, result)
        if result.state == "cached":
            logger.info("%s: cached, reusing %s", spec.name, result.artifact)
            return Completed(data=result, name="Cached", message=f"artifact {result.key} reused")
        logger.info("%s: published %s %s", spec.name, result.artifact, result.manifest.metrics)
        return result

    return run


def cancel_intent() -> bool:
    """Whether the worker that runs this flow run said, before its SIGTERM, that the SIGTERM is a
    cancel (Prefect's control channel between a worker and its flow-run process)."""
    try:
        from prefect._internal.control_listener import get_intent
    except ImportError:                  # a Prefect without the control channel
        return False
    return get_intent() == "cancel"


def cancel_requested() -> bool:
    """Whether this flow run is being cancelled by a user (the worker's cancel intent, or the run
    Cancelling or Cancelled in Prefect): the stop that just arrived is that cancel, not a
    preemption."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.runtime import flow_run

    if cancel_intent():
        return True
    if not flow_run.id:
        return False
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run.id).state
    except Exception:                    # no answer: treat the stop as a preemption (the safe side)
        return False
    return state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)


def cancelled_message(stage: str) -> str:
    return (f"Cancelled by the user: {stage} stopped, its last checkpoint kept; "
            f"`glmforge resume {stage}` continues it")


def run_in_prefect(spec: StageSpec, settings: RetryConfig, runner: Runner, parents: dict[str, Manifest]) -> StageResult:
    """Run a stage as its Prefect task and return its StageResult (raising its error if it failed;
    CancelledByUser when a user cancelled the run).

    The task may finish as a custom "Cached" state; calling it with return_state and reading
    the state's result gives the StageResult either way."""
    state = stage_task(spec, settings)(runner, parents, return_state=True)
    if state.is_cancelled():
        raise CancelledByUser(state.message or cancelled_message(spec.name))
    return state.result()
