"""SFT: the loss mask (only assistant tokens train), the SFT data (three thinking modes, tool
calls whose responses are the real tool outputs, sample boundaries in the packed data) and a
short QAT stage run that checkpoints, resumes and reports the INT4 comparison."""
from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from chat.template import THINKING_MODES, parse_assistant
from data_processing.packing import PackedDataset
from data_processing.tokenizer import load_tokenizer
from domains.tools import (
    CALCULATOR,
    SEARCH_DOCS,
    DocIndex,
    calculator,
    format_number,
    stdlib_functions,
)
from runtime.stage import Workdir
from model.config import preset, tiny
from model.hf import load_state, save_state
from model.model import GLMModel
from posttrain.sft import (
    BASE,
    MODELS,
    RECOVERY_TARGET,
    SFTConfig,
    evaluate_quantization,
    gsm8k_accuracy,
    perplexity,
    recovery,
    run_sft,
    summarize,
)
from posttrain.sft_data import (
    SFTDataConfig,
    build_samples,
    build_sft_data,
    gsm8k_splits,
)
from quant.qat import QATConfig, _is_qat
from tests.training.conftest import MODEL_OVERRIDES
from training import checkpoint, metrics
from training.data import IGNORE, collate, doc_ids_from_starts, eval_batches
from training.objectives import SFTObjective, SFTSpec, build_objective

SEQ = 512
DATA = SFTDataConfig(reasoning=36, tool_calc=18, tool_docs=9, code=9, val_per_kind=3)


@pytest.fixture(scope="module")
def tokenizer(packed):
    return load_tokenizer(packed["tokenize"])


