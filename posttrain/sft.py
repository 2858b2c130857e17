"""The `sft` stage: supervised fine-tuning on chat, reasoning, tool-use and code conversations
(posttrain.sft_data), with INT4 quantization-aware training, then the INT4 evaluation and exports.

    dsa-adapt (weights), tokenize (tokenizer) --> sft

1. Data: posttrain.sft_data builds the conversations, encodes them with the chat template (loss
   mask = the assistant's tokens) and packs whole samples with their masks under
   workdir.checkpoint/data (rebuilt only when missing: the build is deterministic).
2. Training: training.drivers.train_stage with the `sft` objective (training.objectives), i.e. the shared loop,
   launch, checkpoints, resume and metrics. The objective fake-quantizes the selected weights
   (quant.qat.prepare_qat, state-dict names unchanged, so checkpoints and resume are those
   of any stage) and takes the model's LM + MTP loss on the masked labels (training.data.collate
   sets -100 wherever the loss mask is 0). With qat_start_fraction > 0 fake quantization starts
   that far into the run (as torchtune's fake_quant_after_n_steps): the steps before are plain
   full-precision SFT, identical to the baseline's, and QAT then adapts the trained weights.
3. The PTQ baseline: a second train_stage run, identical (same seed, data order, steps) except
   without QAT, under workdir.checkpoint/baseline. Its round-to-nearest INT4 is `ptq_int4`.
   (PTQ of the QAT run's own weights would be no baseline: it IS the QAT INT4 model.) With
   qat_start_fraction > 0 the two runs' first steps are the same, so they are trained once: the
   baseline trains them and stops with a checkpoint, the QAT run starts from a copy of it
   (training.checkpoint.branch), then the baseline goes on to the end.
4. Evaluation in this process, on held-out data: perplexity over the assistant tokens of the
   held-out conversations and greedy GSM8K accuracy on held-out questions (thinking off, short
   answers) for
       full      the QAT-trained weights without quantization
       qat_int4  the real INT4 conversion of those weights (quant.qat.save_int4 ->
                 load_int4_model: packed int4 + scales through int4_matmul)
       ptq_int4  the same conversion of the baseline run's weights
       full_no_qat  the baseline run in full precision (the reference PTQ degrades from)
   recovery = (ppl(ptq_int4) - ppl(qat_int4)) / (ppl(ptq_int4) - ppl(full_no_qat)): the share
   of the PTQ degradation that QAT wins back (GLM-5's target: at least 2/3, RECOVERY_TARGET).
   The two runs also differ by their trajectories: with gap_ptq = ptq_int4 - full_no_qat,
   gap_qat = qat_int4 - full and cost = full - full_no_qat (what QAT training did to the
   full-precision model),
       recovery = 1 - gap_qat / gap_ptq - cost / gap_ptq,
   and qat_recovery_ppl_own = 1 - gap_qat / gap_ptq is the share without the trajectory term
   (each model against its own full precision). When |cost| >= gap_ptq the trajectory term alone
   moves the ratio by a whole unit: the ratio then says more about the two training runs than
   about INT4, and qat_recovery_resolved is False (on the tiny preset INT4 costs 1-2% perplexity,
   about what QAT training itself costs; see configs/tiny.yaml's sft block). A tiny model's GSM8K
   accuracy is ~0, so perplexity is the number that means something there.
5. Exports under workdir.out: consolidated.safetensors + hf/ (the loop's, full precision),
   export/full (model.hf.save_pretrained) and export/int4 (compressed-tensors pack-quantized,
   quant.export.export_all), int4/model_int4.safetensors (our INT4 format), eval.json.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import statistics
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from chat.template import STOP_TOKENS, Message, encode, parse_assistant
from data_processing.packing import META, PackedDataset
from data_processing.tokenizer import load_tokenizer
from domains.gsm8k import extract_answer
from domains.tools import format_number
from runtime.stage import Workdir
from model.generate import generate
from model.hf import STATE_FILE, artifact_weights, load_state, state_config
from model.model import GLMModel
from posttrain.sft_data import SFTDataConfig, build_sft_data, gsm8k_splits
from quant.export import export_all
from quant.qat import (
    QATConfig,
    convert_int4,
    int4_bytes,
    load_int4_model,
    quantized_modules,
    save_int4,
)
from training import checkpoint, synthetic
from training.config import TrainConfig
from training.data import eval_batches
from training.drivers import train_stage
from training.objectives import SFTSpec
from training.synthetic import SyntheticConfig

log = logging.getLogger("glmforge")
MODELS = ("full", "ptq_int4", "qat_int4", "full_no_qat")
RECOVERY_TARGET = 2 / 3     # GLM-5: QAT recovers at least two thirds of the PTQ degradation


class SFTConfig(TrainConfig):
    """SFT on top of the last context-extension stage. The training fields are TrainConfig's."""

    seq_len: int = Field(1024, ge=16, description="packed sequence length (longer samples are dropped)")
    data: SFTDataConfig = Field(SFTDataConfig(), description=(
        "the SFT conversations (posttrain.sft_data): kinds, counts and held-out splits"))
    qat: QATConfig = Field(QATConfig(), description="which module kinds INT4 QAT fake-quantizes, and its group size")
    use_qat: bool = Field(True, description="fake-quantize during training (INT4 QAT)")
    qat_start_fraction: float = Field(0.0, ge=0, lt=1, description="fake quantization starts after this "
                                      "share of the steps (torchtune's fake_quant_after_n_steps); the QAT "
                                      "run and the PTQ baseline share the full-precision steps before it")
    ptq_baseline: bool = Field(True, description="also train the same run without QAT: the PTQ baseline")
    eval_gsm8k: int = Field(16, ge=0, description="held-out GSM8K questions answered by greedy generation")
    max_new_tokens: int = Field(96, ge=1, description="generation budget per GSM8K answer")
    synthetic: SyntheticConfig | None = Field(None, description="synthetic token documents added to the "
                                              "training split (training.synthetic), e.g. the facts the "
                                              "quantization table scores")
    eval_facts: int = Field(0, ge=0, description="held-out fact-recall documents (22 facts each) scored for "
                            "every model of the quantization table; needs a model pretrained with synthetic data")
    seeds: int = Field(1, ge=1, description="QAT + PTQ-baseline pairs trained with seed offsets 0..seeds-1 "
                       "for the quantization table's spread; the artifact is seed 0's")


