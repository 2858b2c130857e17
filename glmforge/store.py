"""Artifact store: one interface, a local directory or S3, with atomic, verified publishing.

Layout under the store root (a directory, or s3://bucket/prefix):

    artifacts/{stage}/{key}/MANIFEST.json          written last: its presence means "done"
    artifacts/{stage}/{key}/data-{nonce}/...       the files the manifest lists
    checkpoints/{stage}/{key}/...                  in-stage checkpoints mirrored from a workdir
    runs/{run_id}.json, runs/LATEST                run records read by `glmforge status`

Publishing uploads the files under a fresh `data-{nonce}` prefix and then writes the manifest,
which names that prefix. A crash before the manifest leaves only an unreferenced prefix: no
reader can see it (readers start from the manifest) and `gc()` removes it. Two writers racing on
one key each use their own prefix; the last manifest wins and the other prefix becomes garbage.
S3 has no rename, so this scheme is what makes S3 publishing atomic without copying data.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
_CHUNK = 8 * 1024 * 1024


class CorruptArtifactError(RuntimeError):
    """A file of a published artifact is missing or does not match its manifest digest."""


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


class Store(ABC):
    """Object-level operations (implemented per backend) and artifact logic (shared)."""

    uri: str

    # ---- backend primitives: keys are '/'-separated paths relative to the store root ----
    @abstractmethod
    def put_file(self, key: str, src: Path) -> None: ...

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Atomic: a reader sees the old object or the new one, never a partial one."""

    @abstractmethod
    def get_file(self, key: str, dest: Path) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of an object (the whole object by default). FileNotFoundError if absent."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """All keys under prefix (recursive), sorted."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None: ...

    @abstractmethod
    def local_path(self, key: str) -> Path | None:
        """Where the object lives on this machine's disk, if the backend is local."""

    # ---- directories ----
    def push_dir(self, src: Path, prefix: str) -> None:
        """Upload every file under src to prefix/relative/path."""
        for p in sorted(Path(src).rglob("*")):
            if p.is_file():
                self.put_file(f"{prefix}/{p.relative_to(src).as_posix()}", p)

    def pull_dir(self, prefix: str, dest: Path) -> int:
        """Download every object under prefix into dest; returns the number of files."""
        n = 0
        for k in self.list(prefix):
            rel = k[len(prefix):].lstrip("/")
            if rel:
                self.get_file(k, Path(dest) / rel)
                n += 1
        return n

    # ---- artifacts ----
    def publish(
        self,
        stage: str,
        key: str,
        src: Path,
        *,
        metrics: dict[str, Any] | None = None,
        parents: dict[str, str] | None = None,
        stage_version: str = "",
        config: dict[str, Any] | None = None,
    ) -> Manifest:
        """Upload a directory as the artifact (stage, key): data first, manifest last."""
        src = Path(src)
        if not src.is_dir():
            raise FileNotFoundError(f"cannot publish {stage}/{key}: {src} is not a directory")
        base = artifact_prefix(stage, key)
        data_prefix = f"data-{uuid.uuid4().hex[:12]}"
        entries = []
        for p in sorted(src.rglob("*")):
            if p.is_file():
                rel = p.relative_to(src).as_posix()
                entries.append(FileEntry(rel, p.stat().st_size, sha256_file(p)))
                self.put_file(f"{base}/{data_prefix}/{rel}", p)
        manifest = Manifest(
            stage=stage,
            key=key,
            data_prefix=data_prefix,
            files=entries,
            metrics=metrics or {},
            parents=parents or {},
            stage_version=stage_version,
            config=config or {},
        )
        self.put_bytes(f"{base}/{MANIFEST}", manifest.to_json().encode())
        return manifest

    def manifest(self, stage: str, key: str) -> Manifest | None:
        """The published manifest of (stage, key), or None when nothing complete is there."""
        where = f"{self.uri}/{artifact_prefix(stage, key)}/{MANIFEST}"
        try:
            text = self.get_bytes(f"{artifact_prefix(stage, key)}/{MANIFEST}").decode()
        except FileNotFoundError:
            return None
        return Manifest.from_json(text, where)

    def artifact_uri(self, stage: str, key: str) -> str:
        return f"{self.uri}/{artifact_prefix(stage, key)}"

    def verify(self, manifest: Manifest) -> None:
        """Check every file's size and sha256; raise CorruptArtifactError naming the first bad one."""
        base = f"{artifact_prefix(manifest.stage, manifest.key)}/{manifest.data_prefix}"
        for f in manifest.files:
            local = self.local_path(f"{base}/{f.path}")
            if local is not None:
                self._check(local, f, f"{self.uri}/{base}/{f.path}")
            else:
                data = self._get_or_corrupt(f"{base}/{f.path}")
                if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
                    raise CorruptArtifactError(f"{self.uri}/{base}/{f.path}: content does not match manifest digest")

    def materialize(self, manifest: Manifest, cache_dir: Path) -> Path:
        """A local directory holding the artifact's files, each verified against the manifest.

        The local store returns the artifact's own directory; remote stores download into
        cache_dir/{stage}/{key}/{data_prefix} once (a verified download is reused)."""
        base = f"{artifact_prefix(manifest.stage, manifest.key)}/{manifest.data_prefix}"
        local_root = self.local_path(base)
        if local_root is not None:
            self.verify(manifest)
            local_root.mkdir(parents=True, exist_ok=True)  # an artifact may have no files
            return local_root
        dest = Path(cache_dir) / manifest.stage / manifest.key / manifest.data_prefix
        done = dest / ".verified"
        if done.exists():
            return dest
        for f in manifest.files:
            target = dest / f.path
            try:
                self.get_file(f"{base}/{f.path}", target)
            except FileNotFoundError as e:
                raise CorruptArtifactError(f"{self.uri}/{base}/{f.path}: listed in manifest but missing") from e
            self._check(target, f, f"{self.uri}/{base}/{f.path}")
        dest.mkdir(parents=True, exist_ok=True)
        done.write_text(manifest.digest)
        return dest

    def artifacts(self) -> Iterator[Manifest]:
        """Every complete artifact in the store."""
        for k in self.list("artifacts/"):
            if k.endswith(f"/{MANIFEST}"):
                parts = k.split("/")
                if len(parts) == 4:
                    m = self.manifest(parts[1], parts[2])
                    if m is not None:
                        yield m

    def gc(self) -> list[str]:
        """Delete data prefixes that no manifest references (half-published or superseded)."""
        removed: list[str] = []
        referenced: set[str] = set()
        prefixes: set[str] = set()
        for k in self.list("artifacts/"):
            parts = k.split("/")
            if len(parts) >= 4 and parts[3].startswith("data-"):
                prefixes.add("/".join(parts[:4]))
        for m in self.artifacts():
            referenced.add(f"{artifact_prefix(m.stage, m.key)}/{m.data_prefix}")
        for p in sorted(prefixes - referenced):
            self.delete_prefix(p)
            removed.append(p)
        return removed

    # ---- json records (runs) ----
    def put_json(self, key: str, obj: Any) -> None:
        self.put_bytes(key, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())

    def get_json(self, key: str) -> Any | None:
        try:
            return json.loads(self.get_bytes(key))
        except FileNotFoundError:
            return None

    # ---- helpers ----
    def _check(self, path: Path, f: FileEntry, name: str) -> None:
        if not path.is_file():
            raise CorruptArtifactError(f"{name}: listed in manifest but missing")
        if path.stat().st_size != f.size:
            raise CorruptArtifactError(f"{name}: size {path.stat().st_size} != manifest size {f.size}")
        if sha256_file(path) != f.sha256:
            raise CorruptArtifactError(f"{name}: sha256 does not match manifest digest")

    def _get_or_corrupt(self, key: str) -> bytes:
        try:
            return self.get_bytes(key)
        except FileNotFoundError as e:
            raise CorruptArtifactError(f"{self.uri}/{key}: listed in manifest but missing") from e


