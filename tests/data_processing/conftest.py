"""Shared fixtures: real text from the Python standard library and samples/, written as shards."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from data_processing.common import SAMPLES_DIR
from data_processing.document import Document, ShardWriter
from runtime.stage import Workdir

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_docs(n: int, min_chars: int = 2000, max_chars: int = 60_000) -> list[Document]:
    """n real stdlib modules (sorted by path so the choice is stable), medium-sized."""
    out = []
    for p in sorted(STDLIB.glob("*.py")):
        t = p.read_text(encoding="utf-8", errors="replace")
        if min_chars <= len(t) <= max_chars:
            out.append(Document(f"stdlib/{p.name}", t, "stdlib"))
        if len(out) == n:
            break
    assert len(out) == n, f"only {len(out)} stdlib modules of the wanted size"
    return out


def gsm8k_records(n: int) -> list[dict]:
    with open(SAMPLES_DIR / "gsm8k" / "train.jsonl") as f:
        return [json.loads(next(f)) for _ in range(n)]


def write_docs(directory: Path, docs: list[Document], shard_size: int = 1000) -> Path:
    w = ShardWriter(directory, shard_size)
    w.write_all(docs)
    w.close()
    return directory


@pytest.fixture(scope="session")
def tiny():
    """The tiny preset as the pipeline validates it: configs/tiny.yaml is the one home of its
    curation settings. Session-scoped: load_config builds the model from the stage registry."""
    from glmforge.config import load_config

    return load_config("tiny")


@pytest.fixture
def workdir(tmp_path: Path) -> Workdir:
    return Workdir.at(tmp_path / "work")
