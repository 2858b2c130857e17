"""`glmforge curate` as a user types it (typer's CliRunner on the real app): ids and metadata."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
from typer.testing import CliRunner

from data_processing.common import SAMPLES_DIR
from glmforge.cli import app

runner = CliRunner()


def _gsm8k_records(n: int) -> list[dict]:
    lines = (SAMPLES_DIR / "gsm8k" / "train.jsonl").read_text().splitlines()[:n]
    return [json.loads(l) for l in lines]


def _curate(*args: str):
    return runner.invoke(app, ["curate", *args])


def test_user_ids_survive_to_the_output(tmp_path):
    recs = _gsm8k_records(4)
    rows = [{"id": "q-alpha", "text": recs[0]["question"], "grade": 3},
            {"text": recs[1]["question"]},  # no id: file#line
            {"id": 42, "text": recs[2]["question"]},
            {"id": "q-dup-text", "text": recs[0]["question"]}]  # removed by dedup-exact
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "kept.jsonl"
    r = _curate("dedup-exact", "--input", str(src), "--output", str(out))
    assert r.exit_code == 0, r.output
    kept = [json.loads(l) for l in out.read_text().splitlines()]
    assert [k["id"] for k in kept] == ["q-alpha", "docs/docs.jsonl#L2", "42"]
    assert kept[0]["metadata"]["fields"] == {"grade": 3}
    # the removed duplicate keeps its own id too
    removed = pq.read_table(tmp_path / "kept.jsonl.files" / "removed" / "part-00000.parquet").to_pylist()
    assert [d["id"] for d in removed] == ["q-dup-text"]


def test_duplicate_user_id_is_a_clear_error(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"id": "a", "text": "one"}\n{"id": "b", "text": "two"}\n{"id": "a", "text": "three"}\n')
    r = _curate("dedup-exact", "--input", str(src), "--output", str(tmp_path / "kept.jsonl"))
    assert r.exit_code == 2
    assert "duplicate id 'a'" in r.output and "docs.jsonl:3" in r.output and "docs.jsonl:1" in r.output
    assert not (tmp_path / "kept.jsonl").exists()


def test_issue_pr_metadata_is_a_json_object(tmp_path):
    issues = str(SAMPLES_DIR / "github_issues" / "hf_datasets_issues_5634-6249.jsonl")
    for name in ("kept.jsonl", "kept.parquet"):
        r = _curate("issue-pr", "--input", issues, "--output", str(tmp_path / name))
        assert r.exit_code == 0, r.output
    rows = [json.loads(l) for l in (tmp_path / "kept.jsonl").read_text().splitlines()]
    assert len(rows) > 10
    for row in rows:  # JSONL: an object in place; parse it back from its own JSON text too
        assert isinstance(row["metadata"], dict)
        assert json.loads(json.dumps(row["metadata"])) == {"instance_id": row["metadata"]["instance_id"], "repo": "huggingface/datasets"}
        assert row["id"].startswith(row["metadata"]["instance_id"] + "-issue")
    table = pq.read_table(tmp_path / "kept.parquet").to_pylist()
    assert [t["id"] for t in table] == [r["id"] for r in rows]
    for t, row in zip(table, rows):  # Parquet: the shard schema's metadata column is JSON text
        assert json.loads(t["metadata"]) == row["metadata"]


def _one_error_line(r) -> str:
    assert r.exit_code == 2, r.output
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_every_record_quarantined_names_the_reasons_and_writes_nothing(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": ""}\n{"text": 5}\n{"text": "   "}\n')
    r = _curate("dedup-exact", "--input", str(src), "--output", str(tmp_path / "out" / "kept.jsonl"))
    line = _one_error_line(r)
    assert "every record was quarantined (empty_text 2, non_string_text 1)" in line
    assert f"first at {src}:1: field 'text' is empty after normalization" in line
    assert "part-" not in line
    assert not (tmp_path / "out").exists()


def test_a_missing_text_field_names_the_fields_there_and_the_option(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"title": "one", "body": "first"}\n{"title": "two", "body": "second"}\n')
    r = _curate("dedup-exact", "--input", str(src), "--output", str(tmp_path / "out"))
    line = _one_error_line(r)
    assert "every record was quarantined (missing_text 2)" in line
    assert f"first at {src}:1: missing field 'text' (its fields: 'title', 'body')" in line
    assert "--text-field" in line
    assert not (tmp_path / "out").exists()
    # the option it names is the way out
    r = _curate("dedup-exact", "--input", str(src), "--output", str(tmp_path / "out"), "--text-field", "body")
    assert r.exit_code == 0, r.output


def test_a_curation_step_loads_only_what_it_needs(tmp_path):
    """The step's section alone is read from the preset (glmforge.config.preset_section): the CLI
    never imports the training stack that the whole pipeline's config model pulls in."""
    import subprocess
    import sys

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": r["question"]}) + "\n" for r in _gsm8k_records(20)))
    probe = ("import sys\nfrom glmforge.cli import main\n"
             f"sys.argv = ['glmforge', 'curate', 'dedup-minhash', '-i', {str(src)!r}, '-o', {str(tmp_path / 'k.jsonl')!r}]\n"
             "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
             "print(sorted(m for m in ('torch', 'deepspeed', 'model', 'training', 'posttrain', 'rl') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert len((tmp_path / "k.jsonl").read_text().splitlines()) == 20


def test_kept_jsonl_lines_and_what_stays_compressed(tmp_path):
    """The kept JSONL is json.dumps(ensure_ascii=False) of each field, whatever the characters;
    the scratch shards of a file output are uncompressed, but the shards a user gets (a folder
    output, removed/ beside a file) stay zstd."""
    texts = ['quotes " and \\ backslash', "controls \x00\x01\x08\x0c\t\x1f end",
             "unicode é 日本 \U0001F600 \u2028 \x7f", "plain text " * 20, "plain text " * 20 + "!"]  # last two: near-duplicates
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "kept.jsonl"
    r = _curate("dedup-minhash", "--input", str(src), "--output", str(out))
    assert r.exit_code == 0, r.output
    lines = out.read_text(encoding="utf-8").split("\n")[:-1]  # not splitlines(): U+2028
    assert lines == [f'{{"id": {json.dumps(f"d{i}")}, "text": {json.dumps(t.rstrip(), ensure_ascii=False)}, '
                     f'"source": "docs", "metadata": {json.dumps({"file": "docs.jsonl", "line": i + 1})}}}'
                     for i, t in enumerate(texts[:4])]
    removed = tmp_path / "kept.jsonl.files" / "removed" / "part-00000.parquet"
    assert pq.ParquetFile(removed).metadata.row_group(0).column(1).compression == "ZSTD"
    r = _curate("dedup-minhash", "--input", str(src), "--output", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    for p in [tmp_path / "out" / "part-00000.parquet", tmp_path / "out" / "removed" / "part-00000.parquet"]:
        assert pq.ParquetFile(p).metadata.row_group(0).column(1).compression == "ZSTD"
