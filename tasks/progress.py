"""Progress of long stage loops: a Prefect progress artifact plus a console bar."""
from __future__ import annotations

import re
import sys
import time

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from tqdm import tqdm


def artifact_key(stage: str, what: str) -> str:
    """A Prefect artifact key for a stage: lowercase letters, digits and dashes only (Prefect
    refuses others), so round stages' "sft@2" becomes "sft-2"."""
    return re.sub(r"[^a-z0-9]+", "-", f"{stage}-{what}".lower()).strip("-")


class StageProgress:
    """Callable(done, total, desc) handed to a stage as workdir.progress.

    total == 0 means "unknown": the bar counts without a percentage and the Prefect artifact is
    left alone. Updates are throttled so a tight loop does not flood the API."""

    def __init__(self, stage: str, min_interval: float = 1.0):
        self.stage, self.min_interval = stage, min_interval
        self.bar: tqdm | None = None
        self.artifact_id = None
        self.last = 0.0

    def __call__(self, done: int, total: int, desc: str) -> None:
        if self.bar is None:
            self.bar = tqdm(total=total or None, desc=desc, file=sys.stderr, leave=False, mininterval=self.min_interval)
        self.bar.set_description(desc, refresh=False)
        if total and self.bar.total != total:
            self.bar.total = total
        self.bar.update(done - self.bar.n)
        now = time.monotonic()
        if total and (now - self.last >= self.min_interval or done >= total):
            self.last = now
            pct = min(100.0, 100.0 * done / total)
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(
                    progress=pct, key=artifact_key(self.stage, "progress"), description=f"{self.stage}: {desc}"
                )
            else:
                update_progress_artifact(self.artifact_id, progress=pct)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
