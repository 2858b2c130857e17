"""LocalStore: the store as a directory on this machine's disk."""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from runtime.store.base import Store


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

    def _written_beside(self, dest: Path, data: bytes) -> Path:
        """`data` durably written to a temporary name next to `dest` (then renamed or linked)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put_bytes(self, key: str, data: bytes) -> None:
        dest = self._p(key)
        os.replace(self._written_beside(dest, data), dest)

    def create_exclusive(self, key: str, data: bytes) -> bool:
        # Written in full under a temporary name, then hard-linked: link() fails if the name
        # exists (atomic, also on NFS), and a reader never sees a half-written object.
        dest = self._p(key)
        tmp = self._written_beside(dest, data)
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
