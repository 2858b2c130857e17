"""Artifact store: one interface, a local directory or S3, with atomic, verified publishing.

    errors.py     CorruptArtifactError, StoreUnavailableError
    manifest.py   Manifest, FileEntry, sha256_file, artifact_prefix: what a published artifact is
    base.py       Store: the backend primitives and the shared artifact logic (publish, verify,
                  materialize, gc); the layout under the store root and why publishing is atomic
    local.py      LocalStore: a directory
    s3.py         S3Store: s3://bucket/prefix through boto3 (imported only when an S3Store is made)
    lease.py      Lease, LeaseTimeout: an exclusive, expiring claim on a name (stage/key)

open_store() picks the backend from a URI; default_home() is $GLMFORGE_HOME (./.glmforge).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runtime.store.base import Store
from runtime.store.errors import CorruptArtifactError, StoreUnavailableError
from runtime.store.lease import Lease, LeaseTimeout
from runtime.store.local import LocalStore
from runtime.store.manifest import (
    MANIFEST,
    MANIFEST_FORMAT,
    FileEntry,
    Manifest,
    artifact_prefix,
    sha256_file,
)
from runtime.store.s3 import S3Store

__all__ = [
    "MANIFEST", "MANIFEST_FORMAT", "CorruptArtifactError", "FileEntry", "Lease", "LeaseTimeout", "LocalStore",
    "Manifest", "S3Store", "Store", "StoreUnavailableError", "artifact_prefix", "default_home", "open_store",
    "sha256_file",
]


def default_home() -> Path:
    return Path(os.environ.get("GLMFORGE_HOME", "./.glmforge")).expanduser().resolve()


def open_store(uri: str | None = None, credentials: dict[str, str] | None = None,
               transfer: dict[str, Any] | None = None) -> Store:
    """`s3://bucket/prefix` -> S3Store; a path (or None: $GLMFORGE_HOME or ./.glmforge) -> LocalStore.
    `transfer`: the S3 store's boto3 TransferConfig knobs (see S3Store); a local store has none."""
    if uri and uri.startswith("s3://"):
        return S3Store(uri, credentials, transfer=transfer)
    if uri and "://" in uri and not uri.startswith("file://"):
        raise ValueError(f"unsupported store URI {uri!r}: use a local path or s3://bucket/prefix")
    if uri and uri.startswith("file://"):
        uri = uri[7:]
    return LocalStore(uri or default_home() / "store")