# ---------------------------------------------------------------- evaluation (stage side)
@torch.no_grad()
def perplexity(model: GLMModel, data_dir: Path, micro_batch_size: int, max_sequences: int) -> dict[str, float]:
    """Token-weighted LM loss over the held-out split's target (assistant) tokens."""
    model.eval()
    nll, count = 0.0, 0
    for b in eval_batches(PackedDataset(data_dir, "val"), micro_batch_size, max_sequences):
        out = model(b["input_ids"], labels=b["labels"], doc_ids=b["doc_ids"], compute_mtp=False)
        n = int((b["labels"] != -100).sum())
        nll += out.losses["lm"].item() * n
        count += n
    if count == 0:
        raise ValueError("the held-out SFT split has no assistant tokens to score")
    return {"loss": nll / count, "ppl": math.exp(min(nll / count, 50.0)), "tokens": count}


@torch.no_grad()
def gsm8k_accuracy(model: GLMModel, tokenizer, problems: list, max_new_tokens: int) -> dict[str, Any]:
    """Greedy answers to the questions, thinking off (turn mode, "/nothink"): exact match of the
    final number (after '####', else the last number of the reply's content)."""
    if not problems:
        return {"acc": None, "n": 0}
    stops = {tokenizer.token_to_id(t) for t in STOP_TOKENS}
    pad = tokenizer.token_to_id("<|pad|>")
    prompts = [encode(tokenizer, [Message("user", p.question, thinking=False)], thinking_mode="turn",
                      add_generation_prompt=True).ids for p in problems]
    T = max(map(len, prompts))
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts])                 # left-padded
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    new = generate(model, ids, max_new_tokens, greedy=True, attention_mask=mask).new_tokens.tolist()
    correct, replies = 0, []
    for p, toks in zip(problems, new):
        cut = next((i + 1 for i, t in enumerate(toks) if t in stops), len(toks))  # keep the stop token
        text = tokenizer.decode(toks[:cut], skip_special_tokens=False)
        got = extract_answer(parse_assistant(text).message.content)
        correct += got is not None and got == format_number(float(p.answer))
        replies.append(text)
    return {"acc": correct / len(problems), "n": len(problems), "example": replies[0][:200]}


def _score(model: GLMModel, cfg: SFTConfig, data_dir: Path, tokenizer, problems: list) -> dict[str, Any]:
    ppl = perplexity(model, data_dir, cfg.micro_batch_size, cfg.eval_sequences)
    acc = gsm8k_accuracy(model, tokenizer, problems, cfg.max_new_tokens)
    row = {"ppl": ppl["ppl"], "loss": ppl["loss"], "gsm8k_acc": acc["acc"], "gsm8k_n": acc["n"]}
    if cfg.eval_facts:   # the model's reserved ids were checked before training (run_sft)
        facts = synthetic.facts_scores(model, tokenizer.get_vocab_size(), cfg.eval_facts, "sft")
        row.update(facts_acc=facts["acc"], facts_ppl=facts["ppl"], facts_n=facts["n"])
    return row, acc.get("example")


