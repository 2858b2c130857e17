"""Exact and MinHash dedup fanned out over a Dask cluster as Prefect tasks.

The shard-level functions of data_processing.sharded_dedup become Prefect tasks run on
prefect-dask's DaskTaskRunner: a LocalCluster on this machine by default, or the scheduler at
`DaskConfig.address` for a real cluster. Each task handles `shards_per_task` input shards (and
every other step is cut into as many tasks), so small shards do not drown in per-task overhead.
The steps meet only through files in `scratch` (shared storage on a real cluster), so any worker
can run any task and a retried task rewrites its own files. Output equals dedup_exact.run /
minhash.run.

The pipeline's dedup-exact / dedup-minhash stages run here when their config section has a
`dask:` entry (tasks.stage_task passes `stage_runner(step)` to the runner in place of the stage
function; the stage key is the same, the section being operational).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect_dask import DaskTaskRunner

from data_processing import sharded_dedup as sd
from data_processing.common import DaskConfig
from data_processing.filtering import REMOVED_DIR, count_metrics
from data_processing.minhash import MinHashConfig
from runtime.stage import StageFn, Workdir

DaskSettings = DaskConfig  # the name this module had before the config section existed
STEPS = ("dedup-exact", "dedup-minhash")


def _api_env() -> dict[str, str]:
    """PREFECT_API_URL of the API this process reports to, for the LocalCluster's worker
    processes. Without it, in Prefect's ephemeral mode (no PREFECT_API_URL), every worker process
    starts an ephemeral server of its own: seconds each, most of a small run's time."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {"PREFECT_API_URL": str(client.api_url).rstrip("/")}


def task_runner(settings: DaskConfig) -> DaskTaskRunner:
    """A remote cluster's workers report to the PREFECT_API_URL of their own environment."""
    if settings.address:
        return DaskTaskRunner(address=settings.address)
    kwargs: dict[str, Any] = {
        "n_workers": settings.workers,
        "threads_per_worker": settings.threads_per_worker,
        "processes": settings.processes,
        "dashboard_address": None,  # no fixed port: several clusters may share a machine
    }
    if settings.processes:
        kwargs["env"] = _api_env()
    return DaskTaskRunner(cluster_kwargs=kwargs)


def _apply(fn: Callable[..., Any], items: Sequence[tuple], common: tuple) -> list:
    return [fn(*item, *common) for item in items]


def _batch_task(fn: Callable[..., Any], name: str):
    """A task running fn(*item, *common) for each item of a batch: one task, many shards."""

    def run(items: list[tuple], common: tuple) -> list:
        return _apply(fn, items, common)

    run.__qualname__ = run.__name__ = f"{fn.__name__}_batch"
    # The scratch files are the checkpoint; Prefect's result cache would only copy them.
    return task(run, name=name, cache_policy=NO_CACHE, persist_result=False, retries=1)


def _single_task(fn: Callable[..., Any], name: str):
    return task(fn, name=name, cache_policy=NO_CACHE, persist_result=False, retries=1)


exact_partition = _single_task(sd.exact_partition_shards, "exact-partition")
exact_reduce = _batch_task(sd.exact_reduce, "exact-reduce")
minhash_shard = _batch_task(sd.minhash_shard, "minhash-signatures")
minhash_band = _batch_task(sd.minhash_band, "minhash-band")
minhash_split_pairs = _single_task(sd.minhash_split_pairs, "minhash-split-pairs")
minhash_verify = _batch_task(sd.minhash_verify, "minhash-verify")
minhash_cluster = _single_task(sd.minhash_cluster, "minhash-cluster")
filter_shard = _batch_task(sd.filter_shard, "filter-shard")
assemble_shard = _batch_task(sd.assemble_shard, "assemble-shard")


def split(items: Sequence, tasks: int) -> list[list]:
    """`items` in `tasks` consecutive groups as even as can be (fewer when items are fewer)."""
    tasks = max(1, min(tasks, len(items)))
    q, r = divmod(len(items), tasks)
    out, start = [], 0
    for t in range(tasks):
        n = q + (t < r)
        out.append(list(items[start:start + n]))
        start += n
    return out