@pytest.fixture(scope="module")
def sft_data(tokenizer, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("sft_data")
    return out, build_sft_data(DATA, tokenizer, out, SEQ)


def _model(seed: int = 0) -> GLMModel:
    torch.manual_seed(seed)
    return GLMModel(tiny().replace(**{**MODEL_OVERRIDES, "vocab_size": 512}))


# ---------------------------------------------------------------- data
def test_all_thinking_modes_and_kinds_are_present():
    samples = build_samples(DATA)
    train = samples["train"]
    assert {s.thinking_mode for s in train} == set(THINKING_MODES)
    assert {s.kind for s in train} == {"reasoning", "tool_calc", "tool_docs", "code"}
    users = [m for s in train for m in s.messages if m.role == "user"]
    assert any(not m.thinking for m in users) and any(m.thinking for m in users)      # turn mode on and off
    multi = [s for s in train if sum(m.role == "user" for m in s.messages) == 2]
    assert {s.thinking_mode for s in multi} == set(THINKING_MODES)                     # modes differ there
    # held out: GSM8K's first 200 questions never appear in training
    _, held = gsm8k_splits(DATA)
    held_q = {p.question for p in held}
    train_q = {m.content for s in train for m in s.messages if m.role == "user"}
    val_q = {m.content for s in samples["val"] for m in s.messages if m.role == "user"}
    assert not held_q & train_q and held_q & val_q


def test_tool_calls_carry_the_real_tool_outputs(tokenizer):
    index = DocIndex(stdlib_functions(), DATA.max_doc_chars)
    tools = {"calculator": lambda a: calculator(a["expression"]), "search_docs": lambda a: index.search(a["query"])}
    checked = {"calculator": 0, "search_docs": 0}
    for s in build_samples(DATA)["train"]:
        for i, m in enumerate(s.messages):
            if m.role != "assistant" or not m.tool_calls:
                continue
            assert s.tools and {t["function"]["name"] for t in s.tools} <= {"calculator", "search_docs"}
            (call,) = m.tool_calls
            assert s.messages[i + 1].role == "tool"
            assert s.messages[i + 1].content == tools[call.name](call.arguments)
            checked[call.name] += 1
        if s.kind.startswith("tool"):
            # the call survives the template: parse the rendered assistant text back
            enc = s.encode(tokenizer)
            assert sum(enc.loss_mask) > 0
    assert checked["calculator"] >= 10 and checked["search_docs"] >= 5
    assert calculator("48/2") == "24" and calculator("0.2*50") == "10" and calculator("(3+4)*2-1") == "13"
    with pytest.raises(ValueError):
        calculator("__import__('os')")
    assert "dedent" in index.search("textwrap.dedent") and "Remove any common leading whitespace" in index.search("textwrap.dedent")
    assert parse_assistant("<think></think><tool_call>calculator<arg_key>expression</arg_key>"
                           "<arg_value>48/2</arg_value></tool_call><|observation|>", [CALCULATOR]).ok
    assert SEARCH_DOCS["function"]["name"] == "search_docs"


def test_packed_sft_data_has_sample_boundaries_and_the_mask(sft_data, tokenizer):
    out, stats = sft_data
    ds = PackedDataset(out, "train")
    assert ds.meta["loss_mask"] and len(ds) == stats["train_sequences"]
    assistant, user = tokenizer.token_to_id("<|assistant|>"), tokenizer.token_to_id("<|user|>")
    system = tokenizer.token_to_id("<|system|>")
    seen_multi = False
    for i in range(len(ds)):
        it = ds[i]
        ids, mask, starts = it["input_ids"], it["loss_mask"], it["doc_starts"]
        assert mask.shape == ids.shape and set(np.unique(mask)) <= {0, 1}
        # every sample starts a document, with a <|system|> (tools) or <|user|> turn
        assert all(ids[s] in (user, system) for s in starts if mask[s] == 0 and ids[s] != ds.meta["pad_id"])
        seen_multi |= len(starts) > 1
        assert not mask[ids == assistant].any()              # role markers are context
        assert not mask[ids == ds.meta["pad_id"]].any()
        docs = doc_ids_from_starts(starts, len(ids))
        assert np.all(np.diff(docs) >= 0)
    assert seen_multi, "no sequence packs more than one sample"


# ---------------------------------------------------------------- the loss mask
def _roles(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions of context tokens (mask 0, not padding) and of assistant tokens (mask 1)."""
    return np.flatnonzero(mask == 0), np.flatnonzero(mask == 1)


def test_user_and_tool_tokens_never_contribute_to_the_loss(sft_data):
    out, _ = sft_data
    ds = PackedDataset(out, "train")
    pad = ds.meta["pad_id"]
    # the first 256 tokens of two sequences (each starts with a sample: context, then answers)
    crops = ({"input_ids": it["input_ids"][:256], "loss_mask": it["loss_mask"][:256],
              "doc_starts": it["doc_starts"][it["doc_starts"] < 256]} for it in ds)
    items = [it for it in crops if it["loss_mask"][:200].any()][:2]
    batch = collate(items, pad)
    model = _model()
    objective = build_objective(SFTSpec(qat=QATConfig(group_size=16)))
    objective.prepare(model)
    assert any(_is_qat(m) for m in model.modules())

    def loss_and_grads(labels_from: list[dict]) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        b = {**batch, "labels": collate(labels_from, pad)["labels"]}
        loss, parts = objective.loss(model, b)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    base_loss, base_grads = loss_and_grads(items)
    rng = np.random.default_rng(0)
    # Targets are read from the token stream: perturb every context token (system, user, tool
    # results, role markers) as a target, the inputs the model reads staying the same.
    perturbed = []
    for it in items:
        ids = it["input_ids"].copy()
        ctx, _ = _roles(ids, it["loss_mask"])
        ids[ctx] = rng.integers(0, 512, len(ctx))
        perturbed.append({**it, "input_ids": ids})
    loss, grads = loss_and_grads(perturbed)
    assert loss == base_loss
    assert all(torch.equal(a, b) for a, b in zip(base_grads, grads))
    # one assistant token changed as a target: loss and gradients change
    one = [dict(it) for it in items]
    ids = one[0]["input_ids"].copy()
    _, asst = _roles(ids, one[0]["loss_mask"])
    ids[asst[len(asst) // 2]] = (ids[asst[len(asst) // 2]] + 1) % 512
    one[0] = {**one[0], "input_ids": ids}
    loss, grads = loss_and_grads(one)
    assert loss != base_loss
    assert any(not torch.equal(a, b) for a, b in zip(base_grads, grads))

    # And directly: the heads score exactly the positions that predict an assistant token
    # (main head and MTP head alike: the MTP head's targets are the labels shifted by its
    # depth, within the document), and each of those rows carries gradient.
    captured = []
    def keep(module, inputs, output) -> None:
        output.retain_grad()
        captured.append(output)

    hook = model.lm_head.register_forward_hook(keep)
    model.zero_grad()
    loss, _ = objective.loss(model, batch)
    loss.backward()
    hook.remove()
    labels, docs = batch["labels"], batch["doc_ids"]
    for k, logits in enumerate(captured):               # k = 0 main head, k >= 1 MTP depth k
        targets = labels[:, k:] != IGNORE
        if k:
            targets &= docs[:, k:] == docs[:, :-k]
        assert logits.shape[0] == int(targets.sum()), f"head {k} scored a context token"
        assert (logits.grad.abs().sum(-1) > 0).all()
    assert len(captured) == 2                            # lm head + one MTP step


# ---------------------------------------------------------------- the stage
def _config(**kw) -> SFTConfig:
    base = dict(seq_len=SEQ, data=DATA, qat=QATConfig(group_size=16), micro_batch_size=2, max_steps=4,
                checkpoint_every=2, keep_last=3, lr=0.01, warmup_steps=1, eval_sequences=4, eval_gsm8k=2,
                max_new_tokens=8, optimizer="adamw", launch={"nproc_per_node": 1})
    return SFTConfig(**{**base, **kw})


def test_the_rank_spec_carries_the_objective_typed():
    from pydantic import ValidationError

    from training.rank_spec import RankSpec

    spec = RankSpec(train={}, model=preset("tiny", vocab_size=64), seed=1, total_steps=3, data_dir="d",
                    tokenizer_dir="t", checkpoint_dir="c", out_dir="o",
                    objective=SFTSpec(qat=QATConfig(group_size=16), qat_start_step=2))
    back = RankSpec.model_validate_json(spec.model_dump_json())
    assert back == spec and isinstance(back.objective, SFTSpec) and back.objective.qat.group_size == 16
    assert isinstance(build_objective(back.objective), SFTObjective)
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        RankSpec.model_validate({**spec.model_dump(mode="json"), "objective": {"name": "nope"}})
    with pytest.raises(ValidationError, match="qat_start_step"):
        SFTSpec(qat_start_step=-1)


def test_fake_quantization_starts_at_its_step():
    from model.config import preset
    from model.model import GLMModel
    from quant.qat import quantized_modules

    model = GLMModel(preset("tiny", num_layers=1, first_k_dense=1, vocab_size=64))
    objective = SFTObjective(SFTSpec(qat=QATConfig(group_size=16), qat_start_step=3))
    objective.prepare(model)
    mods = quantized_modules(model, QATConfig(group_size=16))
    is_fake = lambda: {type(m).__name__.startswith("QAT") for m in mods.values()}
    for step in range(3):
        objective.begin_step(model, step)
        assert is_fake() == {False}
    objective.begin_step(model, 3)
    assert is_fake() == {True}
    objective.begin_step(model, 4)          # on once, never prepared twice
    assert is_fake() == {True}


def test_without_qat_the_run_is_the_ptq_baseline(sft_data, tokenizer, tmp_path):
    data_dir, _ = sft_data
    save_state(_model(), tmp_path / "w.safetensors")
    got = evaluate_quantization(_config(), None, tmp_path / "w.safetensors", data_dir, tokenizer,
                                tmp_path / "int4", tmp_path / "scratch")
    assert set(got["quantization"]) == {"full_no_qat", "ptq_int4"} and got["qat_recovery_ppl"] is None
    assert got["ptq_degradation_ppl"] == got["quantization"]["ptq_int4"]["ppl"] - got["quantization"]["full_no_qat"]["ppl"]
    assert (tmp_path / "int4/model_int4.safetensors").is_file()
    assert recovery(12.0, 10.0, 9.0) == pytest.approx(2 / 3) and recovery(9.0, 9.5, 9.0) is None


def _table(full: float, qat: float, ref: float, ptq: float) -> dict:
    return {"full": {"ppl": full}, "qat_int4": {"ppl": qat}, "full_no_qat": {"ppl": ref}, "ptq_int4": {"ppl": ptq}}


def test_recovery_splits_into_own_share_and_the_training_runs_difference():
    # PTQ costs 3; QAT's own INT4 gap is 0.5 and its full-precision model is 0.5 better: recovery
    # = own share (1 - 0.5/3) minus the trajectory term (-0.5/3)
    got = summarize(_table(full=9.5, qat=10.0, ref=10.0, ptq=13.0))
    assert got["qat_recovery_ppl"] == pytest.approx(1.0) and got["qat_recovery_ppl_own"] == pytest.approx(5 / 6)
    assert got["qat_full_minus_full_no_qat_ppl"] == pytest.approx(-0.5) and got["qat_recovery_resolved"] is True
    assert got["qat_target_met"] is True and got["qat_recovery_target"] == RECOVERY_TARGET
    # the tiny preset's case: QAT training costs the full model more than PTQ's whole degradation
    got = summarize(_table(full=106.7, qat=107.4, ref=103.6, ptq=104.8))
    assert got["qat_recovery_ppl"] < 0 < got["qat_recovery_ppl_own"] < RECOVERY_TARGET
    assert got["qat_recovery_resolved"] is False and got["qat_target_met"] is False
    # PTQ does not degrade, or no baseline: nothing to recover, nothing to judge
    for table in (_table(full=9.0, qat=9.1, ref=9.0, ptq=8.9), {"full": {"ppl": 9.0}, "qat_int4": {"ppl": 9.2}}):
        got = summarize(table)
        assert got["qat_recovery_ppl"] is None and got["qat_target_met"] is None and got["qat_recovery_resolved"] is None
        assert got["qat_int4_minus_full_ppl"] == pytest.approx(table["qat_int4"]["ppl"] - 9.0)


def test_a_group_size_the_model_cannot_take_fails_before_training(packed, tmp_path):
    parent = tmp_path / BASE
    save_state(_model(), parent / "consolidated.safetensors")
    with pytest.raises(ValueError, match="group_size=24 does not divide"):
        run_sft(_config(qat=QATConfig(group_size=24)), {BASE: parent, "tokenize": packed["tokenize"]},
                Workdir.at(tmp_path / "w"))
    assert not (tmp_path / "w/checkpoint/data").exists()


def test_sft_stage_with_qat_checkpoints_resumes_and_reports_int4(packed, tmp_path, caplog):
    """With fake quantization from step 2 of 4 the baseline trains steps 1-2 once and the QAT run
    continues from its checkpoint: step for step the QAT run that trained its own first steps
    (ptq_baseline off, nothing to share). Then the QAT run resumes from a lost last checkpoint."""
    parent = tmp_path / BASE
    save_state(_model(), parent / "consolidated.safetensors")
    inputs = {BASE: parent, "tokenize": packed["tokenize"]}
    wd = Workdir.at(tmp_path / "sft", seed=3)
    cfg = _config(qat_start_fraction=0.5)
    with caplog.at_level(logging.INFO, logger="glmforge"):
        result = run_sft(cfg, inputs, wd)
    q = result["quantization"]
    assert set(q) == set(MODELS)
    for row in q.values():
        # 4 steps from random weights answer no GSM8K question (the scorer's exact values are
        # test_gsm8k_accuracy_is_exact_match_of_the_final_number's)
        assert row["ppl"] == pytest.approx(math.exp(row["loss"])) and row["gsm8k_acc"] == 0.0 and row["gsm8k_n"] == 2
    assert q["full"]["ppl"] != q["qat_int4"]["ppl"]                # INT4 is not the full model
    b = result["int4_bytes"]
    assert b["int4_bytes"] * 4 == b["fp16_bytes"] and b["quantized_params"] > 0
    assert {"qat_recovery_ppl", "qat_recovery_ppl_own", "qat_target_met", "qat_recovery_resolved"} <= set(result)
    assert "INT4" in caplog.text
    first = metrics.read(wd.checkpoint / "metrics.jsonl")
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    assert checkpoint.tags(wd.checkpoint) == [checkpoint.tag_for(s) for s in (2, 4)]
    for f in ("consolidated.safetensors", "hf/config.json", "export/full/model.safetensors",
              "export/int4/model.safetensors", "export/int4/config.json", "int4/model_int4.safetensors", "eval.json"):
        assert (wd.out / f).is_file(), f
    assert "quantization_config" in (wd.out / "export/int4/config.json").read_text()
    assert (wd.checkpoint / "baseline/out/consolidated.safetensors").is_file()

    # the branch: the baseline's first steps are the QAT run's, then fake INT4 from step 3 on
    baseline = metrics.read(wd.checkpoint / "baseline/checkpoint/metrics.jsonl")
    assert [r["step"] for r in baseline] == [1, 2, 3, 4] and result["resumed_from_step"] == 2
    assert [r["loss"] for r in first[:2]] == [r["loss"] for r in baseline[:2]]
    assert first[2]["loss"] != baseline[2]["loss"]
    alone = Workdir.at(tmp_path / "alone", seed=3)
    run_sft(cfg.model_copy(update={"ptq_baseline": False, "eval_gsm8k": 0}), inputs, alone)
    assert [r["loss"] for r in first] == [r["loss"] for r in metrics.read(alone.checkpoint / "metrics.jsonl")]
    a, c = (load_state(w.out / "consolidated.safetensors").state_dict() for w in (wd, alone))
    assert all(torch.equal(a[k], c[k]) for k in a)

    # resume: lose the last checkpoint, run again -> continues from step 2, same steps 3-4
    import shutil
    shutil.rmtree(wd.checkpoint / checkpoint.tag_for(4))
    (wd.checkpoint / checkpoint.LATEST).write_text(checkpoint.tag_for(2))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="glmforge"):
        again = run_sft(cfg, inputs, wd)
    assert "resuming from checkpoint" in caplog.text and again["resumed_from_step"] == 2
    second = metrics.read(wd.checkpoint / "metrics.jsonl")
    assert [r["step"] for r in second] == [1, 2, 3, 4]
    for x, y in zip(first, second):
        assert x["loss"] == y["loss"] and x["lm"] == y["lm"], x["step"]
    assert again["quantization"]["full"]["ppl"] == q["full"]["ppl"]


def test_seed_pairs_and_fact_recall_give_the_quantization_spread(packed, tokenizer, tmp_path, caplog):
    from posttrain.sft import SPREAD_KEYS
    from training.synthetic import RESERVED_IDS

    parent = tmp_path / BASE
    torch.manual_seed(0)
    vocab = tokenizer.get_vocab_size() + RESERVED_IDS
    save_state(GLMModel(tiny().replace(**{**MODEL_OVERRIDES, "vocab_size": vocab})), parent / "consolidated.safetensors")
    cfg = _config(max_steps=1, checkpoint_every=1, seeds=2, eval_facts=2, eval_gsm8k=0,
                  synthetic={"docs": [{"task": "facts", "length": 66, "count": 16}]})
    with caplog.at_level(logging.INFO, logger="glmforge"):
        result = run_sft(cfg, {BASE: parent, "tokenize": packed["tokenize"]}, Workdir.at(tmp_path / "sft", seed=3))
    assert result["data"]["synthetic"]["docs"] == [{"task": "facts", "length": 66, "count": 16}]
    assert [s["seed_offset"] for s in result["seeds"]] == [0, 1]
    assert result["seeds"][0]["quantization"] == result["quantization"]          # seed 0 is the published pair
    assert result["seeds"][1]["quantization"]["full"]["ppl"] != result["quantization"]["full"]["ppl"]
    for row in result["quantization"].values():
        assert 0 <= row["facts_acc"] <= 1 and row["facts_ppl"] > 1 and row["facts_n"] == 44
    assert set(result["spread"]) <= set(SPREAD_KEYS) and "ptq_degradation_facts_ppl_pct" in result["spread"]
    sp = result["spread"]["ptq_degradation_facts_ppl_pct"]
    assert sp["values"] == [s["ptq_degradation_facts_ppl_pct"] for s in result["seeds"]]
    assert sp["mean"] == pytest.approx(sum(sp["values"]) / 2)
    assert sp["std"] == pytest.approx(abs(sp["values"][0] - sp["values"][1]) / math.sqrt(2))
    assert "over 2 seeds" in caplog.text
    save_state(_model(), tmp_path / "plain" / "consolidated.safetensors")
    with pytest.raises(ValueError, match="reserved ids"):     # a model without the reserved ids, before training
        run_sft(_config(max_steps=2, checkpoint_every=2, eval_facts=2, eval_gsm8k=0, ptq_baseline=False),
                {BASE: tmp_path / "plain", "tokenize": packed["tokenize"]}, Workdir.at(tmp_path / "sft2"))
    assert not (tmp_path / "sft2" / "checkpoint" / "metrics.jsonl").exists()


def test_fact_summary_is_the_ptq_cost_and_qat_share_on_the_facts():
    from posttrain.sft import spread

    table = {"full": {"ppl": 10.0, "facts_ppl": 1.05, "facts_acc": 0.95},
             "qat_int4": {"ppl": 10.2, "facts_ppl": 1.07, "facts_acc": 0.93},
             "full_no_qat": {"ppl": 10.0, "facts_ppl": 1.04, "facts_acc": 0.96},
             "ptq_int4": {"ppl": 10.5, "facts_ppl": 1.144, "facts_acc": 0.86}}
    got = summarize(table)
    assert got["ptq_degradation_facts_ppl_pct"] == pytest.approx(10.0)
    assert got["ptq_degradation_facts_acc_points"] == pytest.approx(10.0)
    assert got["qat_recovery_facts_ppl"] == pytest.approx(0.074 / 0.104)
    assert got["qat_recovery_facts_acc"] == pytest.approx(0.7)
    assert spread([got, {**got, "qat_recovery_facts_acc": 0.5}])["qat_recovery_facts_acc"] == {
        "mean": pytest.approx(0.6), "std": pytest.approx(math.sqrt(0.02)), "values": [pytest.approx(0.7), 0.5]}


# ---------------------------------------------------------------- the held-out scores
V = 512


class FixedLogits(torch.nn.Module):
    """Every position predicts p(v) = 3/1024 for even v and 1/1024 for odd v (V = 512): a target
    token costs log(1024/3) or log(1024) nats, whatever the context."""

    def forward(self, input_ids, labels, doc_ids=None, compute_mtp=True):
        logits = torch.where(torch.arange(V) % 2 == 0, math.log(3.0), 0.0).expand(*input_ids.shape, V)
        return SimpleNamespace(losses={"lm": F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1),
                                                             ignore_index=IGNORE)})


def test_perplexity_is_token_weighted_over_the_assistant_tokens(sft_data):
    data_dir, _ = sft_data
    batches = list(eval_batches(PackedDataset(data_dir, "val"), 2, 3))
    targets = [b["labels"][b["labels"] != IGNORE] for b in batches]
    n, even = sum(len(t) for t in targets), sum(int((t % 2 == 0).sum()) for t in targets)
    want = (even * math.log(1024 / 3) + (n - even) * math.log(1024)) / n
    # the batches differ in size and mix: a mean of per-batch means would not be `want`
    per_batch = [float(((t % 2 == 0) * math.log(1024 / 3) + (t % 2 == 1) * math.log(1024)).float().mean())
                 for t in targets]
    assert abs(sum(per_batch) / len(per_batch) - want) > 1e-4
    for mbs in (1, 2):
        got = perplexity(FixedLogits(), data_dir, mbs, 3)
        assert got["tokens"] == n and got["loss"] == pytest.approx(want, rel=1e-6)
        assert got["ppl"] == pytest.approx(math.exp(want), rel=1e-6)
    # a real model with a zero LM head predicts uniformly: perplexity = vocabulary size
    model = _model()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    assert perplexity(model, data_dir, 2, 3)["ppl"] == pytest.approx(V, rel=1e-5)


class Replies(torch.nn.Module):
    """A stand-in for GLMModel in generate: on the left-padded prompt batch, row i's greedy
    continuation spells the reply for the question in row i's (unpadded) prompt, then repeats
    its last token."""

    def __init__(self, tokenizer, replies: dict[str, str]):
        super().__init__()
        self.tok, self.replies, self.queues = tokenizer, replies, []

    def new_cache(self):
        return None

    def forward(self, ids, attention_mask=None, cache=None):
        if ids.shape[1] > 1:
            self.queues = []
            for row, m in zip(ids, attention_mask):
                prompt = self.tok.decode(row[m.bool()].tolist(), skip_special_tokens=False)
                (reply,) = [r for q, r in self.replies.items() if q in prompt]
                self.queues.append(self.tok.encode(reply, add_special_tokens=False).ids)
        logits = torch.zeros(ids.shape[0], ids.shape[1], self.tok.get_vocab_size())
        for i, q in enumerate(self.queues):
            logits[i, -1, q.pop(0) if len(q) > 1 else q[0]] = 1.0
        return SimpleNamespace(logits=logits)


def test_gsm8k_accuracy_is_exact_match_of_the_final_number(tokenizer):
    problems = gsm8k_splits(DATA)[1][:5]
    ans = [p.answer for p in problems]
    off = [format_number(float(a) + 1) for a in ans]
    replies = {
        problems[0].question: f"Let me see. #### {ans[0]}<|endoftext|>",           # right
        problems[1].question: f"It is {ans[1]} #### {off[1]}<|endoftext|>",        # the number after #### counts
        problems[2].question: f"So 3 + 4 is {ans[2]}.<|user|>",                     # no ####: the last number
        problems[3].question: f"#### {off[3]}<|user|>#### {ans[3]}",               # nothing after the stop token
        problems[4].question: "I do not know.<|endoftext|>",                        # no number at all
    }
    got = gsm8k_accuracy(Replies(tokenizer, replies), tokenizer, problems, max_new_tokens=40)
    assert got["acc"] == 2 / 5 and got["n"] == 5
    assert got["example"] == replies[problems[0].question]
    assert gsm8k_accuracy(Replies(tokenizer, {}), tokenizer, [], 8) == {"acc": None, "n": 0}
