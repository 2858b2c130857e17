"""The swe-envs stage's sources built as Prefect tasks on Dask (the curation steps' engine).

One task per source (posttrain.swe_envs.build_one): its fetch, install, suite and instances, each
recorded in its folder as it goes, so a retried task, or the stage rerun after a kill, goes on
where the source stopped. Same files and metrics as the threaded build; the `dask:` entry is
operational and stays out of the stage key. On a real cluster the build folder (the stage's
checkpoint under $GLMFORGE_HOME) must be storage every worker mounts at the same path, and the
workers need the sandbox (bubblewrap) and uv.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from runtime.stage import StageFn, Workdir
from posttrain.swe_envs import SWEEnvsConfig, build_one, check_names
from posttrain.swe_envs import run as run_stage
from tasks.dask_dedup import task_runner

# the source's folder is the checkpoint; Prefect's result cache would only copy it
build_source = task(build_one, name="swe-envs-source", cache_policy=NO_CACHE, persist_result=False, retries=1)


@flow(name="swe-envs-dask")
def swe_envs_dask(cfg: SWEEnvsConfig, root: str, pairs_file: str | None = None) -> list[dict[str, Any]]:
    """Every source of `cfg` built under root/sources/<name>; the reports in config order."""
    futures = [build_source.with_options(name=f"swe-envs-{s.name}").submit(
                   s, Path(root), cfg.build, cfg.seed, Path(pairs_file) if pairs_file else None)
               for s in cfg.sources]
    return [f.result() for f in futures]


def stage_runner() -> StageFn:
    """swe-envs's stage function with its sources on the Dask cluster `cfg.dask` describes."""

    def build_sources(cfg: SWEEnvsConfig, root: Path, progress, pairs_file: Path | None) -> list[dict[str, Any]]:
        check_names(cfg)
        progress(0, len(cfg.sources), "swe-envs on dask")
        reports = swe_envs_dask.with_options(task_runner=task_runner(cfg.dask))(
            cfg, str(root), str(pairs_file) if pairs_file else None)
        progress(len(cfg.sources), len(cfg.sources), "swe-envs on dask")
        return reports

    def run(cfg: SWEEnvsConfig, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]:
        return run_stage(cfg, inputs, workdir, build_sources)

    return run
