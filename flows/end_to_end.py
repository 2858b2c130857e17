"""The whole pipeline as one Prefect flow, and a flow that runs (or resumes) one stage."""
from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.states import Cancelled

from glmforge.config import check_preemptions, load_config, pipeline_model
from glmforge.pipeline import get_stage, iterations, stages_for, stages_until
from runtime.runner import Runner, RunRecord, execute
from runtime import shutdown
from runtime.shutdown import CancelledByUser, Preempted
from tasks.report import publish_run_report
from tasks.stage_task import run_in_prefect
from tasks.store import configured_store


def _remember_prefects_sigterm() -> None:
    """Prefect's flow engine swaps in its own SIGTERM handler, which raises TerminationSignal in
    whatever frame is running; raised inside a weakref callback or a __del__, Python prints and
    drops it, and the run would carry on as if never asked to stop. Its handler, wrapped, first
    tells runtime.shutdown (note), so the runner stops before the next stage and the command
    exits 128+signal. Prefect looks its handler up by this module attribute, so the wrapper is the
    handler it installs and recognises."""
    from prefect.exceptions import TerminationSignal
    from prefect.utilities import engine

    if getattr(engine._prefect_sigterm_handler, "glmforge", False):
        return

    def handler(sig_num: int, *args: object):
        shutdown.note(sig_num)
        raise TerminationSignal(signal=sig_num)

    handler.glmforge = True
    engine._prefect_sigterm_handler = handler


_remember_prefects_sigterm()


def _source(preset, config_file, overrides, until=None) -> dict[str, Any]:
    return {"preset": preset, "config_file": config_file, "overrides": list(overrides or []), "until": until}


@flow(name="glmforge-pipeline", log_prints=True)
def pipeline(
    preset: str | None = "tiny",
    config_file: str | None = None,
    overrides: list[str] | None = None,
    store: str | None = None,
    until: str | None = None,
    preemptions: int = 0,
) -> dict[str, Any]:
    """Run every stage (or those `until` needs) in order; published stages are skipped.
    `preemptions`: how many preempted runs this one continues (deployments/automations.yaml)."""
    cfg = load_config(None if config_file else preset, config_file, overrides)
    check_preemptions(preemptions, cfg.tasks)
    specs = stages_until(until, iterations(cfg))
    runner = Runner(cfg, configured_store(cfg.store, store), stages_for(iterations(cfg)))
    record = RunRecord.new(cfg, _source(preset, config_file, overrides, until), [s.name for s in specs])
    try:
        execute(runner, specs, record, run_one=lambda spec, parents: run_in_prefect(spec, cfg.tasks, runner, parents))
    except CancelledByUser as e:
        return _cancelled(e)
    except Preempted:
        raise  # the pod is being stopped: its grace period is the checkpoint's, not a report's
    except Exception:
        publish_run_report(runner.store, record)  # a failed run's page says where and how to resume
        raise
    publish_run_report(runner.store, record)
    return record.public()


@flow(name="glmforge-stage", log_prints=True)
def stage(
    stage: str,
    preset: str | None = "tiny",
    config_file: str | None = None,
    overrides: list[str] | None = None,
    store: str | None = None,
    run_id: str | None = None,
    preemptions: int = 0,
) -> dict[str, Any]:
    """Run one stage from its last checkpoint, reusing the published artifacts upstream.

    With `run_id`, the config comes from that run's record and the record is updated, so
    `glmforge status` shows the resumed stage in the run it belongs to."""
    get_stage(stage)
    given = load_config(None if config_file else preset, config_file, overrides)
    check_preemptions(preemptions, given.tasks)
    st = configured_store(given.store, store)
    if run_id:
        record = RunRecord.load(st, run_id)
        if record is None:
            raise ValueError(f"no run record {run_id!r} in {st.uri}")
        cfg = pipeline_model().model_validate(record.config)
    else:
        cfg = given
        record = RunRecord.new(cfg, _source(preset, config_file, overrides, stage), [stage])
    spec = get_stage(stage, iterations(cfg))
    runner = Runner(cfg, st, stages_for(iterations(cfg)))
    record.state = "running"
    try:
        execute(runner, [spec], record, run_one=lambda s, parents: run_in_prefect(s, cfg.tasks, runner, parents))
    except CancelledByUser as e:
        return _cancelled(e)
    return record.public()


def _cancelled(e: CancelledByUser):
    """A user's cancel ends the run Cancelled (never rerun) and reads as one (tasks.stage_task's
    CancelIsNotAnError keeps Prefect's own lines about it at INFO)."""
    return Cancelled(message=str(e))
