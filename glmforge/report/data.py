"""What the report reads of a run: its record and, per stage, the manifest and published files."""
from __future__ import annotations

import hashlib
import json
from typing import Any

from runtime.runner import RunRecord
from runtime.store import Manifest, Store, artifact_prefix


class RunData:
    """The run record and, per stage, its manifest and published files, read lazily from the store."""

    def __init__(self, store: Store, record: RunRecord):
        self.store, self.record = store, record
        self.stages = {s["name"]: s for s in record.stages}
        self.problems: list[str] = []  # files that could not be read, shown in the header
        self._manifests: dict[str, Manifest | None] = {}

    def metrics(self, stage: str) -> dict[str, Any]:
        return (self.stages.get(stage) or {}).get("metrics") or {}

    def manifest(self, stage: str) -> Manifest | None:
        if stage not in self._manifests:
            key = (self.stages.get(stage) or {}).get("key")
            m = None
            if key and self.stages[stage]["state"] in ("done", "cached"):
                try:
                    m = self.store.manifest(stage, key)
                except Exception as e:  # a damaged manifest: the rest of the page still shows
                    self.problems.append(f"{stage}/{key}: manifest unreadable ({e})")
            self._manifests[stage] = m
        return self._manifests[stage]

    def files(self, stage: str, suffix: str) -> list[str]:
        m = self.manifest(stage)
        return sorted(f.path for f in m.files if f.path.endswith(suffix)) if m else []

    def file_bytes(self, stage: str, path: str) -> bytes | None:
        """A published file, checked against its manifest digest; None when absent or damaged."""
        m = self.manifest(stage)
        entry = next((f for f in m.files if f.path == path), None) if m else None
        if entry is None:
            return None
        where = f"{artifact_prefix(m.stage, m.key)}/{m.data_prefix}/{path}"
        try:
            data = self.store.get_bytes(where)
        except FileNotFoundError:
            self.problems.append(f"{self.store.uri}/{where}: listed in the manifest but missing")
            return None
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            self.problems.append(f"{self.store.uri}/{where}: content does not match the manifest digest")
            return None
        return data

    def json_file(self, stage: str, path: str) -> Any | None:
        data = self.file_bytes(stage, path)
        try:
            return json.loads(data) if data is not None else None
        except ValueError as e:
            self.problems.append(f"{stage}/{path}: not JSON ({e})")
            return None

    def steps(self, stage: str, path: str = "metrics.jsonl") -> list[dict[str, Any]]:
        """The per-step records of a stage's metrics.jsonl ([] when it has none)."""
        data = self.file_bytes(stage, path)
        rows = []
        for line in (data or b"").decode(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a torn last line of an interrupted writer
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def shown_state(self, stage: str) -> str:
        s = self.stages.get(stage)
        if s is None:
            return "not run"
        # execute() stamps `started` before a stage runs; the state says "not run" until it ends
        if s["state"] == "not run" and s.get("started") and s.get("seconds") is None \
                and self.record.shown_state() == "running":
            return "running"
        return s["state"]
