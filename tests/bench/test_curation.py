"""bench/curation.py's corpus and JSONL handling (the bench itself is not run by the tests)."""
import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "curation.py"


def _bench():
    sys.path.insert(0, str(SCRIPT.parent))           # as when run as a script: bench/machine.py
    spec = importlib.util.spec_from_file_location("bench_curation", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_jsonl_records_keep_unicode_line_separators(tmp_path):
    """datatrove writes U+2028 unescaped inside JSON strings (GSM8K train doc 2381 has one)."""
    recs = [{"id": "a", "text": "x\u2028y\u2029z"}, {"id": "b", "text": "plain"}]
    p = tmp_path / "out.jsonl"
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    assert _bench().jsonl_records(p) == recs


def test_corpus_is_the_standard_library_proper_and_has_a_digest():
    b = _bench()
    srcs = b.stdlib_sources()
    assert srcs and not any({"site-packages", "dist-packages"} & set(p.parts) for p in srcs)
    docs = [("a", "one"), ("b", "two")]
    assert b.corpus_digest(docs) == b.corpus_digest(list(docs)) != b.corpus_digest([("a", "onet"), ("b", "wo")])
