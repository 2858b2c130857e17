from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_processing.document import read_documents
from data_processing.ingest import IngestConfig, run
from runtime.stage import Workdir


def _cfg(**src):
    return IngestConfig(sources=[{"name": "t", **src}], shard_size=2)


def _run(cfg, tmp_path):
    wd = Workdir.at(tmp_path / "wd")
    metrics = run(cfg, {}, wd)
    quarantine = [json.loads(l) for l in (wd.out / "quarantine.jsonl").read_text().splitlines()]
    return metrics, list(read_documents(wd.out)), quarantine


def test_mixed_good_and_bad_jsonl(tmp_path):
    f = tmp_path / "in.jsonl"
    lines = [
        b'{"text": "first good", "lang": "en"}',
        b'{"text": ',                                   # 2: invalid JSON
        b'{"body": "no text"}',                         # 3: missing text
        b'{"text": 42}',                                # 4: non-string
        b'{"text": "caf\xe9"}',                         # 5: invalid UTF-8 (latin-1 byte)
        b'{"text": "   \\n  "}',                        # 6: empty after normalization
        b'[1, 2]',                                      # 7: not an object
        b'',                                            # blank line: not a record
        b'{"text": "second\\r\\ngood  "}',              # 9
    ]
    f.write_bytes(b"\n".join(lines) + b"\n")
    metrics, docs, quarantine = _run(_cfg(path=str(f)), tmp_path)
    assert [d.text for d in docs] == ["first good", "second\ngood"]
    assert docs[0].id == "t/in.jsonl#L1" and docs[0].metadata["fields"] == {"lang": "en"}
    assert [(q["line"], q["reason"].split(":")[0]) for q in quarantine] == [
        (2, "invalid_json"), (3, "missing_text"), (4, "non_string_text"), (5, "invalid_utf8"),
        (6, "empty_text"), (7, "not_object"),
    ]
    assert all(q["file"].endswith("in.jsonl") for q in quarantine)
    assert quarantine[3]["raw_base64"]  # the undecodable bytes are kept, not lost
    assert metrics["documents"] == 2 and metrics["quarantined"] == 6
    assert metrics["quarantine_reasons"]["invalid_json"] == 1


def test_parquet_and_text_folders(tmp_path):
    pq.write_table(pa.table({"text": ["a", None, "c"], "id": [1, 2, 3]}), tmp_path / "x.parquet")
    m, docs, q = _run(_cfg(path=str(tmp_path / "x.parquet"), id_field="id"), tmp_path / "p")
    assert [d.id for d in docs] == ["t/1", "t/3"] and q[0]["line"] == 2

    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.py").write_text("print(1)\n")
    (folder / "sub" / "b.py").write_text("print(2)\n")
    (folder / "c.txt").write_text("skip me")
    m, docs, q = _run(_cfg(path=str(folder), include="*.py"), tmp_path / "t")
    assert [d.id for d in docs] == ["t/a.py", "t/sub/b.py"] and not q


def test_text_split_and_template(tmp_path):
    (tmp_path / "play.txt").write_text("ROMEO:\nHi.\n\nJULIET:\nHello.\n\n\n")
    _, docs, _ = _run(_cfg(path=str(tmp_path / "play.txt"), split_on="\n\n"), tmp_path / "a")
    assert [(d.text, d.metadata["line"]) for d in docs] == [("ROMEO:\nHi.", 1), ("JULIET:\nHello.", 4)]
    (tmp_path / "qa.jsonl").write_text('{"q": "1+1?", "a": "2"}\n{"q": "x"}\n')
    _, docs, q = _run(_cfg(path=str(tmp_path / "qa.jsonl"), text_template="Q: {q}\nA: {a}"), tmp_path / "b")
    assert [d.text for d in docs] == ["Q: 1+1?\nA: 2"] and "'a'" in q[0]["reason"]


def test_missing_input_is_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="ingest source 't'.*does-not-exist"):
        _run(_cfg(path=str(tmp_path / "does-not-exist.jsonl")), tmp_path)


def test_resume_after_crash_gives_identical_shards(tmp_path, monkeypatch):
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" if i % 7 else "bad\n" for i in range(1, 40)))
    cfg = _cfg(path=str(f))
    clean = Workdir.at(tmp_path / "clean")
    run(cfg, {}, clean)

    import data_processing.ingest as ingest

    crashed = Workdir.at(tmp_path / "crashed")
    real, calls = ingest._save_cursor, {"n": 0}

    def crash_on_fifth(path, c):
        real(path, c)
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt("simulated kill")

    monkeypatch.setattr(ingest, "_save_cursor", crash_on_fifth)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, {}, crashed)
    monkeypatch.setattr(ingest, "_save_cursor", real)
    # The killed attempt also wrote records past its checkpoint; resume must not duplicate them.
    with open(crashed.checkpoint / "quarantine.jsonl", "a") as q:
        q.write('{"partial": true}\n')
    metrics = run(cfg, {}, crashed)
    for name in ["quarantine.jsonl"] + [p.name for p in sorted(clean.out.glob("part-*.parquet"))]:
        assert (crashed.out / name).read_bytes() == (clean.out / name).read_bytes(), name
    assert metrics["documents"] == 34 and metrics["quarantined"] == 5


