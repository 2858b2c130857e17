"""The typer apps, through typer's CliRunner."""

import json

import pytest
from typer.testing import CliRunner

from glmforge.cli_model import eval_app, model_app, resolve_model_dir

runner = CliRunner()


def test_model_info_json():
    r = runner.invoke(model_app, ["info", "--preset", "glm5", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert round(s["total_params"] / 1e9, 1) == 743.9 and round(s["active_params"] / 1e9, 1) == 40.8
    for key in ("total_params_with_mtp", "active_params_with_embedding", "flops_per_token", "kv_cache_bytes_per_token"):
        assert key in s
    r = runner.invoke(model_app, ["info", "--preset", "nope"])
    assert r.exit_code != 0 and "unknown model preset" in r.output


def _tokenizer(tmp_path, text):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    return d


def test_export_then_perplexity(tmp_path, quiet_transformers):
    text = "def add(a, b):\n    return a + b\n" * 20
    tok = _tokenizer(tmp_path, text)
    out = tmp_path / "model"
    r = runner.invoke(model_app, ["export", "--preset", "tiny", "--init", "random", "--seed", "1",
                                  "--out", str(out), "--tokenizer", str(tok)])
    assert r.exit_code == 0, r.output
    assert (out / "config.json").exists() and (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    (tmp_path / "eval.jsonl").write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": "x = 1"}) + "\n")
    r = runner.invoke(eval_app, ["perplexity", "--model", str(out), "--input", str(tmp_path / "eval.jsonl"), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["documents"] == 2 and res["tokens"] > 10
    assert 100 < res["perplexity"] < 3 * 8192   # an untrained model: roughly uniform over the vocab
    # without a tokenizer the error names the missing file
    (out / "tokenizer.json").unlink()
    (tmp_path / "eval.txt").write_text(text)
    r = runner.invoke(eval_app, ["perplexity", "--model", str(out), "--input", str(tmp_path / "eval.txt")])
    assert r.exit_code != 0 and "tokenizer.json" in r.output


def test_resolve_model_dir(tmp_path, monkeypatch):
    from runtime.store import LocalStore

    assert resolve_model_dir(tmp_path) == tmp_path
    monkeypatch.setenv("GLMFORGE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GLMFORGE_STORE", str(tmp_path / "store"))
    with pytest.raises(ValueError, match="no artifact of stage 'sft'"):
        resolve_model_dir("sft")
    with pytest.raises(ValueError, match="model folder missing does not exist"):
        resolve_model_dir("missing")  # no such folder, and no stage of that name
    art = tmp_path / "art"
    (art / "hf").mkdir(parents=True)
    (art / "hf" / "config.json").write_text("{}")
    m = LocalStore(tmp_path / "store").publish("pretrain", "k1", art)
    resolved = resolve_model_dir("pretrain/k1")
    assert resolved.name == "hf" and (resolved / "config.json").read_text() == "{}"
    assert resolve_model_dir(LocalStore(tmp_path / "store").artifact_uri("pretrain", "k1")) == resolved
    with pytest.raises(ValueError, match="no published artifact pretrain/nope"):
        resolve_model_dir("pretrain/nope")
    assert m.files
