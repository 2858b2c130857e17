"""The effects tables of the README and the docs are copies of a sweep's output, kept in step."""
from __future__ import annotations

import pytest

from glmforge import effects, effects_tables


def test_sync_copies_the_sweeps_table_and_stale_names_an_edited_one(tmp_path):
    (tmp_path / "sweeps").mkdir()
    src = tmp_path / "sweeps" / "sweep-small-seeds-0.md"
    src.write_text("| effect | held in |\n|---|---|\n| a | 1/1 |\n\nHeld in every run: 1 of 1 effects measured.\n")
    page = tmp_path / "README.md"
    page.write_text("intro\n<!-- sweep: sweeps/sweep-small-seeds-0.md -->\nold table\n<!-- /sweep -->\nafter\n")
    assert effects_tables.stale(page, tmp_path) == ["sweeps/sweep-small-seeds-0.md"]
    assert effects_tables.sync(page, tmp_path) == 1
    assert page.read_text() == ("intro\n<!-- sweep: sweeps/sweep-small-seeds-0.md -->\n" + src.read_text()
                                + "<!-- /sweep -->\nafter\n")
    assert effects_tables.stale(page, tmp_path) == [] and effects_tables.sync(page, tmp_path) == 0
    page.write_text(page.read_text().replace("1/1", "0/1"))           # a hand edit of the copy
    assert effects_tables.stale(page, tmp_path) == ["sweeps/sweep-small-seeds-0.md"]
    src.unlink()
    with pytest.raises(FileNotFoundError, match="README.md: its sweep block names sweeps/sweep-small-seeds-0.md"):
        effects_tables.stale(page, tmp_path)


@pytest.mark.parametrize("page", ["README.md", "docs/results/effects.md"])
def test_the_shipped_pages_tables_are_their_sweeps_output(page):
    assert effects_tables.stale(effects_tables.REPO / page) == []


def test_the_summary_counts_the_effects_held_in_every_run():
    def measured(value, passed):
        return {e.name: {"value": None, "passed": None, "stage": e.stage, "target": e.target} for e in effects.EFFECTS} | {
            "reward_model_accuracy": {"value": value, "passed": passed}, "distill_recovered": {"value": 0.5, "passed": True}}

    runs = {"seed 0": measured(0.8, True), "seed 1": measured(0.6, False)}
    assert effects.every_run(effects.spread(runs)) == (["distill_recovered"], ["reward_model_accuracy"])
    md = effects.markdown(runs)
    assert md.endswith("Held in every run: 1 of 2 effects measured (not: reward_model_accuracy).\n")
