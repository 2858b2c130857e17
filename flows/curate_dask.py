"""Exact and MinHash dedup fanned out over a Dask cluster as Prefect tasks.

Each shard-level function of data_processing.sharded_dedup becomes one Prefect task per input
shard (or band, or partition), run on prefect-dask's DaskTaskRunner: a LocalCluster on this
machine by default, or the scheduler at `DaskSettings.address` for a real cluster. The steps
meet only through files in `scratch` (shared storage on a real cluster), so any worker can run
any task and a retried task rewrites its own files. Output equals dedup_exact.run / minhash.run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect_dask import DaskTaskRunner
from pydantic import BaseModel, Field

from data_processing import sharded_dedup as sd
from data_processing.filtering import count_metrics
from data_processing.minhash import MinHashConfig


class DaskSettings(BaseModel):
    """Where the tasks run. `address` set: an existing cluster (tcp://scheduler:8786), the other
    fields ignored. Unset: a LocalCluster of `workers` workers started for the flow."""

    address: str | None = None
    workers: int = Field(default=2, ge=1)
    threads_per_worker: int = Field(default=1, ge=1)
    processes: bool = True  # False: worker threads in this process (fast start, for tests)
    partitions: int = Field(default=0, ge=0, description="exact-dedup shuffle partitions; 0 = one per input shard")


def task_runner(settings: DaskSettings) -> DaskTaskRunner:
    if settings.address:
        return DaskTaskRunner(address=settings.address)
    return DaskTaskRunner(
        cluster_kwargs={
            "n_workers": settings.workers,
            "threads_per_worker": settings.threads_per_worker,
            "processes": settings.processes,
            "dashboard_address": None,  # no fixed port: several clusters may share a machine
        }
    )


def _task(fn, name: str):
    # The scratch files are the checkpoint; Prefect's result cache would only copy them.
    return task(fn, name=name, cache_policy=NO_CACHE, persist_result=False, retries=1)


exact_partition = _task(sd.exact_partition, "exact-partition")
exact_reduce = _task(sd.exact_reduce, "exact-reduce")
minhash_shard = _task(sd.minhash_shard, "minhash-signatures")
minhash_band = _task(sd.minhash_band, "minhash-band")
minhash_split_pairs = _task(sd.minhash_split_pairs, "minhash-split-pairs")
minhash_verify = _task(sd.minhash_verify, "minhash-verify")
minhash_cluster = _task(sd.minhash_cluster, "minhash-cluster")
filter_shard = _task(sd.filter_shard, "filter-shard")
assemble_shard = _task(sd.assemble_shard, "assemble-shard")


def _write_outputs(sp: sd.ShardPlan, step: str, shard_size: int, scratch: str, out: str) -> dict:
    idx = list(range(len(sp.shards)))
    counts = filter_shard.map(sp.shards, idx, list(sp.offsets), unmapped(step), unmapped(scratch)).result()
    jobs = []
    for kind in ("kept", "removed"):
        c = [x[kind] for x in counts]
        n_out = -(-sum(c) // shard_size)
        jobs.append(assemble_shard.map(list(range(n_out)), unmapped(kind), unmapped(c), unmapped(shard_size),
                                       unmapped(scratch), unmapped(out)))
    for j in jobs:
        j.result()
    return count_metrics(sp.total, sum(x["kept"] for x in counts))


@flow(name="curate-dedup-dask")
def dedup_dask(
    step: Literal["dedup-exact", "dedup-minhash"],
    input_dir: str,
    out_dir: str,
    scratch: str,
    shard_size: int = 10_000,
    minhash: MinHashConfig | None = None,
    partitions: int = 0,
) -> dict:
    """One dedup step over every shard of `input_dir`; writes out_dir like the single-process
    step and returns the same metrics."""
    sp = sd.plan(input_dir)
    idx = list(range(len(sp.shards)))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if step == "dedup-exact":
        p = partitions or len(sp.shards)
        exact_partition.map(sp.shards, idx, list(sp.offsets), unmapped(p), unmapped(scratch)).result()
        exact_reduce.map(list(range(p)), unmapped(len(sp.shards)), unmapped(sp), unmapped(scratch)).result()
        return _write_outputs(sp, step, shard_size, scratch, out_dir)
    cfg = minhash or MinHashConfig()
    minhash_shard.map(sp.shards, idx, list(sp.offsets), unmapped(cfg), unmapped(scratch)).result()
    minhash_band.map(list(range(cfg.bands)), unmapped(len(sp.shards)), unmapped(scratch)).result()
    candidates = minhash_split_pairs(cfg.bands, sp, scratch)
    minhash_verify.map(idx, unmapped(sp), unmapped(cfg.verify_threshold), unmapped(scratch)).result()
    stats = minhash_cluster(sp, scratch)
    metrics = _write_outputs(sp, step, shard_size, scratch, out_dir)
    return {
        **metrics,
        "clusters": stats["clusters"],
        "largest_cluster": stats["largest_cluster"],
        "candidate_pairs": candidates,
        "verified_pairs": stats["verified_pairs"],
        "num_perm": cfg.num_perm,
        "bands": cfg.bands,
        "rows": cfg.rows,
    }


def run_dedup(
    step: Literal["dedup-exact", "dedup-minhash"],
    input_dir: Path | str,
    out_dir: Path | str,
    scratch: Path | str,
    settings: DaskSettings | None = None,
    shard_size: int = 10_000,
    minhash: MinHashConfig | None = None,
) -> dict:
    """Run `dedup_dask` on the Dask cluster `settings` describes."""
    settings = settings or DaskSettings()
    f = dedup_dask.with_options(task_runner=task_runner(settings))
    return f(step, str(input_dir), str(out_dir), str(scratch), shard_size, minhash, settings.partitions)
