"""S3Store: the store at s3://bucket/prefix, through boto3.

boto3 and botocore are imported inside the methods that use them (first when an S3Store is
made), so importing this module, or runtime.store, needs neither.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runtime.store.base import Store
from runtime.store.errors import StoreUnavailableError


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


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not a number") from None
