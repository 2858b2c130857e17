"""`model export` writes a tokenizer AutoTokenizer loads; `eval perplexity` reads its input like
`glmforge curate` (--text-field / --text-template)."""

import json


def test_export_writes_a_tokenizer_autotokenizer_loads(tmp_path, quiet_transformers):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from glmforge.cli_model import default_tokenizer, model_app

    runner = CliRunner()
    out = tmp_path / "default"
    r = runner.invoke(model_app, ["export", "--preset", "tiny", "--init", "random", "--out", str(out)])
    assert r.exit_code == 0, r.output
    tok = AutoTokenizer.from_pretrained(out)
    text = "To be, or not to be: that is the question. <think>x</think> 3+4=7 🙂"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text.encode())  # byte-level BPE, trained merges
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>" and tok.convert_tokens_to_ids("<think>") == 6
    assert len(tok) == 8192  # the tokenize stage's default vocab, = the tiny model's embedding rows
    # the default is the deterministic training on the shipped sample, not a stored file
    assert Tokenizer.from_file(str(out / "tokenizer.json")).to_str() == default_tokenizer(8192).to_str()

    # a given (trained) tokenizer is the one exported
    small = default_tokenizer(400)
    (tmp_path / "tok").mkdir()
    small.save(str(tmp_path / "tok" / "tokenizer.json"))
    out2 = tmp_path / "given"
    r = runner.invoke(model_app, ["export", "--preset", "tiny", "--init", "random", "--out", str(out2),
                                  "--tokenizer", str(tmp_path / "tok")])
    assert r.exit_code == 0, r.output
    assert len(AutoTokenizer.from_pretrained(out2)) == 400
    assert (out2 / "tokenizer.json").read_text() == (tmp_path / "tok" / "tokenizer.json").read_text()


def test_perplexity_text_field_and_template(tmp_path, quiet_transformers):
    from typer.testing import CliRunner

    from glmforge.cli_model import eval_app, model_app

    runner = CliRunner()
    out = tmp_path / "model"
    assert runner.invoke(model_app, ["export", "--preset", "tiny", "--init", "random", "--out", str(out)]).exit_code == 0
    rows = [{"id": i, "q": f"What is {i} + {i}?", "a": f"It is {2 * i}."} for i in range(4)]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": f"Q: {r['q']}\nA: {r['a']}"}) + "\n" for r in rows))
    (tmp_path / "body.jsonl").write_text("".join(json.dumps({"body": r["q"]}) + "\n" for r in rows))
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"text": r["q"]}) + "\n" for r in rows))

    def ppl(*args):
        r = runner.invoke(eval_app, ["perplexity", "--model", str(out), "--json", *args])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)

    templated = ppl("--input", str(tmp_path / "qa.jsonl"), "--text-template", "Q: {q}\nA: {a}")
    assert templated == ppl("--input", str(tmp_path / "text.jsonl"))
    assert templated["documents"] == 4
    assert ppl("--input", str(tmp_path / "body.jsonl"), "--text-field", "body") == ppl("--input", str(tmp_path / "q.jsonl"))
    # a record without the field: the error names the file and line
    with open(tmp_path / "body.jsonl", "a") as f:
        f.write(json.dumps({"title": "no body"}) + "\n")
    r = runner.invoke(eval_app, ["perplexity", "--model", str(out), "--input", str(tmp_path / "body.jsonl"),
                                 "--text-field", "body"])
    assert r.exit_code == 2 and "body.jsonl:5" in r.output and "'body'" in r.output
