"""The one stage interface every pipeline step implements.

A stage is a plain function in library code:

    def run(cfg: SectionConfig, inputs: dict[str, Path], workdir: Workdir) -> dict:
        ...write files under workdir.out, keep resumable state under workdir.checkpoint...
        return {"documents": 123, ...}          # metrics, JSON-serialisable

- `cfg` is the stage's own (pydantic, frozen) config section, already validated.
- `inputs` maps a parent stage name to the local directory holding that parent's published
  artifact (already fetched from the store and digest-verified). A stage of a later round of the
  post-training loop (`sft@2`, glmforge.pipeline) is the same function on other parents: its
  inputs are keyed by their base names (`inputs["sft"]` is `sft@2`'s artifact in round 2).
- everything written under `workdir.out` is published atomically as the stage's artifact.
- `workdir.checkpoint` survives a crash: a retried or resumed stage finds there what the killed
  attempt left, and must continue from it so the result is identical to an uninterrupted run.
- `workdir.progress(done, total, desc)` reports progress on long loops (tasks/ turns it into a
  Prefect progress artifact and a console bar; in unit tests it does nothing).

The runner (runtime.runner) computes the stage key, skips stages whose artifact exists, and
publishes. Library code never imports Prefect.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol


ProgressFn = Callable[[int, int, str], None]

# Marks a config field that changes how a stage runs but never what it writes (worker counts, a
# cluster address): `Field(..., json_schema_extra=OPERATIONAL)`. The runner leaves such fields
# out of the stage key (runtime.runner.key_config), so the same artifact is reused whichever
# way it was produced; the manifest and run record still show them.
OPERATIONAL: dict[str, Any] = {"operational": True}


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
    seed: int | None = 0

    @classmethod
    def at(cls, root: Path, **kw: Any) -> "Workdir":
        """A workdir under `root` (out/ and checkpoint/), created if missing. For tests and tools."""
        out, ckpt = Path(root) / "out", Path(root) / "checkpoint"
        out.mkdir(parents=True, exist_ok=True)
        ckpt.mkdir(parents=True, exist_ok=True)
        return cls(out=out, checkpoint=ckpt, **kw)


    def sub(self, out: Path, checkpoint: Path) -> "Workdir":
        """A workdir for one part of a stage (a baseline run), reporting and persisting
        through this one; its folders are created."""
        out.mkdir(parents=True, exist_ok=True)
        checkpoint.mkdir(parents=True, exist_ok=True)
        return Workdir(out=out, checkpoint=checkpoint, progress=self.progress,
                       persist_checkpoint=self.persist_checkpoint, seed=self.seed)


def base_name(name: str) -> str:
    """The stage a round's copy runs: "rl-reasoning@2" -> "rl-reasoning"."""
    return name.partition("@")[0]


class StageFn(Protocol):
    def __call__(self, cfg: Any, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]: ...


def resolve(ref: Any) -> Any:
    """"package.module:attribute" -> the attribute (imported now); anything else as is."""
    if not isinstance(ref, str):
        return ref
    module, sep, attr = ref.partition(":")
    if not sep:
        raise ValueError(f"{ref!r} is not a 'module:attribute' reference")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class StageSpec:
    """A pipeline stage as the runner sees it. The registry (glmforge.pipeline) declares these.

    `config` and `run` may be "module:attribute" references: a stage whose code imports torch is
    then imported only when its config is validated or it runs, so commands that only read the
    store (`status`, `artifacts`) never load the training stack."""

    name: str                       # "dedup-minhash": CLI and Prefect name
    section: str                    # "dedup_minhash": attribute of the pipeline config
    config: type | str              # pydantic model of the section (or a reference to it)
    runner: StageFn | str           # the stage function (or a reference to it)
    parents: tuple[str, ...] = ()   # names of the stages whose artifacts are `inputs`
    version: str = "1"              # bump when the stage's output for the same inputs changes
    # Stages that read files that are not artifacts (raw data, eval sets, label files): a
    # fingerprint of them (content digests, or ETags) joins the key so edits are not served
    # from cache.
    fingerprint: Callable[[Any], str] | str | None = None
    # Whether the stage reads the run seed (workdir.seed): training and RL stages do; curation
    # stages take their seeds from their own sections, so run.seed stays out of their keys and
    # their workdir.seed is None.
    seeded: bool = True
    # GPUs the stage takes on its node (runtime.gpus): None counts its ranks
    # (launch.nproc_per_node); stages that start servers name a function of their section.
    gpus: Callable[[Any], int] | str | None = None

    @property
    def config_cls(self) -> type:
        return resolve(self.config)

    @property
    def run(self) -> StageFn:
        return resolve(self.runner)

    @property
    def fingerprint_fn(self) -> Callable[[Any], str] | None:
        return resolve(self.fingerprint)


def upstream(stages: list[StageSpec], name: str) -> list[StageSpec]:
    """The stage `name` and everything it depends on, in the order of `stages`."""
    by_name = {s.name: s for s in stages}
    need, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n not in by_name:
            raise ValueError(f"unknown stage {n!r}; stages: {', '.join(by_name)}")
        if n not in need:
            need.add(n)
            todo.extend(by_name[n].parents)
    return [s for s in stages if s.name in need]
