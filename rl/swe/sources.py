"""Where a repository comes from, fetched into a clean folder of its files.

    path     a local folder, or a git checkout (its committed files at `rev`, HEAD by default)
    sdist    a source distribution, its archive's sha256 pinned (another archive is refused): from
             the package index (`package`==`version`), or a local archive (`path`)

A source that cannot be fetched raises SourceError with one line naming it; the stage records
the reason and goes on with the others.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.store.manifest import sha256_file

# never copied from a local folder: version control, caches and build output
SKIP = {".git", ".hg", ".svn", "__pycache__", ".pytest_cache", ".mypy_cache", ".tox", ".nox", "build", "dist",
        ".venv", "venv", ".eggs"}


class SourceError(RuntimeError):
    """A source that cannot be fetched or does not match its pin."""


class Source(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="the source's name in the artifact")
    kind: Literal["path", "sdist"] = Field(description=(
        "path: a local folder or git checkout; sdist: a pinned source archive (the package index's, or a "
        "local one)"))
    path: Optional[str] = Field(None, description="kind path: a folder or a git checkout; kind sdist: a local "
                                "archive instead of the package index ({samples} allowed in a config)")
    rev: Optional[str] = Field(None, description="kind path, a git checkout: the commit (default HEAD)")
    package: Optional[str] = Field(None, description="kind sdist: the package index name")
    version: Optional[str] = Field(None, description="kind sdist: the package version on the index")
    sha256: Optional[str] = Field(None, pattern=r"^[0-9a-f]{64}$", description="kind sdist: the archive's sha256")
    tests: tuple[str, ...] = Field((), description="pytest arguments naming the tests (default: pytest's discovery)")
    test_requires: tuple[str, ...] = Field(("pytest",), description="what the tests need installed besides the "
                                           "project's own dependencies")
    license: Optional[str] = Field(None, description="the source's license (SPDX name), for the record: not checked")
    github: Optional[str] = Field(None, pattern=r"^[\w.-]+/[\w.-]+$", description="owner/name on GitHub: the "
                                  "issue-pr stage's pairs of that repository become instances when this source is "
                                  "a git checkout holding their base commits")

    @model_validator(mode="after")
    def _pinned(self) -> "Source":
        if self.kind == "path" and not self.path:
            raise ValueError(f"source {self.name}: kind path needs `path`")
        if self.kind == "sdist" and not (self.sha256 and (self.path or (self.package and self.version))):
            raise ValueError(f"source {self.name}: kind sdist needs sha256 and package + version (or a local "
                             "archive's path): a pinned archive")
        return self


def fetch(source: Source, dest: Path, cache: Path | None) -> Path:
    """The source's files in `dest` (replaced); SourceError naming the source otherwise. A
    `path` is taken as it is (the stage expands {samples})."""
    dest = Path(dest)
    shutil.rmtree(dest, ignore_errors=True)
    if source.kind == "path":
        src = Path(source.path)
        if not src.is_dir():
            raise SourceError(f"source {source.name}: {src} does not exist or is not a folder")
        if (src / ".git").exists():
            _git_export(source, src, dest)
        else:
            shutil.copytree(src, dest, ignore=shutil.ignore_patterns(*SKIP), symlinks=True)
        return dest
    archive = _local(source) if source.path else _download(source, Path(cache))
    _unpack(source, archive, dest)
    return dest


def _local(source: Source) -> Path:
    path = Path(source.path)
    if not path.is_file():
        raise SourceError(f"source {source.name}: archive {path} does not exist")
    digest = sha256_file(path)
    if digest != source.sha256:
        raise SourceError(f"source {source.name}: {path.name} has sha256 {digest}, the source pins {source.sha256}")
    return path


def _git_export(source: Source, src: Path, dest: Path) -> None:
    rev = source.rev or "HEAD"
    with tempfile.TemporaryDirectory() as tmp:
        tar = Path(tmp) / "export.tar"
        r = subprocess.run(["git", "-C", str(src), "archive", "--format=tar", "-o", str(tar), rev],
                           capture_output=True, text=True)
        if r.returncode:
            raise SourceError(f"source {source.name}: git archive {rev} in {src} failed: "
                              f"{(r.stderr.strip().splitlines() or ['no message'])[-1]}")
        dest.mkdir(parents=True)
        with tarfile.open(tar) as t:
            t.extractall(dest, filter="data")


def _download(source: Source, cache: Path) -> Path:
    """The pinned archive from the package index, cached; its sha256 checked every time."""
    cache.mkdir(parents=True, exist_ok=True)
    found = [p for p in cache.iterdir() if p.is_file() and sha256_file(p) == source.sha256]
    if not found:
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                "--disable-pip-version-check", "-q", "-d", tmp, f"{source.package}=={source.version}"],
                               capture_output=True, text=True, timeout=600)
            got = sorted(Path(tmp).iterdir())
            if r.returncode or not got:
                raise SourceError(f"source {source.name}: no source distribution of {source.package}=="
                                  f"{source.version} from the package index: "
                                  f"{(r.stderr.strip().splitlines() or ['nothing downloaded'])[-1]}")
            digest = sha256_file(got[0])
            if digest != source.sha256:
                raise SourceError(f"source {source.name}: {got[0].name} has sha256 {digest}, the source pins "
                                  f"{source.sha256}")
            found = [cache / got[0].name]
            shutil.move(str(got[0]), found[0])
    return found[0]


def _unpack(source: Source, archive: Path, dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as z:
                z.extractall(tmp)
        else:
            with tarfile.open(archive) as t:
                t.extractall(tmp, filter="data")
        tops = [p for p in Path(tmp).iterdir()]
        top = tops[0] if len(tops) == 1 and tops[0].is_dir() else Path(tmp)
        shutil.copytree(top, dest, ignore=shutil.ignore_patterns(*SKIP), symlinks=True)

