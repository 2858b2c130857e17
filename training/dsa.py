"""DSA continue-pretraining: the two stages that turn the dense MLA model into a sparse one,
and the long-context comparison that says whether it worked.

    context-3, decontaminate, tokenize ---> dsa-warmup   indexer only, dense attention
    dsa-warmup, decontaminate, tokenize --> dsa-adapt    whole model, top-k attention
                                                         + full and SWA baselines, RULER-like eval

dsa-warmup: every weight but the lightning indexers is frozen (and the MoE router bias, a
buffer, is not updated: no loads are counted), attention stays dense, and the indexer learns
KL(p || softmax(I)) against the dense attention distribution (training.dsa_loss). Reported: the
per-step KL and top-k recall (attention mass inside the indexer's top-k set), and the same on
held-out sequences before and after.

dsa-adapt: top-k selection by the indexer (deterministic top-k), main attention on the selected
keys only. The indexer learns the KL restricted to the selected set from detached inputs, the
trunk the LM (+MTP) loss; the two touch disjoint parameters, so one backward of their sum
trains each on its own loss. The same stage trains, from the same weights, on the same packed
data and token budget, the baselines of the paper's ablation:
    full  the same architecture with dense attention (indexer off): continued dense training;
    swa   sliding-window layers interleaved with full ones (evals.long_context.baseline_configs).
One stage owns the whole comparison so the table is cached, resumed and invalidated as one
thing: the three runs share the packed data, and changing the data or budget reruns all three.
Each run is a train_stage of its own (own checkpoints, resumable). The DSA model is the stage's
artifact; the baselines are published under out/full and out/swa.

The data of both stages: the long-context mix (training.longdata.pack_long) plus retrieval
documents in the evaluation's formats (evals.long_context.training_documents: training keys
only, a different seed), so a small model can learn retrieval at all.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from data_processing.packing import PackedDataset
from evals import long_context
from runtime.stage import Workdir
from model.config import ModelConfig
from model.hf import STATE_FILE, artifact_weights, load_state, save_state, state_config
from model.model import GLMModel
from training.config import LongDataConfig, Optimizer, RetrievalDocsConfig
from training.data import eval_batches
from training.dsa_loss import forward_kwargs, query_rows, warmup_indexer_loss
from training import synthetic
from training.longdata import pack_stage_data
from training.objectives import DsaSparseSpec, DsaWarmupSpec, LMSpec
from training.drivers import train_stage

log = logging.getLogger("glmforge")
PROBE_FILE = "indexer_probe.json"


# ---------------------------------------------------------------- config
class LongEvalConfig(BaseModel):
    """The RULER-like suite every model of dsa-adapt is scored on (one suite for all)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lengths: tuple[int, ...] = Field((256, 512, 1024), description=(
        "prompt lengths (tokens) the suite is generated at"))
    n_per_task: int = Field(10, ge=1, description="examples per task and length")
    tasks: tuple[str, ...] = Field(long_context.TASKS, description="the text (needle) tasks; may be "
                                   "empty when mqar_docs > 0")
    mqar_docs: int = Field(0, ge=0, description="MQAR documents per length (training.synthetic layout, "
                           "every key queried once); needs a model pretrained with synthetic data")
    mqar_pairs: int = Field(16, ge=1, le=synthetic.KEYS, description="key-value pairs per MQAR document")
    seed: int = Field(0, description="seed of the suite's generation")
    swa_fraction: float = Field(0.25, gt=0, lt=1, description="SWA window = this x the shortest length")

    @model_validator(mode="after")
    def _check(self) -> "LongEvalConfig":
        if self.tasks or not self.mqar_docs:
            long_context.check_lengths_and_tasks(self.lengths, self.tasks, "long_eval.")
        if self.mqar_docs:   # fails here, not after training, when a length cannot hold the pairs
            for n in self.lengths:
                synthetic.mqar_spec(synthetic.FIRST_FILLER_ID + 1, n, self.mqar_pairs)
        return self


