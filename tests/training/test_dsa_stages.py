"""dsa-warmup and dsa-adapt end to end on 1 CPU rank (torchrun, gloo) with a random-init tiny
model standing in for context-3: only the indexer trains in the warm-up (KL down, recall up),
the adaptation attends to the top-k keys, resumes from a checkpoint, and publishes the
full / dsa / swa comparison table."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from data_processing.document import ShardWriter
from data_processing.tokenizer import EOS, TOKENIZER_FILE
from evals import long_context
from runtime.stage import Workdir
from model.config import preset
from model.hf import load_state, save_state
from model.model import GLMModel
from tests.training.conftest import MODEL_OVERRIDES, stdlib_docs
from training import checkpoint, dsa, metrics
from training.config import ContextConfig
from glmforge.pipeline import TRAINING
from training.dsa import (DsaAdaptConfig, DsaDataConfig, DsaWarmupConfig, LongEvalConfig,
                          run_adapt, run_warmup)
from training.dsa_loss import SparseAdaptation
from training.objectives import DsaSparseSpec

SEQ, EVAL_LEN = 128, 96          # index_topk is 32: every evaluated row is genuinely sparse
COMMON = dict(seq_len=SEQ, micro_batch_size=2, checkpoint_every=2, eval_sequences=4, val_fraction=0.1,
              launch={"nproc_per_node": 1},
              retrieval={"lengths": [EVAL_LEN], "docs_per_task": 2, "tasks": ["single_key"]})
EXACT = ("tokens", "loss", "lm", "mtp", "balance", "kl", "lr", "grad_norm")


def warmup_config(**kw) -> DsaWarmupConfig:
    return DsaWarmupConfig(**{**COMMON, "max_steps": 8, "lr": 1e-2, "probe_sequences": 4, **kw})


def adapt_config(**kw) -> DsaAdaptConfig:
    return DsaAdaptConfig(**{**COMMON, "max_steps": 4, "lr": 3e-3, "optimizer": "adamw",
                             "long_eval": {"lengths": [EVAL_LEN], "n_per_task": 1, "tasks": ["single_key"]}, **kw})


@pytest.fixture(scope="module")
def parents(packed, tmp_path_factory) -> dict[str, Path]:
    """context-3 (a seeded random-init tiny model), decontaminate (stdlib modules), tokenize."""
    root = tmp_path_factory.mktemp("dsa-parents")
    w = ShardWriter(root / "decontaminate", 100)
    w.write_all(stdlib_docs(40))
    w.close()
    torch.manual_seed(0)
    (root / "context-3").mkdir()
    save_state(GLMModel(preset("tiny", **MODEL_OVERRIDES, vocab_size=512)), root / "context-3" / "consolidated.safetensors")
    return {"context-3": root / "context-3", "decontaminate": root / "decontaminate", "tokenize": packed["tokenize"]}


@pytest.fixture(scope="module")
def warmup(parents, tmp_path_factory):
    wd = Workdir.at(tmp_path_factory.mktemp("dsa-warmup"), seed=3)
    return wd, run_warmup(warmup_config(), parents, wd)


@pytest.fixture(scope="module")
def adapt(parents, warmup, tmp_path_factory):
    wd = Workdir.at(tmp_path_factory.mktemp("dsa-adapt"), seed=3)
    inputs = {**parents, "dsa-warmup": warmup[0].out}
    return wd, inputs, run_adapt(adapt_config(), inputs, wd)


# ---------------------------------------------------------------- warm-up
def test_warmup_trains_only_the_indexer(parents, warmup):
    wd, result = warmup
    before = load_file(str(parents["context-3"] / "consolidated.safetensors"))
    after = load_file(str(wd.out / "consolidated.safetensors"))
    assert before.keys() == after.keys()
    frozen = [k for k in before if ".indexer." not in k]
    trained = [k for k in before if ".indexer." in k and not k.startswith("mtp.")]
    assert frozen and trained
    assert all(torch.equal(before[k], after[k]) for k in frozen), [k for k in frozen if not torch.equal(before[k], after[k])]
    assert all(not torch.equal(before[k], after[k]) for k in trained if k.endswith("wq_b.weight"))
    # frozen dense model: the held-out LM loss cannot move
    assert result["val_loss_before"] == result["val_loss_after"]
    assert load_state(wd.out / "consolidated.safetensors").config.dense_attention


def test_warmup_lowers_kl_and_raises_topk_recall(warmup):
    _, result = warmup
    assert result["steps"] == 8 and result["retrieval_documents"] == 2
    assert result["kl_last"] < result["kl_first"]
    assert result["heldout_kl_after"] < result["heldout_kl_before"]
    assert result["heldout_recall_after"] > result["heldout_recall_before"]
    assert result["heldout_recall_sparse_rows_after"] > result["heldout_recall_sparse_rows_before"]


# ---------------------------------------------------------------- adaptation
def test_adapt_attends_to_the_indexers_topk(adapt):
    wd, _, result = adapt
    model = load_state(wd.out / "consolidated.safetensors").eval()
    assert not model.config.dense_attention and model.config.index_topk == 32 < SEQ
    ids = torch.randint(0, 512, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sparse, dense = model(ids).logits, model(ids, dense_attention=True).logits
    # rows with at most index_topk keys select all of them (same values, another kernel);
    # later rows see only the selected keys
    assert torch.allclose(sparse[:, :32], dense[:, :32], atol=1e-5)
    assert (sparse[:, 40:] - dense[:, 40:]).abs().max() > 1e-4
    # the step log carries the sparse indexer KL (sparse_indexer_loss rejects a dense forward)
    records = metrics.read(wd.checkpoint / "dsa" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(r["kl"] > 0 for r in records)


def test_adapt_publishes_the_comparison(adapt):
    wd, inputs, result = adapt
    acc = result["long_context_accuracy"]
    assert set(acc) == {"full", "dsa", "swa"}
    # the published numbers are the scores of the published weights on the configured suite
    tok = Tokenizer.from_file(str(inputs["tokenize"] / TOKENIZER_FILE))
    suite = long_context.generate_suite(tok, [EVAL_LEN], 1, 0, long_context.default_filler_texts(), ["single_key"])
    for name, out in {"dsa": wd.out, "full": wd.out / "full", "swa": wd.out / "swa"}.items():
        got = long_context.evaluate(load_state(out / "consolidated.safetensors").eval(), tok, suite)
        assert acc[name] == {EVAL_LEN: got["overall"][EVAL_LEN]} == result["long_context_by_task"][name]["overall"]
    assert json.loads((wd.out / "long_context.json").read_text())["accuracy"] == {
        name: {str(EVAL_LEN): by_len[EVAL_LEN]} for name, by_len in acc.items()}
    # same base, data and budget for all three
    assert result["baselines"]["full"]["tokens"] == result["baselines"]["swa"]["tokens"] == result["tokens"]
    assert result["warmup_recall_after"] > result["warmup_recall_before"]
    assert (wd.out / "hf" / "config.json").is_file() and (wd.out / "full" / "hf" / "config.json").is_file()
    swa = load_state(wd.out / "swa" / "consolidated.safetensors").config
    assert swa.layer_kinds == ("full", "swa") and swa.sliding_window == result["swa_window"] == EVAL_LEN // 4
    assert load_state(wd.out / "full" / "consolidated.safetensors").config.dense_attention


def test_adapt_resumes_from_a_checkpoint(adapt, tmp_path):
    wd, inputs, _ = adapt
    want = metrics.read(wd.checkpoint / "dsa" / "metrics.jsonl")
    shutil.copytree(wd.checkpoint, tmp_path / "checkpoint")
    again = Workdir.at(tmp_path, seed=3)
    # a crash while the last checkpoint was being written: no COMPLETE marker
    (again.checkpoint / "dsa" / checkpoint.tag_for(4) / checkpoint.MARKER).unlink()
    result = run_adapt(adapt_config(baselines=()), inputs, again)
    assert result["resumed_from_step"] == 2
    got = metrics.read(again.checkpoint / "dsa" / "metrics.jsonl")
    assert [{k: r[k] for k in EXACT} for r in got] == [{k: r[k] for k in EXACT} for r in want]
    assert set(result["long_context_accuracy"]) == {"dsa"}


# ---------------------------------------------------------------- units
def test_sparse_objective_trains_indexer_on_kl_and_trunk_on_lm():
    torch.manual_seed(0)
    model = GLMModel(preset("tiny", **MODEL_OVERRIDES, vocab_size=512))
    ids = torch.randint(0, 512, (2, 64))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    batch = {"input_ids": ids, "labels": labels, "doc_ids": torch.zeros_like(ids)}

    def grads(coeff: float) -> dict[str, torch.Tensor]:
        model.zero_grad()
        loss, parts = SparseAdaptation(indexer_loss_coeff=coeff).loss(model, batch)
        loss.backward()
        assert parts["kl"] > 0 and parts["loss"] == pytest.approx(parts["lm"] + parts["mtp"] + parts["balance"], rel=1e-5)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    one, two = grads(1.0), grads(2.0)
    indexer = [n for n in one if ".indexer." in n and not n.startswith("mtp.")]
    trunk = [n for n in one if ".indexer." not in n]
    assert indexer and trunk
    assert all(torch.equal(one[n], two[n]) for n in trunk)            # LM only: coeff-independent
    assert all(torch.allclose(2 * one[n], two[n], atol=1e-7) for n in indexer)  # KL only


def test_configs_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="below seq_len"):
        DsaDataConfig(seq_len=128, retrieval={"lengths": [128]})
    with pytest.raises(ValueError, match="below seq_len"):        # context phases check it too
        ContextConfig(seq_len=256, retrieval={"lengths": [256], "docs_per_task": 1})
    with pytest.raises(ValueError, match=r"retrieval\.tasks: unknown tasks \['nope'\]"):
        ContextConfig(retrieval={"tasks": ["nope"]})
    with pytest.raises(ValueError, match=r"long_eval\.lengths must be positive"):
        DsaAdaptConfig(long_eval={"lengths": [0]})
    with pytest.raises(ValueError, match="baselines"):
        DsaAdaptConfig(baselines=("full", "dense"))
    with pytest.raises(ValueError, match="indexer_loss_coeff"):
        DsaSparseSpec(indexer_loss_coeff=0.0)
    assert [(s.name, s.section, s.parents) for s in TRAINING[4:]] == [
        ("dsa-warmup", "dsa_warmup", ("context-3", "decontaminate", "tokenize")),
        ("dsa-adapt", "dsa_adapt", ("dsa-warmup", "decontaminate", "tokenize"))]


class Scripted(torch.nn.Module):
    """A stand-in for a loaded checkpoint in long_context_table: greedy decoding of a prompt in
    `right` spells its answer, any other prompt gets " 0", then <|endoftext|>."""

    def __init__(self, tok, right: dict[str, str], max_position_embeddings: int = 512):
        super().__init__()
        self.tok, self.right, self.queue = tok, right, []
        self.config = SimpleNamespace(max_position_embeddings=max_position_embeddings)

    def new_cache(self):
        return None

    def forward(self, ids, attention_mask=None, cache=None):
        if ids.shape[1] > 1:
            prompt = self.tok.decode(ids[0].tolist(), skip_special_tokens=False)
            self.queue = self.tok.encode(" " + self.right.get(prompt, "0")).ids + [self.tok.token_to_id(EOS)]
        logits = torch.zeros(1, ids.shape[1], self.tok.get_vocab_size())
        logits[0, -1, self.queue.pop(0)] = 1.0
        return SimpleNamespace(logits=logits)


def test_long_context_table_scores_each_model_on_one_suite(packed, monkeypatch):
    L = 256                      # multi_key's four needles need more than EVAL_LEN
    cfg = LongEvalConfig(lengths=(L,), n_per_task=2, tasks=("single_key", "multi_key"), seed=5)
    tok = Tokenizer.from_file(str(packed["tokenize"] / TOKENIZER_FILE))
    filler = [long_context.default_filler_texts()[0][:30_000]]     # a shorter haystack corpus: faster
    monkeypatch.setattr(long_context, "default_filler_texts", lambda: filler)
    suite = long_context.generate_suite(tok, cfg.lengths, 2, 5, filler, cfg.tasks)
    single = [ex for ex in suite if ex.task == "single_key"]
    multi = [ex for ex in suite if ex.task == "multi_key"]
    # full: all 4 right; dsa: 1 of 2 single_key, both multi_key; swa: none
    right = {"full": suite, "dsa": single[:1] + multi, "swa": []}
    models = {name: Scripted(tok, {ex.prompt: ex.answer for ex in exs}) for name, exs in right.items()}
    monkeypatch.setattr(dsa, "load_state", lambda path: models[Path(path).name])
    table, detail = dsa.long_context_table({name: Path(name) for name in right}, packed["tokenize"], cfg, 64)
    assert table == {"full": {L: 1.0}, "dsa": {L: 0.75}, "swa": {L: 0.0}}
    assert detail["dsa"] == {"single_key": {L: 0.5}, "multi_key": {L: 1.0}, "overall": {L: 0.75}}
    models["swa"] = Scripted(tok, {}, max_position_embeddings=L - 1)
    with pytest.raises(ValueError, match=rf"long_eval\.lengths \[{L}\] exceed max_position_embeddings={L - 1}"):
        dsa.long_context_table({"swa": Path("swa")}, packed["tokenize"], cfg, 64)