def test_ingest_from_s3_prefix(s3_env, seaweedfs, tmp_path):
    client = seaweedfs["_client"]
    client.put_object(Bucket=s3_env, Key="raw/a.jsonl", Body=b'{"text": "from s3"}\n{"text": ""}\n')
    client.put_object(Bucket=s3_env, Key="raw/b.jsonl", Body=b'{"text": "second file"}\n')
    metrics, docs, quarantine = _run(_cfg(path=f"s3://{s3_env}/raw/"), tmp_path)
    assert [d.text for d in docs] == ["from s3", "second file"]
    assert quarantine[0]["file"] == f"s3://{s3_env}/raw/a.jsonl" and quarantine[0]["line"] == 2
    with pytest.raises(FileNotFoundError, match="no objects"):
        _run(_cfg(path=f"s3://{s3_env}/missing/"), tmp_path / "m")


def test_repo_sources_record_repo_and_path(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
    _, docs, _ = _run(_cfg(path=str(tmp_path), include="*.py", repo="acme/widgets"), tmp_path / "w")
    assert docs[0].metadata["repo"] == "acme/widgets" and docs[0].metadata["path"] == "pkg/mod.py"


def test_keep_ids(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"id": "doc-a", "text": "first", "lang": "en"},
        {"text": "no id here"},
        {"id": 7, "text": "integer id"},
        {"id": {"x": 1}, "text": "object id"},  # 4: quarantined, not silently renamed
        {"id": "", "text": "empty id"},  # 5
    ]) + "\n")
    m, docs, q = _run(_cfg(path=str(f), keep_ids=True), tmp_path)
    assert [d.id for d in docs] == ["doc-a", "t/in.jsonl#L2", "7"]
    assert docs[0].metadata["fields"] == {"lang": "en"}  # the id is not repeated in metadata
    assert [(r["line"], r["reason"].split(":")[0]) for r in q] == [(4, "bad_id"), (5, "bad_id")]


def test_keep_ids_duplicate_names_both_lines(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n{"id": "a", "text": "z"}\n')
    with pytest.raises(ValueError, match=r"duplicate id 'a' at .*in\.jsonl:3, first seen at .*in\.jsonl:1"):
        _run(_cfg(path=str(f), keep_ids=True), tmp_path)


def test_keep_ids_duplicate_across_a_resume(tmp_path):
    """The seen ids survive a resume: they are rebuilt from the shards the killed run kept."""
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"id": f"d{i}", "text": f"t{i}"}) + "\n" for i in range(4)))
    wd = Workdir.at(tmp_path / "wd")
    run(_cfg(path=str(f), keep_ids=True), {}, wd)  # 2 shards of 2; the cursor now says done
    cursor = wd.checkpoint / "cursor.json"
    c = json.loads(cursor.read_text())
    c.update(source=0, file=0, consumed=2, shard=1)  # as if killed after the first shard
    cursor.write_text(json.dumps(c))
    with open(f, "a") as fh:  # lines 3-4 get re-read; line 5 repeats an id from shard 0
        fh.write(json.dumps({"id": "d0", "text": "again"}) + "\n")
    with pytest.raises(ValueError, match=r"duplicate id 'd0' at .*in\.jsonl:5, first seen at in\.jsonl:1"):
        run(_cfg(path=str(f), keep_ids=True), {}, wd)


def test_keep_ids_off_leaves_the_config_dump_unchanged():
    # the stage key hashes the dump: configs that do not use keep_ids keep their keys
    assert "keep_ids" not in _cfg(path="x").model_dump(mode="json")["sources"][0]
    assert _cfg(path="x", keep_ids=True).model_dump(mode="json")["sources"][0]["keep_ids"] is True



# ---- JSONL files read whole by Arrow (keep_ids sources, as `glmforge curate` reads its input)
_FAST_CASES = {
    # taken by the fast path: every record a document
    "plain": ['{"id": "a", "text": "one"}', '{"id": "b", "text": "two words"}', '{"id": "c", "text": "3"}'],
    "normalized": [json.dumps({"id": "a", "text": "ends in a newline\n"}),
                   json.dumps({"id": "b", "text": "crlf\r\nand cr\rend \t\x0c\x1c"}),
                   json.dumps({"id": "c", "text": "nfd e\u0301, ideographic space\u3000"}, ensure_ascii=False),
                   json.dumps({"id": "d", "text": "emoji \U0001F600 \\ \" \u2028\x00"}),
                   json.dumps({"id": "e", "text": "a\xa0"}, ensure_ascii=False)],
    # not taken: the per-record path quarantines, names lines and fails as always
    "blank line": ['{"id": "a", "text": "one"}', "", '{"id": "b", "text": "two"}'],
    "two on a line": ['{"id": "a", "text": "one"} {"id": "b", "text": "two"}', '{"id": "c", "text": "x",',
                      '"more": 1}'],
    "extra field": ['{"id": "a", "text": "one", "lang": "en"}'],
    "no id": ['{"text": "one"}', '{"id": null, "text": "two"}'],
    "int id": ['{"id": 1, "text": "one"}'],
    "empty text": ['{"id": "a", "text": " \\n "}', '{"id": "b", "text": "two"}'],
    "repeated key": ['{"id": "a", "text": "one", "text": "two"}'],
    "lone surrogate": ['{"id": "a", "text": "\\ud800"}', '{"id": "b", "text": "two"}'],
    "bad json": ['{"id": "a", "text": "one"}', '{"id": "b", "text": '],
    "crlf file": ['{"id": "a", "text": "one"}\r', '{"id": "b", "text": "two"}\r'],
    "invalid utf-8": b'{"id": "a", "text": "caf\xe9"}\n{"id": "b", "text": "two"}\n',
    "bom": "\ufeff" + '{"id": "a", "text": "one"}',
}