class DsaDataConfig(LongDataConfig):
    """What both DSA stages share: the packed long-context mix plus retrieval documents."""

    retrieval: RetrievalDocsConfig = Field(RetrievalDocsConfig(), description=(
        "synthetic retrieval documents mixed into both DSA stages' data"))


class DsaWarmupConfig(DsaDataConfig):
    """Stage 1 (GLM-5 / DeepSeek-V3.2: lr 1e-3, dense attention, indexer only)."""

    lr: float = Field(1e-3, gt=0, description=(
        "peak learning rate of the indexer warm-up (GLM-5 / DeepSeek-V3.2: 1e-3)"))
    optimizer: Optimizer = Field("adamw", description=(
        "the warm-up trains the indexer only, with AdamW by default (see the training stages' optimizer)"))
    probe_sequences: int = Field(8, ge=1, description="held-out sequences for KL/recall before and after")


class DsaAdaptConfig(DsaDataConfig):
    """Stage 2 (sparse adaptation) and the comparison."""

    indexer_loss_coeff: float = Field(1.0, gt=0, description="weight of the indexer's KL in the summed loss")
    baselines: tuple[str, ...] = Field(("full", "swa"), description="comparison models trained with "
                                       "the same data and budget; subset of full, swa")
    long_eval: LongEvalConfig = Field(LongEvalConfig(), description=(
        "the long-context suite the DSA model and its baselines are scored on"))

    @model_validator(mode="after")
    def _check_baselines(self) -> "DsaAdaptConfig":
        bad = [b for b in self.baselines if b not in ("full", "swa")]
        if bad or len(set(self.baselines)) != len(self.baselines):
            raise ValueError(f"baselines must be distinct entries of ('full', 'swa'), got {self.baselines}")
        return self


# ---------------------------------------------------------------- helpers (stage process)
def _base_weights(parent: Path) -> tuple[Path, ModelConfig]:
    init = artifact_weights(parent)
    return init, state_config(init)


@torch.no_grad()
def indexer_probe(model: GLMModel, data_dir: Path, sequences: int) -> dict[str, float]:
    """Held-out KL(p || softmax(I)) and top-k recall of a model's indexers (dense forward)."""
    model.eval()
    ds = PackedDataset(data_dir, "val")
    sums: dict[str, float] = {}
    n = 0
    for b in eval_batches(ds, 1, sequences):
        out = model(b["input_ids"], doc_ids=b["doc_ids"], **forward_kwargs("warmup"))
        _, m = warmup_indexer_loss(out, query_rows(b))
        for k in ("kl", "recall", "recall_sparse_rows"):
            if not math.isnan(m[k]):
                sums[k] = sums.get(k, 0.0) + m[k]
                sums[f"n_{k}"] = sums.get(f"n_{k}", 0.0) + 1
        n += 1
    assert n > 0, "held-out split is empty"
    return {k: sums[k] / sums[f"n_{k}"] for k in ("kl", "recall", "recall_sparse_rows") if f"n_{k}" in sums}


def _model(path: Path, cfg: ModelConfig | None = None) -> GLMModel:
    model = load_state(path)
    if cfg is not None and cfg != model.config:
        state = model.state_dict()
        model = GLMModel(cfg)
        model.load_state_dict(state, strict=True)
    return model


