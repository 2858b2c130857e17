"""Artifact references as users type them: `STAGE/KEY`, `STAGE` (its key in the latest run),
or a full artifact URI (`<store>/artifacts/STAGE/KEY`)."""
from __future__ import annotations

import os
from pathlib import Path

from runtime.runner import RunRecord
from runtime.store import Manifest, Store, default_home, open_store


def parse_uri(ref: str) -> tuple[str, str, str] | None:
    """`<store>/artifacts/STAGE/KEY` -> (store uri, stage, key); None for short references."""
    head, sep, tail = ref.rstrip("/").rpartition("/artifacts/")
    if not sep or tail.count("/") != 1:
        return None
    stage, key = tail.split("/")
    return head, stage, key


def resolve(ref: str, store: Store | None = None) -> tuple[Store, Manifest]:
    """The store and manifest a reference names; ValueError with the reason otherwise."""
    full = parse_uri(ref)
    if full is not None:
        store, (stage, key) = open_store(full[0]), full[1:]
    else:
        store = store or open_store(os.environ.get("GLMFORGE_STORE"))
        stage, _, key = ref.partition("/")
        if not key:
            record = RunRecord.load(store)
            entry = next((s for s in (record.stages if record else []) if s["name"] == stage and s["key"]), None)
            if entry is None:
                raise ValueError(f"no artifact of stage {stage!r} in the latest run in {store.uri}; use STAGE/KEY")
            key = entry["key"]
    manifest = store.manifest(stage, key)
    if manifest is None:
        raise ValueError(f"no published artifact {stage}/{key} in {store.uri}")
    return store, manifest


def materialize(ref: str, store: Store | None = None) -> Path:
    """A local, digest-verified directory with the artifact's files."""
    st, manifest = resolve(ref, store)
    return st.materialize(manifest, default_home() / "cache")
