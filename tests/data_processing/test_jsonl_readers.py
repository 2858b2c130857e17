"""JSONL readers keep U+2028/U+2029 inside JSON strings: JSON allows them unescaped (datatrove's
and orjson's writers, and json.dumps(ensure_ascii=False), leave them raw), and str.splitlines()
would cut a record there, so the readers split on "\\n" only."""
from __future__ import annotations

import json

from data_processing.common import TextSource, read_text_source
from data_processing.decontaminate import EvalSet, selected_texts

SEPARATORS = "line\u2028separator, paragraph\u2029separator, next-line\x85 and form-feed\x0c inside"


def _write(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert "\u2028" in path.read_text(encoding="utf-8")  # raw, as datatrove writes it
    return path


def test_text_source_and_eval_selection_keep_unicode_line_separators(tmp_path):
    p = _write(tmp_path / "a.jsonl", [{"id": 1, "text": "first " + SEPARATORS}, {"id": 2, "text": "second"}])
    assert read_text_source(TextSource(path=str(p))) == ["first " + SEPARATORS, "second"]
    ev = EvalSet(name="e", source=TextSource(path=str(p)), id_field="id", ids=((1, 1),))
    assert selected_texts(ev) == ["first " + SEPARATORS]


def test_other_project_readers_keep_unicode_line_separators(tmp_path):
    from domains.gsm8k import read_gsm8k
    from rl.envs.swe_repair import load_instances
    from training.metrics import read

    g = _write(tmp_path / "gsm8k.jsonl", [{"question": "Q " + SEPARATORS, "answer": "2 + 2 = 4\n#### 4"}])
    (problem,) = read_gsm8k(g)
    assert problem.question == "Q " + SEPARATORS and problem.answer == "4"
    inst = {"task_id": 1, "buggy": "x", "tests": "y", "fail_to_pass": [], "pass_to_pass": [], "text": SEPARATORS}
    assert load_instances(_write(tmp_path / "swe.jsonl", [inst])) == [inst]
    m = _write(tmp_path / "metrics.jsonl", [{"step": 1, "note": SEPARATORS}, {"step": 2}])
    assert read(m) == [{"step": 1, "note": SEPARATORS}, {"step": 2}]