def without_indexers(init: Path, cfg: ModelConfig, out: Path) -> Path:
    """The init weights for a variant with fewer DSA layers (SWA): the dropped layers' indexer
    weights are the only keys allowed to go; anything else missing or extra is an error."""
    if out.exists():
        return out
    state = load_state(init).state_dict()
    model = GLMModel(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or any(".indexer." not in k for k in unexpected):
        raise ValueError(f"{cfg.layer_kinds} does not fit the weights in {init}: missing {missing}, "
                         f"unexpected {[k for k in unexpected if '.indexer.' not in k]}")
    tmp = out.with_suffix(".tmp")
    save_state(model, tmp)
    tmp.replace(out)
    return out


def long_context_table(models: dict[str, Path], tokenizer_dir: Path, cfg: LongEvalConfig, window: int
                       ) -> tuple[dict[str, dict[int, float]], dict[str, dict]]:
    """Every model on ONE generated suite -> ({method: {length: acc, the mean over tasks}},
    per-task detail). MQAR (cfg.mqar_docs) also reports "mqar_beyond_window": the accuracy on the
    queries whose key lies `window` or more tokens back, out of a sliding window's reach."""
    from tokenizers import Tokenizer

    from data_processing.tokenizer import TOKENIZER_FILE
    from evals.mqar import mqar_accuracy

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / TOKENIZER_FILE))
    base = tok.get_vocab_size()
    examples = (long_context.generate_suite(tok, cfg.lengths, cfg.n_per_task, cfg.seed,
                                            long_context.default_filler_texts(), cfg.tasks) if cfg.tasks else [])
    table, detail = {}, {}
    for name, path in models.items():
        model = load_state(path).eval()
        too_long = [n for n in cfg.lengths if n > model.config.max_position_embeddings]
        if too_long:
            raise ValueError(f"long_eval.lengths {too_long} exceed max_position_embeddings="
                             f"{model.config.max_position_embeddings}")
        acc = long_context.evaluate(model, tok, examples) if examples else {}
        by_task = {task: {int(n): a for n, a in by_len.items()} for task, by_len in acc.items() if task != "overall"}
        if cfg.mqar_docs:
            synthetic.check_vocab(model.config.vocab_size, base, "long_eval.mqar_docs")
            by_task["mqar"], by_task["mqar_beyond_window"] = {}, {}
            for n in cfg.lengths:
                r = mqar_accuracy(model, synthetic.mqar_spec(base, n, cfg.mqar_pairs), cfg.mqar_docs,
                                  f"eval/{cfg.seed}/{n}", windows=(window,))
                by_task["mqar"][int(n)] = r["acc"]
                by_task["mqar_beyond_window"][int(n)] = r[f"acc_beyond_{window}"]
        scored = [t for t in by_task if t != "mqar_beyond_window"]
        table[name] = {int(n): sum(by_task[t][int(n)] for t in scored) / len(scored) for n in cfg.lengths}
        detail[name] = {**by_task, "overall": table[name]}
        log.info("dsa-adapt: long-context accuracy %s %s", name, table[name])
    return table, detail


def _first_values(records_path: Path, keys: tuple[str, ...]) -> dict[str, float]:
    """{key_first: value at step 1}: summarize() gives the *_last means, the curve's other end."""
    from training import metrics

    records = metrics.read(records_path)
    out = {}
    for k in keys:
        if records and k in records[0]:
            out[f"{k}_first"] = records[0][k]
    return out


# ---------------------------------------------------------------- stage functions
def run_warmup(cfg: DsaWarmupConfig, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]:
    init, base = _base_weights(inputs["context-3"])
    if "dsa" not in base.layer_kinds:
        raise ValueError("context-3's model has no DSA layers: there is no indexer to warm up")
    # Dense attention (the held-out LM loss is then that of the frozen dense model, before and
    # after); deterministic top-k so the recall measured here is the selection used later.
    model_cfg = base.replace(dense_attention=True, index_topk_method="deterministic",
                             max_position_embeddings=max(base.max_position_embeddings, cfg.seq_len))
    data_dir, packed = pack_stage_data(cfg, inputs, workdir)
    result = train_stage("dsa-warmup", cfg, model_cfg, data_dir, inputs["tokenize"], workdir, init,
                         objective=DsaWarmupSpec())
    probe = {"before": indexer_probe(_model(init, model_cfg), data_dir, cfg.probe_sequences),
             "after": indexer_probe(load_state(workdir.out / STATE_FILE), data_dir,
                                    cfg.probe_sequences)}
    (workdir.out / PROBE_FILE).write_text(json.dumps(probe, indent=1))
    log.info("dsa-warmup: held-out KL %.4f -> %.4f, top-k recall %.4f -> %.4f", probe["before"]["kl"],
             probe["after"]["kl"], probe["before"]["recall"], probe["after"]["recall"])
    return {**result, **_first_values(workdir.checkpoint / "metrics.jsonl", ("kl", "recall", "recall_sparse_rows")),
            "heldout_kl_before": probe["before"]["kl"], "heldout_kl_after": probe["after"]["kl"],
            "heldout_recall_before": probe["before"]["recall"], "heldout_recall_after": probe["after"]["recall"],
            "heldout_recall_sparse_rows_before": probe["before"].get("recall_sparse_rows"),
            "heldout_recall_sparse_rows_after": probe["after"].get("recall_sparse_rows"),
            "index_topk": model_cfg.index_topk,
            "mix_chars_share": packed["mix_chars_share"], "retrieval_documents": packed["extra_documents"],
            "train_sequences": packed["splits"]["train"]["sequences"]}