@pytest.mark.parametrize("case", sorted(_FAST_CASES))
def test_jsonl_read_whole_gives_what_the_per_record_path_gives(tmp_path, monkeypatch, case):
    """Shards, quarantine, metrics and cursor byte for byte, with and without the fast path; files
    with anything but plain records go the per-record way."""
    from data_processing import ingest

    folder = tmp_path / "in"
    folder.mkdir()
    body = _FAST_CASES[case]
    if isinstance(body, bytes):
        (folder / "a.jsonl").write_bytes(body)
    else:
        (folder / "a.jsonl").write_text((body if isinstance(body, str) else "\n".join(body)) + "\n", encoding="utf-8")
    (folder / "b.jsonl").write_text("".join(json.dumps({"id": f"b{i}", "text": f"doc {i} "}) + "\n"
                                            for i in range(5)), encoding="utf-8")
    cfg = IngestConfig(sources=[{"name": "t", "path": str(folder), "keep_ids": True}], shard_size=3)

    def outcome(name):
        wd = Workdir.at(tmp_path / name)
        try:
            result = run(cfg, {}, wd)
        except ValueError as e:
            result = str(e)
        files = {p.relative_to(wd.out.parent).as_posix(): p.read_bytes() for p in sorted(wd.out.parent.rglob("*"))
                 if p.is_file()}
        return result, files

    taken = []
    real = ingest._jsonl_rows
    monkeypatch.setattr(ingest, "_jsonl_rows", lambda *a: taken.append(real(*a) is not None) or real(*a))
    fast = outcome("fast")
    monkeypatch.setattr(ingest, "fast_path_source", lambda src: False)
    assert outcome("slow") == fast
    assert taken[0] == (case in ("plain", "normalized"))
    assert taken[1:] == ([True] if isinstance(fast[0], dict) else [])  # an error stops the run at a.jsonl


def test_jsonl_read_whole_keeps_ids_unique_across_files(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"id": "x", "text": "one"}\n{"id": "y", "text": "two"}\n')
    (folder / "b.jsonl").write_text('{"id": "z", "text": "three"}\n{"id": "y", "text": "again"}\n')
    with pytest.raises(ValueError, match=r"duplicate id 'y' at .*b\.jsonl:2, first seen at .*a\.jsonl:2"):
        _run(_cfg(path=str(folder), keep_ids=True), tmp_path)


def test_jsonl_read_whole_resumes_to_identical_shards(tmp_path, monkeypatch):
    """Killed after a shard inside a file read whole, the run resumes record by record from the
    cursor and ends with the same shards and cursor as an uninterrupted one."""
    from data_processing import ingest

    folder = tmp_path / "in"
    folder.mkdir()
    for k in range(2):
        (folder / f"p{k}.jsonl").write_text("".join(json.dumps({"id": f"{k}-{i}", "text": f"doc {k} {i}\n"}) + "\n"
                                                   for i in range(7)))
    cfg = IngestConfig(sources=[{"name": "t", "path": str(folder), "keep_ids": True}], shard_size=3)
    clean = Workdir.at(tmp_path / "clean")
    run(cfg, {}, clean)

    crashed = Workdir.at(tmp_path / "crashed")
    real, calls = ingest._save_cursor, {"n": 0}

    def crash_on_third(path, c):
        real(path, c)
        calls["n"] += 1
        if calls["n"] == 3:  # after the third shard (p0.jsonl's last row, p1.jsonl's first two)
            raise KeyboardInterrupt("simulated kill")

    monkeypatch.setattr(ingest, "_save_cursor", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, {}, crashed)
    monkeypatch.setattr(ingest, "_save_cursor", real)
    assert json.loads((crashed.checkpoint / "cursor.json").read_text())["consumed"] == 2
    assert run(cfg, {}, crashed) == run(cfg, {}, Workdir.at(tmp_path / "again"))
    for p in sorted(clean.out.iterdir()):
        assert (crashed.out / p.name).read_bytes() == p.read_bytes(), p.name
    assert (crashed.checkpoint / "cursor.json").read_bytes() == (clean.checkpoint / "cursor.json").read_bytes()
