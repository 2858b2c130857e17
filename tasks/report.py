"""The run's report page (glmforge.report) as a Prefect artifact at the end of a pipeline run."""
from __future__ import annotations

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from glmforge.report import summary_markdown, write_report
from runtime.runner import RunRecord
from runtime.store import Store
from runtime.tracking import log_report


def publish_run_report(store: Store, record: RunRecord) -> None:
    """Write the page into $GLMFORGE_HOME/reports and link it from a markdown artifact (its path
    and a summary of the stages). A page that cannot be written is logged, never fails the run:
    the run's own state is what the flow reports."""
    logger = get_run_logger()
    try:
        path = write_report(store, record)
        create_markdown_artifact(key="run-report", markdown=summary_markdown(record, path),
                                 description=f"glmforge report of run {record.id}")
    except Exception as e:
        logger.warning("run %s: report not written: %s: %s", record.id, type(e).__name__, e)
        return
    logger.info("run %s: report %s", record.id, path)
    log_report(record, path)
