"""A run whose every stage is already published, recorded without starting Prefect.

Starting Prefect (its import, an ephemeral server, a flow run) costs most of the ~15 s of a
fully cached `glmforge run`. The store alone decides whether a stage would be skipped: its key
comes from the config and the parents' manifests (runtime.runner.stage_key), so the keys of
the whole chain can be computed before Prefect starts. When every one is published the run is
recorded with every stage "cached" — the same record the flow would have written."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from glmforge.pipeline import iterations, stages_for
from runtime.runner import Runner, RunRecord, StageResult, _now
from runtime.stage import StageSpec
from runtime.store import Manifest, Store


def published_chain(runner: Runner, specs: list[StageSpec]) -> list[StageResult] | None:
    """Every stage of `specs` (in order, parents first) as a cached result, or None as soon as
    one has no published artifact for this config."""
    found: dict[str, Manifest] = {}
    results = []
    for spec in specs:
        parents = {p: found[p] for p in spec.parents}
        key = runner.key(spec, parents)
        m = runner.store.manifest(spec.name, key)
        if m is None:
            return None
        found[spec.name] = m
        results.append(StageResult(spec.name, key, "cached", m, runner.store.artifact_uri(spec.name, key)))
    return results


def record_if_cached(cfg: BaseModel, store: Store, specs: list[StageSpec], source: dict[str, Any]) -> RunRecord | None:
    """Record a completed run of `specs` when all are published; None (nothing written) otherwise."""
    runner = Runner(cfg, store, stages_for(iterations(cfg)))
    results = published_chain(runner, specs)
    if results is None:
        return None
    record = RunRecord.new(cfg, source, [s.name for s in specs])
    for res in results:
        record.mark(res)
    record.state, record.finished = "completed", _now()
    record.save(store)
    return record