def recovery(ptq: float | None, qat: float | None, reference: float | None) -> float | None:
    """Share of the PTQ degradation (ptq - reference) that QAT wins back; None when PTQ does not
    degrade (nothing to recover) or a number is missing."""
    if None in (ptq, qat, reference) or ptq - reference <= 1e-9:
        return None
    return (ptq - qat) / (ptq - reference)


def evaluate_quantization(cfg: SFTConfig, qat_weights: Path | None, baseline_weights: Path | None, data_dir: Path,
                          tokenizer, int4_dir: Path, scratch: Path) -> dict[str, Any]:
    """The quantization table (module doc, step 4) and the INT4 sizes. Without QAT weights
    (use_qat off) the run's own model is the baseline: full_no_qat and ptq_int4 only."""
    if qat_weights is None:
        if baseline_weights is None:
            raise ValueError("evaluate_quantization needs QAT weights, baseline weights or both")
        base = load_state(baseline_weights).eval()
        save_int4(base, cfg.qat, int4_dir)
        problems = gsm8k_splits(cfg.data)[1][: cfg.eval_gsm8k]
        (ref, ex_ref), (ptq, ex_ptq) = (_score(m, cfg, data_dir, tokenizer, problems)
                                        for m in (base, load_int4_model(int4_dir)))
        return {"quantization": {"full_no_qat": ref, "ptq_int4": ptq},
                "int4_bytes": int4_bytes(convert_int4(base, cfg.qat)), "qat_recovery_ppl": None,
                "qat_recovery_ppl_own": None, "ptq_degradation_ppl": ptq["ppl"] - ref["ppl"],
                "gsm8k_examples": {"full_no_qat": ex_ref, "ptq_int4": ex_ptq}}
    problems = gsm8k_splits(cfg.data)[1][: cfg.eval_gsm8k]
    torch.manual_seed(0)
    table: dict[str, Any] = {}
    examples: dict[str, str | None] = {}

    def score(name: str, model: GLMModel) -> None:
        table[name], examples[name] = _score(model, cfg, data_dir, tokenizer, problems)

    full = load_state(qat_weights).eval()
    score("full", full)
    save_int4(full, cfg.qat, int4_dir)
    sizes = int4_bytes(convert_int4(full, cfg.qat))
    score("qat_int4", load_int4_model(int4_dir))
    if baseline_weights is not None:
        base = load_state(baseline_weights).eval()
        score("full_no_qat", base)
        save_int4(base, cfg.qat, scratch)
        score("ptq_int4", load_int4_model(scratch))
    return {"quantization": table, "int4_bytes": sizes, **summarize(table), "gsm8k_examples": examples}