def run_adapt(cfg: DsaAdaptConfig, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]:
    init, base = _base_weights(inputs["dsa-warmup"])
    base = base.replace(max_position_embeddings=max(base.max_position_embeddings, cfg.seq_len,
                                                    max(cfg.long_eval.lengths)))
    variants = long_context.baseline_configs(base, cfg.long_eval.lengths, cfg.long_eval.swa_fraction)
    configs = {
        "dsa": base.replace(dense_attention=False, index_topk_method="deterministic"),
        # the DSA architecture with the indexer off: dense MLA, and the same checkpoint format
        # as the other two (baseline_configs' "full" has no indexers and no HF export)
        "full": base.replace(dense_attention=True),
        "swa": variants["swa"],
    }
    data_dir, packed = pack_stage_data(cfg, inputs, workdir)
    runs: dict[str, dict] = {}
    weights: dict[str, Path] = {}
    for name in ("dsa", *cfg.baselines):
        # Every run: the same weights, data (same order: same seed) and TrainConfig, so the
        # same token budget; only the attention and the objective differ.
        out = workdir.out if name == "dsa" else workdir.out / name
        wd = workdir.sub(out, workdir.checkpoint / name)
        start = init
        if name == "swa":
            start = without_indexers(init, configs["swa"], workdir.checkpoint / "swa-init.safetensors")
        objective = DsaSparseSpec(indexer_loss_coeff=cfg.indexer_loss_coeff) if name == "dsa" else LMSpec()
        runs[name] = train_stage(f"dsa-adapt/{name}", cfg, configs[name], data_dir, inputs["tokenize"], wd, start,
                                 objective=objective)
        weights[name] = out / STATE_FILE

    table, detail = long_context_table(weights, inputs["tokenize"], cfg.long_eval, configs["swa"].sliding_window)
    (workdir.out / "long_context.json").write_text(json.dumps({"accuracy": table, "by_task": detail}, indent=1))
    probe_path = Path(inputs["dsa-warmup"]) / PROBE_FILE
    probe = json.loads(probe_path.read_text()) if probe_path.exists() else {}
    keep = ("steps", "tokens", "loss_first", "loss_last", "lm_loss_last", "val_loss_before", "val_loss_after")
    return {**runs["dsa"], **_first_values(workdir.checkpoint / "dsa" / "metrics.jsonl", ("kl",)),
            "long_context_accuracy": table, "long_context_by_task": detail,
            "long_context_lengths": list(cfg.long_eval.lengths),
            "baselines": {name: {k: runs[name].get(k) for k in keep} for name in cfg.baselines},
            "swa_window": configs["swa"].sliding_window, "index_topk": base.index_topk,
            "warmup_recall_before": probe.get("before", {}).get("recall"),
            "warmup_recall_after": probe.get("after", {}).get("recall"),
            "warmup_recall_sparse_rows_after": probe.get("after", {}).get("recall_sparse_rows"),
            "mix_chars_share": packed["mix_chars_share"], "retrieval_documents": packed["extra_documents"]}