def _flat(batched_results) -> list:
    return [x for f in batched_results for x in f.result()]


def _write_outputs(sp: sd.ShardPlan, step: str, shard_size: int, scratch: str, out: str, tasks: int) -> dict:
    shard_items = [(s, i, o) for i, (s, o) in enumerate(zip(sp.shards, sp.offsets))]
    counts = _flat(filter_shard.map(split(shard_items, tasks), unmapped((step, scratch))))
    jobs = []
    for kind in ("kept", "removed"):
        c = [x[kind] for x in counts]
        n_out = -(-sum(c) // shard_size)
        groups = split([(k,) for k in range(n_out)], tasks)
        if groups[0]:
            jobs.append(assemble_shard.map(groups, unmapped((kind, c, shard_size, scratch, out))))
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
    shards_per_task: int = 1,
) -> dict:
    """One dedup step over every shard of `input_dir`; writes out_dir like the single-process
    step and returns the same metrics. Every step runs as about ceil(shards / shards_per_task)
    tasks (bands: at most one per band)."""
    sp = sd.plan(input_dir)
    shard_items = [(s, i, o) for i, (s, o) in enumerate(zip(sp.shards, sp.offsets))]
    batches = split(shard_items, -(-len(shard_items) // shards_per_task))
    tasks = len(batches)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if step == "dedup-exact":
        p = partitions or tasks
        exact_partition.map(batches, unmapped(p), unmapped(scratch)).result()
        firsts = [b[0][1] for b in batches]
        exact_reduce.map(split([(k,) for k in range(p)], tasks), unmapped((firsts, sp, scratch))).result()
        return _write_outputs(sp, step, shard_size, scratch, out_dir, tasks)
    cfg = minhash or MinHashConfig()
    minhash_shard.map(batches, unmapped((cfg, scratch))).result()
    minhash_band.map(split([(b,) for b in range(cfg.bands)], tasks), unmapped((len(sp.shards), scratch))).result()
    candidates = minhash_split_pairs(cfg.bands, sp, scratch)
    minhash_verify.map(split([(i,) for i in range(len(sp.shards))], tasks),
                       unmapped((sp, cfg.verify_threshold, scratch))).result()
    stats = minhash_cluster(sp, scratch)
    metrics = _write_outputs(sp, step, shard_size, scratch, out_dir, tasks)
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
    settings: DaskConfig | None = None,
    shard_size: int = 10_000,
    minhash: MinHashConfig | None = None,
) -> dict:
    """Run `dedup_dask` on the Dask cluster `settings` describes."""
    settings = settings or DaskConfig()
    f = dedup_dask.with_options(task_runner=task_runner(settings))
    return f(step, str(input_dir), str(out_dir), str(scratch), shard_size, minhash, settings.partitions,
             settings.shards_per_task)


def stage_runner(step: str) -> StageFn:
    """The stage function of `step` (dedup-exact / dedup-minhash) on Dask: the same signature,
    files and metrics as dedup_exact.run / minhash.run, settings from the section's `dask`.
    Scratch files live in the stage's checkpoint folder and go when the step is done; a retried
    attempt starts them over."""
    if step not in STEPS:
        raise ValueError(f"{step}: no Dask path; stages with one: {', '.join(STEPS)}")

    def run(cfg: Any, inputs: dict[str, Path], workdir: Workdir) -> dict:
        (parent,) = inputs.values()
        scratch = workdir.checkpoint / "dask"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        workdir.progress(0, 1, f"{step} on dask")
        metrics = run_dedup(step, parent, workdir.out, scratch, cfg.dask, cfg.shard_size,
                            cfg if step == "dedup-minhash" else None)
        (workdir.out / REMOVED_DIR).mkdir(exist_ok=True)  # write_decisions creates it even when empty
        shutil.rmtree(scratch, ignore_errors=True)
        workdir.progress(1, 1, f"{step} on dask")
        return metrics

    return run
