"""The README's and the docs' effects tables are `glmforge sweep`'s own output, copied in.

A page holds a sweep's table as a block between two markers naming the file the sweep wrote
(`glmforge sweep --out docs/results/sweeps`):

    <!-- sweep: docs/results/sweeps/sweep-small-seeds-0-1-2.md -->
    ...the file's contents...
    <!-- /sweep -->

`sync` rewrites every block from its file; `stale` names the blocks that differ from their
file (the docs test fails on any), so a table in the README cannot drift from the measurement.

    python -m glmforge.effects_tables README.md docs/results/effects.md     # what make effects-sweep runs
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- sweep: (?P<src>[^ ]+) -->\n)(?P<body>.*?)(<!-- /sweep -->)", re.S)


def _source(page: Path, src: str, root: Path) -> Path:
    path = root / src
    if not path.is_file():
        raise FileNotFoundError(f"{page}: its sweep block names {src}, which does not exist (run `make effects-sweep`)")
    return path


def blocks(page: Path, root: Path = REPO) -> list[tuple[str, str, str]]:
    """(source path, the block's text, the source's text) of each block on `page`."""
    text = page.read_text(encoding="utf-8")
    return [(m["src"], m["body"], _source(page, m["src"], root).read_text(encoding="utf-8"))
            for m in BLOCK.finditer(text)]


def stale(page: Path, root: Path = REPO) -> list[str]:
    """The sources whose block on `page` differs from the file."""
    return [src for src, body, want in blocks(page, root) if body != want]


def sync(page: Path, root: Path = REPO) -> int:
    """Rewrite each block of `page` from its file; the number of blocks that changed."""
    text = page.read_text(encoding="utf-8")
    changed = 0

    def fill(m: re.Match) -> str:
        nonlocal changed
        want = _source(page, m["src"], root).read_text(encoding="utf-8")
        changed += want != m["body"]
        return m.group(1) + want + m.group(4)

    page.write_text(BLOCK.sub(fill, text), encoding="utf-8")
    return changed


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        n = sync(Path(arg))
        print(f"{arg}: {n} sweep table(s) updated")
