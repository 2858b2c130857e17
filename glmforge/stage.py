"""The one stage interface every pipeline step implements.

A stage is a plain function in library code:

    def run(cfg: SectionConfig, inputs: dict[str, Path], workdir: Workdir) -> dict:
        ...write files under workdir.out, keep resumable state under workdir.checkpoint...
        return {"documents": 123, ...}          # metrics, JSON-serialisable

- `cfg` is the stage's own (pydantic, frozen) config section, already validated.
- `inputs` maps a parent stage name to the local directory holding that parent's published
  artifact (already fetched from the store and digest-verified).
- everything written under `workdir.out` is published atomically as the stage's artifact.
- `workdir.checkpoint` survives a crash: a retried or resumed stage finds there what the killed
  attempt left, and must continue from it so the result is identical to an uninterrupted run.
- `workdir.progress(done, total, desc)` reports progress on long loops (tasks/ turns it into a
  Prefect progress artifact and a console bar; in unit tests it does nothing).

The runner (glmforge.runner) computes the stage key, skips stages whose artifact exists, and
publishes. Library code never imports Prefect.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol


ProgressFn = Callable[[int, int, str], None]


def _no_progress(done: int, total: int, desc: str) -> None:
    return None


@dataclass
class Workdir:
    out: Path
    checkpoint: Path
    progress: ProgressFn = field(default=_no_progress)
    # Called after a stage writes a consistent checkpoint; mirrors it to the store when the
    # store is remote so another machine can resume. No-op for the local store.
    persist_checkpoint: Callable[[], None] = field(default=lambda: None)
    seed: int = 0

    @classmethod
    def at(cls, root: Path, **kw: Any) -> "Workdir":
        """A workdir under `root` (out/ and checkpoint/), created if missing. For tests and tools."""
        out, ckpt = Path(root) / "out", Path(root) / "checkpoint"
        out.mkdir(parents=True, exist_ok=True)
        ckpt.mkdir(parents=True, exist_ok=True)
        return cls(out=out, checkpoint=ckpt, **kw)


class StageFn(Protocol):
    def __call__(self, cfg: Any, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]: ...


@dataclass(frozen=True)
class StageSpec:
    """A pipeline stage as the runner sees it. Library packages export a list of these."""

    name: str                       # "dedup-minhash": CLI and Prefect name
    section: str                    # "dedup_minhash": attribute of the pipeline config
    config_cls: type                # pydantic model of the section
    run: StageFn
    parents: tuple[str, ...] = ()   # names of the stages whose artifacts are `inputs`
    version: str = "1"              # bump when the stage's output for the same inputs changes
    # Root stages read raw data that is not an artifact; a cheap fingerprint of it (file names,
    # sizes, mtimes or ETags) joins the key so edited raw data is not served from cache.
    fingerprint: Callable[[Any], str] | None = None