def summarize(table: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The recovery numbers of a quantization table (module doc, step 4). Without the baseline
    rows (full_no_qat, ptq_int4) only QAT's own INT4 gap is known."""
    full, qat = table["full"]["ppl"], table["qat_int4"]["ppl"]
    ref = table.get("full_no_qat", {}).get("ppl")
    ptq = table.get("ptq_int4", {}).get("ppl")
    rec = recovery(ptq, qat, ref)
    gap_ptq = None if ptq is None or ref is None else ptq - ref
    cost = None if ref is None else full - ref
    return {
        # all against the same reference, the baseline's full-precision model (the ratio)
        "qat_recovery_ppl": rec,
        "qat_recovery_target": RECOVERY_TARGET,
        "qat_target_met": None if rec is None else rec >= RECOVERY_TARGET,
        "ptq_degradation_ppl": gap_ptq,
        "qat_degradation_ppl": None if ref is None else qat - ref,
        "qat_int4_minus_full_ppl": qat - full,                          # QAT's own INT4 gap
        "qat_full_minus_full_no_qat_ppl": cost,                         # the trajectory term
        # each model against its own full precision (no trajectory term)
        "qat_recovery_ppl_own": None if rec is None else 1 - (qat - full) / gap_ptq,
        # False: the runs' full-precision models differ by at least PTQ's whole degradation
        "qat_recovery_resolved": None if rec is None else abs(cost) < gap_ptq,
        **(_facts_summary(table) if "facts_ppl" in table["full"] else {}),
    }


def _facts_summary(table: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """PTQ's cost and QAT's recovery on the fact-recall task (answer perplexity, accuracy)."""
    if "full_no_qat" not in table:
        return {}
    ref, ptq, qat = (table[k] for k in ("full_no_qat", "ptq_int4", "qat_int4"))
    return {"ptq_degradation_facts_ppl_pct": 100 * (ptq["facts_ppl"] / ref["facts_ppl"] - 1),
            "ptq_degradation_facts_acc_points": 100 * (ref["facts_acc"] - ptq["facts_acc"]),
            "qat_recovery_facts_ppl": recovery(ptq["facts_ppl"], qat["facts_ppl"], ref["facts_ppl"]),
            "qat_recovery_facts_acc": recovery(-ptq["facts_acc"], -qat["facts_acc"], -ref["facts_acc"])}


SPREAD_KEYS = ("ptq_degradation_ppl", "qat_recovery_ppl", "ptq_degradation_facts_ppl_pct",
               "ptq_degradation_facts_acc_points", "qat_recovery_facts_ppl", "qat_recovery_facts_acc")


def spread(per_seed: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """{key: {"mean", "std", "values"}} over the seeds' summaries (sample std; None when a seed
    has no value, e.g. PTQ did not degrade)."""
    out = {}
    for k in SPREAD_KEYS:
        vals = [s.get(k) for s in per_seed]
        if vals and None not in vals:
            out[k] = {"mean": statistics.mean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                      "values": vals}
    return out


# ---------------------------------------------------------------- the stage
def _data(cfg: SFTConfig, tokenizer, workdir: Workdir, distilled: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Build the packed SFT data once; a retry reuses it (written to a temp dir, then renamed,
    so a half-written one is never taken for complete). `distilled`: a later round's
    self-distill artifact (posttrain.self_distill)."""
    data_dir = workdir.checkpoint / "data"
    stats_file = data_dir / "build.json"
    if not (data_dir / META).exists() or not stats_file.exists():
        tmp = workdir.checkpoint / "data.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(data_dir, ignore_errors=True)
        tmp.mkdir(parents=True)
        stats = build_sft_data(cfg.data, tokenizer, tmp, cfg.seq_len, distilled)
        (tmp / "build.json").write_text(json.dumps(stats, indent=1))
        os.replace(tmp, data_dir)
        workdir.persist_checkpoint()
    stats = json.loads(stats_file.read_text())
    if cfg.synthetic:   # the conversations plus synthetic documents (held-out split unchanged)
        mixed = workdir.checkpoint / "data-mixed"
        meta = synthetic.mix_into(data_dir, mixed, cfg.synthetic, tokenizer.get_vocab_size(),
                                  workdir.seed + cfg.seed_offset)
        workdir.persist_checkpoint()
        return mixed, {**stats, "synthetic": meta["synthetic"]}
    return data_dir, stats


def _train_and_quantize(cfg: SFTConfig, model_cfg, init: Path, data_dir: Path, tok_dir: Path, tokenizer,
                        workdir: Workdir, name: str = "sft") -> tuple[dict[str, Any], dict[str, Any]]:
    """The QAT run, its PTQ baseline (same seed, data order and steps), and the quantization
    table of the pair, in `workdir` (each run resumable on its own)."""
    qat_start = int(cfg.qat_start_fraction * cfg.steps_for(cfg.seq_len))
    with_baseline = cfg.ptq_baseline and cfg.use_qat
    root = workdir.checkpoint / "baseline"
    bwd = workdir.sub(root / "out", root / "checkpoint")
    if with_baseline and qat_start > 0 and checkpoint.select_resume(workdir.checkpoint) is None:
        # The steps before fake quantization are the same in both runs: the baseline trains them
        # and the QAT run starts from its checkpoint (bit for bit what it would have trained).
        train_stage(f"{name}-baseline", cfg, model_cfg, data_dir, tok_dir, bwd, init, SFTSpec(), stop_at=qat_start)
        checkpoint.branch(bwd.checkpoint, workdir.checkpoint, checkpoint.tag_for(qat_start))
        workdir.persist_checkpoint()
    result = train_stage(name, cfg, model_cfg, data_dir, tok_dir, workdir, init,
                         SFTSpec(qat=cfg.qat if cfg.use_qat else None, qat_start_step=qat_start))
    baseline = None
    if with_baseline:
        # eval.json is the loop's last export file: a retry after the baseline finished skips it
        if not (bwd.out / "eval.json").exists():
            train_stage(f"{name}-baseline", cfg, model_cfg, data_dir, tok_dir, bwd, init, SFTSpec())
        baseline = bwd.out / STATE_FILE
    out = workdir.out
    scratch = workdir.checkpoint / "ptq_int4"
    if cfg.use_qat:
        quant = evaluate_quantization(cfg, out / STATE_FILE, baseline, data_dir, tokenizer,
                                      out / "int4", scratch)
    else:   # this run is the no-QAT model: its INT4 is PTQ
        quant = evaluate_quantization(cfg, None, out / STATE_FILE, data_dir, tokenizer,
                                      out / "int4", scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    return result, quant


def run_sft(cfg: SFTConfig, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]:
    init = artifact_weights(inputs[BASE], BASE)
    base = state_config(init)
    model_cfg = base.replace(max_position_embeddings=max(base.max_position_embeddings, cfg.seq_len))
    with torch.device("meta"):      # shapes only: a group_size that does not divide fails now
        quantized_modules(GLMModel(model_cfg), cfg.qat)
    tok_dir = Path(inputs["tokenize"])
    tokenizer = load_tokenizer(tok_dir)
    if cfg.eval_facts:   # before any training: the fact table's ids must exist in the model
        synthetic.check_vocab(model_cfg.vocab_size, tokenizer.get_vocab_size(), "sft.eval_facts")
    data_dir, data_stats = _data(cfg, tokenizer, workdir, inputs.get("self-distill"))

    result, quant = _train_and_quantize(cfg, model_cfg, init, data_dir, tok_dir, tokenizer, workdir)
    seeds = [quant]
    for k in range(1, cfg.seeds):
        # another pair with another data order, for the spread; evaluated, not published
        root = workdir.checkpoint / f"seed{k}"
        kwd = workdir.sub(root / "out", root / "checkpoint")
        seeds.append(_train_and_quantize(cfg.model_copy(update={"seed_offset": cfg.seed_offset + k}), model_cfg,
                                         init, data_dir, tok_dir, tokenizer, kwd, f"sft-seed{k}")[1])
    if cfg.seeds > 1:
        quant = {**quant, "seeds": [{"seed_offset": cfg.seed_offset + k, "quantization": q["quantization"],
                                     **{key: q.get(key) for key in SPREAD_KEYS}} for k, q in enumerate(seeds)],
                 "spread": spread(seeds)}
    out = workdir.out
    b = quant["int4_bytes"]
    log.info("sft: INT4 %d quantized params: %.0f bytes int4 + %.0f bytes scales vs %.0f bytes fp16 (x%.3f)",
             b["quantized_params"], b["int4_bytes"], b["scale_bytes"], b["fp16_bytes"], b["ratio_with_scales"])
    for name, row in quant["quantization"].items():
        log.info("sft: %-11s held-out ppl %.3f  gsm8k acc %s (n=%d)", name, row["ppl"], row["gsm8k_acc"], row["gsm8k_n"])
    if cfg.use_qat:
        log.info("sft: QAT recovers %s of the PTQ perplexity degradation (target %.2f, met: %s; each model "
                 "vs its own full precision: %s; QAT training's own full-precision cost %s ppl vs PTQ's "
                 "degradation %s ppl, resolved: %s)", quant["qat_recovery_ppl"], RECOVERY_TARGET,
                 quant["qat_target_met"], quant["qat_recovery_ppl_own"], quant["qat_full_minus_full_no_qat_ppl"],
                 quant["ptq_degradation_ppl"], quant["qat_recovery_resolved"])
        if "qat_recovery_facts_ppl" in quant:
            log.info("sft: facts: PTQ costs %.2f%% answer ppl and %.2f accuracy points; QAT recovers %s (ppl) "
                     "and %s (accuracy)", quant["ptq_degradation_facts_ppl_pct"],
                     quant["ptq_degradation_facts_acc_points"], quant["qat_recovery_facts_ppl"],
                     quant["qat_recovery_facts_acc"])
        for key, v in quant.get("spread", {}).items():
            log.info("sft: over %d seeds %s = %.4f +- %.4f", cfg.seeds, key, v["mean"], v["std"])

    export_all(load_state(out / STATE_FILE).eval(), cfg.qat, out / "export", tok_dir)
    evals = json.loads((out / "eval.json").read_text())
    (out / "eval.json").write_text(json.dumps({**evals, **quant}, indent=1))
    return {**result, **quant, "data": data_stats, "qat": cfg.use_qat, "qat_group_size": cfg.qat.group_size}


# GLM-5 post-trains the model that DSA continue-pretraining produced.
BASE = "dsa-adapt"
