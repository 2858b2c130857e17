"""Artifact store: one interface, a local directory or S3, with atomic, verified publishing.

Layout under the store root (a directory, or s3://bucket/prefix):

    artifacts/{stage}/{key}/MANIFEST.json          written last: its presence means "done"
    artifacts/{stage}/{key}/data-{nonce}/...       the files the manifest lists
    checkpoints/{stage}/{key}/...                  in-stage checkpoints mirrored from a workdir
    runs/{run_id}.json, runs/LATEST                run records read by `glmforge status`
    leases/{stage}/{key}/{generation}              who is running (stage, key) now (see Lease)

Publishing uploads the files under a fresh `data-{nonce}` prefix and then writes the manifest,
which names that prefix. A crash before the manifest leaves only an unreferenced prefix: no
reader can see it (readers start from the manifest) and `gc()` removes it. Two writers racing on
one key each use their own prefix; the last manifest wins and the other prefix becomes garbage.
S3 has no rename, so this scheme is what makes S3 publishing atomic without copying data.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
_CHUNK = 8 * 1024 * 1024


log = logging.getLogger("glmforge")


class CorruptArtifactError(RuntimeError):
    """A file of a published artifact is missing or does not match its manifest digest."""


class StoreUnavailableError(ConnectionError):
    """The store's server could not be reached (after the client's retries and timeouts)."""


class LeaseTimeout(TimeoutError):
    """Another run held a stage's lease for longer than this run was willing to wait."""


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

    def put_files(self, items: list[tuple[str, Path]]) -> None:
        """Upload (key, file) pairs, in no particular order (a backend may overlap them)."""
        for key, src in items:
            self.put_file(key, src)

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Atomic: a reader sees the old object or the new one, never a partial one."""

    @abstractmethod
    def create_exclusive(self, key: str, data: bytes) -> bool:
        """Write the object only if no object has that key, atomically: of two concurrent
        callers exactly one gets True. The primitive under stage leases."""

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
        files = [(p, p.relative_to(src).as_posix(), p.stat().st_size) for p in sorted(src.rglob("*")) if p.is_file()]
        # The manifest's digests are computed on a thread of their own while the files upload
        # (hashlib and file reads release the GIL), and the files go up together (put_files):
        # hashing each file and then uploading it, one file after the other, made a checkpoint's
        # publish ~0.8x the throughput of boto3's upload_file alone (bench/s3_upload.py).
        hasher = ThreadPoolExecutor(1, thread_name_prefix="publish-sha256")
        try:
            digests = [hasher.submit(sha256_file, p) for p, _, _ in files]
            self.put_files([(f"{base}/{data_prefix}/{rel}", p) for p, rel, _ in files])
            entries = [FileEntry(rel, size, d.result()) for (_, rel, size), d in zip(files, digests)]
        finally:
            hasher.shutdown(wait=True, cancel_futures=True)
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
            # The cached copy is a reader too: a byte changed on this disk since the download
            # must not reach a stage. A damaged copy is dropped and fetched again from the store.
            try:
                for f in manifest.files:
                    self._check(dest / f.path, f, str(dest / f.path))
                return dest
            except CorruptArtifactError as e:
                log.warning("cached artifact copy is damaged (%s); downloading it again", e)
                shutil.rmtree(dest, ignore_errors=True)
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

    def create_exclusive(self, key: str, data: bytes) -> bool:
        # Written in full under a temporary name, then hard-linked: link() fails if the name
        # exists (atomic, also on NFS), and a reader never sees a half-written object.
        dest = self._p(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, dest)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

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
    TRANSFER_KNOBS = ("multipart_threshold", "multipart_chunksize", "max_concurrency", "use_threads")

    @classmethod
    def transfer_defaults(cls) -> dict[str, Any]:
        """boto3 TransferConfig knobs used when none are given (glmforge.config.S3TransferConfig
        documents and validates them)."""
        return {"multipart_threshold": cls.MULTIPART_THRESHOLD, "multipart_chunksize": cls.MULTIPART_THRESHOLD,
                "max_concurrency": 10, "use_threads": True}

    def __init__(
        self,
        uri: str,
        credentials: dict[str, str] | None = None,
        *,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        max_attempts: int | None = None,
        transfer: dict[str, Any] | None = None,
    ):
        """Timeouts and attempts default to $GLMFORGE_S3_CONNECT_TIMEOUT (5 s),
        $GLMFORGE_S3_READ_TIMEOUT (60 s) and $GLMFORGE_S3_MAX_ATTEMPTS (5): a stopped server is
        reported as StoreUnavailableError within seconds instead of hanging a stage.

        `transfer`: boto3 TransferConfig knobs (multipart_threshold, multipart_chunksize,
        max_concurrency, use_threads) for every file upload and download; missing ones take
        transfer_defaults()."""
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
        self.connect_timeout = connect_timeout if connect_timeout is not None else _env_float("GLMFORGE_S3_CONNECT_TIMEOUT", 5)
        self.read_timeout = read_timeout if read_timeout is not None else _env_float("GLMFORGE_S3_READ_TIMEOUT", 60)
        self.max_attempts = max_attempts if max_attempts is not None else int(_env_float("GLMFORGE_S3_MAX_ATTEMPTS", 5))
        creds = dict(credentials or {})
        # A session per store: boto3's default session caches credentials from its first use.
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=creds.pop("endpoint_url", None) or os.environ.get("GLMFORGE_S3_ENDPOINT") or None,
            config=Config(
                retries={"total_max_attempts": self.max_attempts, "mode": "standard"},
                connect_timeout=self.connect_timeout,
                read_timeout=self.read_timeout,
                s3={"addressing_style": "path"},
            ),
            **creds,
        )
        self.endpoint = self._client.meta.endpoint_url
        unknown = set(transfer or {}) - set(self.TRANSFER_KNOBS)
        if unknown:
            raise ValueError(f"unknown S3 transfer settings {sorted(unknown)}; known: {list(self.TRANSFER_KNOBS)}")
        self.transfer = {**self.transfer_defaults(), **(transfer or {})}
        self._transfer = TransferConfig(**self.transfer)

    @contextlib.contextmanager
    def _io(self, op: str, key: str) -> Iterator[None]:
        """Turn "server not there" errors into one StoreUnavailableError naming the object."""
        from boto3.exceptions import RetriesExceededError
        from botocore.exceptions import (
            ConnectionClosedError, ConnectTimeoutError, EndpointConnectionError, IncompleteReadError,
            ReadTimeoutError, ResponseStreamingError,
        )

        try:
            yield
        except (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, ConnectionClosedError,
                IncompleteReadError, ResponseStreamingError, RetriesExceededError) as e:
            raise StoreUnavailableError(
                f"S3 store {self.uri} (endpoint {self.endpoint}) unreachable: {op} {self.uri}/{key} failed after "
                f"{self.max_attempts} attempts (connect timeout {self.connect_timeout:g} s, read timeout "
                f"{self.read_timeout:g} s): {e}"
            ) from e

    def __repr__(self) -> str:  # never show credentials
        return f"S3Store({self.uri!r})"

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_file(self, key: str, src: Path) -> None:
        with self._io("upload", key):
            self._client.upload_file(str(src), self.bucket, self._k(key), Config=self._transfer)

    def put_files(self, items: list[tuple[str, Path]]) -> None:
        """All files through one boto3 transfer manager (the store's TransferConfig): their parts
        share its max_concurrency workers, so a file's last parts no longer hold up the next file
        and small files go up side by side. The first failure is raised, the rest cancelled."""
        from boto3.exceptions import S3UploadFailedError
        from boto3.s3.transfer import create_transfer_manager
        from botocore.exceptions import ClientError

        items = list(items)
        if len(items) <= 1 or not self.transfer["use_threads"]:
            return super().put_files(items)
        with create_transfer_manager(self._client, self._transfer) as manager:
            futures = [(key, src, manager.upload(str(src), self.bucket, self._k(key))) for key, src in items]
            for key, src, future in futures:
                try:
                    with self._io("upload", key):
                        future.result()
                except ClientError as e:  # as boto3's upload_file reports it
                    raise S3UploadFailedError(f"Failed to upload {src} to {self.bucket}/{self._k(key)}: {e}") from e

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._io("put", key):
            self._client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data)

    def create_exclusive(self, key: str, data: bytes) -> bool:
        # Conditional write (If-None-Match: *), supported by AWS S3 and SeaweedFS (4.x checked).
        from botocore.exceptions import ClientError

        try:
            with self._io("create", key):
                self._client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data, IfNoneMatch="*")
            return True
        except ClientError as e:
            # 412: the key exists; 409: a concurrent conditional write to it is in flight.
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict") or \
                    e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
                return False
            raise

    def get_file(self, key: str, dest: Path) -> None:
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(dest).with_name(Path(dest).name + ".part")
        try:
            with self._io("download", key):
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
            with self._io("get", key):
                return self._client.get_object(Bucket=self.bucket, Key=self._k(key), **kw)["Body"].read()
        except self._client.exceptions.NoSuchKey as e:
            raise FileNotFoundError(f"{self.uri}/{key}") from e

    def exists(self, key: str) -> bool:
        try:
            with self._io("head", key):
                self._client.head_object(Bucket=self.bucket, Key=self._k(key))
            return True
        except self._client.exceptions.ClientError:
            return bool(self.list(key + "/"))

    def list(self, prefix: str) -> list[str]:
        keys = []
        strip = len(self.prefix) + 1 if self.prefix else 0
        with self._io("list", prefix):
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._k(prefix)):
                keys.extend(o["Key"][strip:] for o in page.get("Contents", []))
        return sorted(keys)

    def delete_prefix(self, prefix: str) -> None:
        keys = self.list(prefix)
        for i in range(0, len(keys), 1000):
            with self._io("delete", prefix):
                self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": self._k(k)} for k in keys[i : i + 1000]]}
                )

    def local_path(self, key: str) -> Path | None:
        return None



# ---------------------------------------------------------------- leases


def _machine() -> str:
    """This machine: hostname and kernel boot id, so a pid is only ever judged on its own host."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_LIVE_OWNERS: set[str] = set()  # leases held right now by this process (any thread)


class Lease:
    """An exclusive, expiring claim on a name in the store (the runner claims `stage/key`).

    Generations make it atomic with one primitive, `create_exclusive`: the lease is the object
    `leases/{name}/{generation}` with the highest generation. To take it, a run reads the top
    one; when it is released, expired, or held by a dead process on this machine, the run
    creates generation top+1 — of two runs racing for it exactly one succeeds. The holder
    renews `expires` every ttl/3 from a background thread and marks its generation released on
    exit. A run SIGKILLed on this machine is noticed at once (its pid is gone); on another
    machine its lease expires `ttl` seconds after the last heartbeat. Clocks of the machines
    sharing a store must agree to well within `ttl`.
    """

    def __init__(self, store: Store, name: str, ttl: float = 60.0):
        if ttl <= 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl}")
        self.store, self.name, self.ttl = store, name, float(ttl)
        self.prefix = f"leases/{name}"
        self.owner = uuid.uuid4().hex[:16]
        self.generation: int | None = None
        self.holder: dict[str, Any] | None = None  # the live record that made the last try fail
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def uri(self, generation: int) -> str:
        return f"{self.store.uri}/{self.prefix}/{generation:010d}"

    def _key(self, generation: int) -> str:
        return f"{self.prefix}/{generation:010d}"

    def _generations(self) -> list[int]:
        return sorted(int(k.rsplit("/", 1)[1]) for k in self.store.list(self.prefix + "/") if k.rsplit("/", 1)[1].isdigit())

    def _top(self) -> int | None:
        gens = self._generations()
        return gens[-1] if gens else None

    def _record(self, released: bool = False) -> bytes:
        now = time.time()
        return json.dumps({
            "owner": self.owner, "machine": _machine(), "pid": os.getpid(), "generation": self.generation,
            "heartbeat": now, "expires": now + self.ttl, "ttl": self.ttl, "released": released,
        }).encode()

    @staticmethod
    def is_stale(rec: dict[str, Any]) -> bool:
        if rec.get("released") or rec.get("expires", 0) < time.time():
            return True
        if rec.get("machine") == _machine():
            if not _pid_alive(int(rec.get("pid", 0))):
                return True  # killed on this machine: no need to wait for the expiry
            if rec.get("pid") == os.getpid() and rec.get("owner") not in _LIVE_OWNERS:
                return True  # an earlier attempt in this process that could not release it
        return False

    def try_acquire(self) -> bool:
        gens = self._generations()
        top = gens[-1] if gens else None
        if top is not None:
            try:
                rec = json.loads(self.store.get_bytes(self._key(top)))
            except FileNotFoundError:
                return False  # superseded and cleaned up while we looked: look again
            except ValueError:
                rec = {}  # unreadable record (torn local write): treat as stale
            if rec and not self.is_stale(rec):
                self.holder = rec
                return False
        self.generation = 0 if top is None else top + 1
        if not self.store.create_exclusive(self._key(self.generation), self._record()):
            self.generation = None
            return False
        _LIVE_OWNERS.add(self.owner)
        for older in gens:  # superseded generations: only the top one matters
            self.store.delete_prefix(self._key(older))
        return True

    def acquire(self, wait: float, poll: float | None = None) -> None:
        """Take the lease, waiting up to `wait` seconds for another holder; LeaseTimeout after."""
        poll = poll if poll is not None else min(2.0, self.ttl / 4)
        deadline = time.monotonic() + wait
        said = False
        while not self.try_acquire():
            if time.monotonic() >= deadline:
                h = self.holder or {}
                raise LeaseTimeout(
                    f"{self.name} is being run by another run (owner {h.get('owner')}, pid {h.get('pid')} on "
                    f"{h.get('machine')}, lease {self.uri(int(h.get('generation') or 0))}); gave up after {wait:g} s. "
                    f"A killed run's lease expires {self.ttl:g} s after its last heartbeat."
                )
            if not said and self.holder:
                log.info("%s: held by pid %s on %s; waiting up to %g s", self.name, self.holder.get("pid"),
                         self.holder.get("machine"), wait)
                said = True
            time.sleep(poll)
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name=f"lease-{self.name}", daemon=True)
        self._thread.start()

    def renew(self) -> bool:
        """Push `expires` forward; False (and `lost`) when another run took the lease over."""
        if self.generation is None:
            return False
        if self._top() != self.generation:
            self.lost = True
            log.error("%s: lease taken over by another run (this run stalled past its ttl of %g s)", self.name, self.ttl)
            return False
        self.store.put_bytes(self._key(self.generation), self._record())
        return True

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                if not self.renew():
                    return
            except Exception as e:  # a store outage: keep trying until the lease would expire
                log.warning("%s: lease heartbeat failed: %s", self.name, e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            if self.generation is not None and not self.lost and self._top() == self.generation:
                self.store.put_bytes(self._key(self.generation), self._record(released=True))
        finally:
            _LIVE_OWNERS.discard(self.owner)
            self.generation = None

    @contextlib.contextmanager
    def held(self, wait: float) -> Iterator["Lease"]:
        self.acquire(wait)
        try:
            yield self
        finally:
            try:
                self.release()
            except Exception as e:  # the store is gone: the lease expires on its own
                log.warning("%s: could not release the lease (%s); it expires in %g s", self.name, e, self.ttl)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not a number") from None


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
