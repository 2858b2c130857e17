"""The documentation site's generated reference (glmforge/docs_reference.py) covers the code: every
config field with a description, every CLI command, every stage. The strict MkDocs build itself
runs in `make docs` (CI); these tests need no MkDocs."""
from __future__ import annotations

import re
import typing

import pytest
from pydantic import BaseModel, Field

from glmforge import docs_reference
from glmforge.config import pipeline_model
from glmforge.pipeline import STAGES


def _independent_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted field path under `model`, walked apart from the generator."""

    def models(tp) -> list[tuple[str, type[BaseModel]]]:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return [("", tp)]
        origin = typing.get_origin(tp)
        if origin is typing.Literal:
            return []
        found = [(step, m) for a in typing.get_args(tp) for step, m in models(a)]
        if origin in (list, tuple, set, frozenset):
            return [("[]" + step, m) for step, m in found]
        if origin is dict:
            return [(".<key>" + step, m) for step, m in models(typing.get_args(tp)[1])]
        return found

    paths = []
    for name, info in model.model_fields.items():
        paths.append(prefix + name)
        for step, sub in dict.fromkeys(models(info.annotation)):
            paths += _independent_paths(sub, f"{prefix}{name}{step}.")
    return paths


@pytest.fixture(scope="module")
def config_page() -> str:
    return docs_reference.config_markdown()


def _rows(page: str) -> dict[str, list[str]]:
    """The table rows of a generated page by their first cell's code text."""
    rows = {}
    for line in page.splitlines():
        if line.startswith("| `"):
            # cells split at pipes outside code spans and not escaped
            cells = [c.strip() for c in re.findall(r"((?:`[^`]*`|\\\||[^|`])*)\|", line.strip()[1:])]
            rows[cells[0].strip("`")] = cells
    return rows


def test_every_config_field_is_in_the_reference_with_a_description(config_page):
    model = pipeline_model()
    sections = list(model.model_fields)
    fields = [p for p in _independent_paths(model) if "." in p]
    assert len(fields) > 1000  # the walk reached the nested sections
    rows = _rows(config_page)
    missing = [p for p in fields if p not in rows]
    assert not missing, f"config fields not in reference/config.md: {missing[:20]}"
    blank = [p for p in fields if not rows[p][-1]]
    assert not blank, f"{len(blank)} config fields without a description: {blank[:40]}"
    assert set(fields) == {d.path for d in docs_reference.config_fields()}
    for section in sections:
        assert f"## `{section}` {{#{section}}}" in config_page
    assert docs_reference.undescribed(model) == [s for s in sections if not model.model_fields[s].description]


def test_preset_values_that_differ_from_the_default_are_shown(config_page):
    rows = _rows(config_page)
    header = next(line for line in config_page.splitlines() if line.startswith("| field |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[3:6] == list(docs_reference.PRESETS)
    seed = rows["run.seed"]
    assert seed[2] == "`0`" and seed[columns.index("glm5")] == "`20260211`"  # configs/glm5.yaml's run.seed


def test_every_cli_command_is_in_the_reference():
    import typer

    from glmforge.cli import app

    page = docs_reference.cli_markdown()
    expected = []

    def visit(cmd, path):
        expected.append(path)
        for name, sub in getattr(cmd, "commands", {}).items():
            visit(sub, f"{path} {name}")

    visit(typer.main.get_command(app), "glmforge")
    assert {"glmforge run", "glmforge artifacts ls", "glmforge model info", "glmforge schedule add"} <= set(expected)
    for path in expected:
        assert f"## `{path}`" in page, path
    assert "`--preset" in page and "`--until <str>`" in page  # options, with their types


def test_every_stage_is_in_the_reference():
    page = docs_reference.stages_markdown()
    for spec in STAGES:
        assert f"## `{spec.name}` {{#{spec.name}}}" in page
        assert f"[`{spec.section}`](config.md#{spec.section})" in page


def test_a_field_without_a_description_is_named():
    class Inner(BaseModel):
        depth: int = Field(1, description="how deep")
        width: int = 2

    class Outer(BaseModel):
        name: str = Field("x", description="a name")
        inner: Inner = Field(default_factory=Inner, description="nested")
        items: list[Inner] = Field(default_factory=list, description="a list of them")
        bare: bool = False

    assert docs_reference.undescribed(Outer) == ["inner.width", "items[].width", "bare"]
