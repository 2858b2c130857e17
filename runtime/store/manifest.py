"""What a published artifact is: its manifest, listing each file's size and sha256.

The manifest is the object artifacts/{stage}/{key}/MANIFEST.json, written last by Store.publish:
its presence means "done". Its data files lie under artifacts/{stage}/{key}/{data_prefix}/.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runtime.store.errors import CorruptArtifactError

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
_CHUNK = 8 * 1024 * 1024


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class FileEntry:
    path: str
    size: int
    sha256: str


@dataclass
class Manifest:
    stage: str
    key: str
    data_prefix: str
    files: list[FileEntry]
    metrics: dict[str, Any] = field(default_factory=dict)
    parents: dict[str, str] = field(default_factory=dict)  # parent stage -> parent key
    stage_version: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    format: int = MANIFEST_FORMAT

    @property
    def digest(self) -> str:
        """Content digest: depends on file names and contents only, not on the upload nonce."""
        h = hashlib.sha256()
        for f in sorted(self.files, key=lambda e: e.path):
            h.update(f"{f.path}\0{f.sha256}\n".encode())
        return h.hexdigest()

    def to_json(self) -> str:
        d = asdict(self)
        d["digest"] = self.digest
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> "Manifest":
        try:
            d = json.loads(text)
            d.pop("digest", None)
            d["files"] = [FileEntry(**f) for f in d["files"]]
            return cls(**d)
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptArtifactError(f"{where}: unreadable manifest ({e})") from e


def artifact_prefix(stage: str, key: str) -> str:
    return f"artifacts/{stage}/{key}"