class LocalStore(Store):
    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.uri = str(self.root)

    def _p(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if p != self.root and self.root not in p.parents:
            raise ValueError(f"key {key!r} escapes the store root {self.root}")
        return p

    def put_file(self, key: str, src: Path) -> None:
        dest = self._p(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if Path(src).resolve() == dest:
            return
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)

    def put_bytes(self, key: str, data: bytes) -> None:
        dest = self._p(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)

    def get_file(self, key: str, dest: Path) -> None:
        src = self._p(key)
        if not src.is_file():
            raise FileNotFoundError(f"{self.uri}/{key}")
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        src = self._p(key)
        if not src.is_file():
            raise FileNotFoundError(f"{self.uri}/{key}")
        with open(src, "rb") as f:
            f.seek(start or 0)
            return f.read() if end is None else f.read(end - (start or 0))

    def exists(self, key: str) -> bool:
        return self._p(key).exists()

    def list(self, prefix: str) -> list[str]:
        base = self._p(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if base.is_file():
            return [prefix]
        if not base.is_dir():
            return []
        return sorted(
            p.relative_to(self.root).as_posix()
            for p in base.rglob("*")
            if p.is_file() and not p.name.endswith(".tmp")
        )

    def delete_prefix(self, prefix: str) -> None:
        p = self._p(prefix)
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()

    def local_path(self, key: str) -> Path | None:
        return self._p(key)


class S3Store(Store):
    """s3://bucket/prefix through boto3. Endpoint and credentials come from the environment
    (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3, ...) or
    are passed in explicitly (tasks/ resolves them from a Prefect block). They are never
    logged or written to manifests."""

    MULTIPART_THRESHOLD = 64 * 1024 * 1024

    def __init__(self, uri: str, credentials: dict[str, str] | None = None):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        if not uri.startswith("s3://"):
            raise ValueError(f"not an s3 URI: {uri!r}")
        bucket, _, prefix = uri[5:].partition("/")
        if not bucket:
            raise ValueError(f"s3 URI has no bucket: {uri!r}")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        creds = dict(credentials or {})
        # A session per store: boto3's default session caches credentials from its first use.
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=creds.pop("endpoint_url", None) or os.environ.get("GLMFORGE_S3_ENDPOINT") or None,
            config=Config(retries={"max_attempts": 5, "mode": "standard"}, s3={"addressing_style": "path"}),
            **creds,
        )
        self._transfer = TransferConfig(multipart_threshold=self.MULTIPART_THRESHOLD, multipart_chunksize=self.MULTIPART_THRESHOLD)

    def __repr__(self) -> str:  # never show credentials
        return f"S3Store({self.uri!r})"

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_file(self, key: str, src: Path) -> None:
        self._client.upload_file(str(src), self.bucket, self._k(key), Config=self._transfer)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data)

    def get_file(self, key: str, dest: Path) -> None:
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(dest).with_name(Path(dest).name + ".part")
        try:
            self._client.download_file(self.bucket, self._k(key), str(tmp), Config=self._transfer)
        except self._client.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                raise FileNotFoundError(f"{self.uri}/{key}") from e
            raise
        os.replace(tmp, dest)

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        kw: dict[str, Any] = {}
        if start is not None or end is not None:
            kw["Range"] = f"bytes={start or 0}-{'' if end is None else end - 1}"
        try:
            return self._client.get_object(Bucket=self.bucket, Key=self._k(key), **kw)["Body"].read()
        except self._client.exceptions.NoSuchKey as e:
            raise FileNotFoundError(f"{self.uri}/{key}") from e

    def exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self._k(key))
            return True
        except self._client.exceptions.ClientError:
            return bool(self.list(key + "/"))

    def list(self, prefix: str) -> list[str]:
        keys = []
        strip = len(self.prefix) + 1 if self.prefix else 0
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._k(prefix)):
            keys.extend(o["Key"][strip:] for o in page.get("Contents", []))
        return sorted(keys)

    def delete_prefix(self, prefix: str) -> None:
        keys = self.list(prefix)
        for i in range(0, len(keys), 1000):
            self._client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": self._k(k)} for k in keys[i : i + 1000]]}
            )

    def local_path(self, key: str) -> Path | None:
        return None


def default_home() -> Path:
    return Path(os.environ.get("GLMFORGE_HOME", "./.glmforge")).expanduser().resolve()


def open_store(uri: str | None = None, credentials: dict[str, str] | None = None) -> Store:
    """`s3://bucket/prefix` -> S3Store; a path (or None: $GLMFORGE_HOME or ./.glmforge) -> LocalStore."""
    if uri and uri.startswith("s3://"):
        return S3Store(uri, credentials)
    if uri and "://" in uri and not uri.startswith("file://"):
        raise ValueError(f"unsupported store URI {uri!r}: use a local path or s3://bucket/prefix")
    if uri and uri.startswith("file://"):
        uri = uri[7:]
    return LocalStore(uri or default_home() / "store")
