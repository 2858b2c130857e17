"""SFT and INT4: the quantization table (PTQ and QAT against full precision), the INT4 export,
the spread over seeds and the SFT data."""
from __future__ import annotations

from glmforge.report.data import RunData
from glmforge.report.pieces import _NR, NOT_RECORDED, _reasons, fmt, get, note, section, table, td

# the quantization table's models, in the order the argument runs (posttrain.sft MODELS)
QUANT_MODELS = (("full_no_qat", "full precision, trained without QAT"), ("ptq_int4", "PTQ: that model rounded to INT4"),
                ("full", "full precision, trained with QAT"), ("qat_int4", "QAT: that model in INT4"))
SPREAD_KEYS = ("ptq_degradation_ppl", "qat_recovery_ppl", "ptq_degradation_facts_ppl_pct",
               "ptq_degradation_facts_acc_points", "qat_recovery_facts_ppl", "qat_recovery_facts_acc")


def sft_section(run: RunData) -> str:
    m = run.metrics("sft")
    quant = m.get("quantization") if isinstance(m.get("quantization"), dict) else {}
    cols = [("ppl", "held-out ppl"), ("loss", "held-out loss"), ("gsm8k_acc", "GSM8K acc"), ("gsm8k_n", "GSM8K n")]
    if any("facts_ppl" in (r or {}) for r in quant.values()):
        cols += [("facts_ppl", "facts answer ppl"), ("facts_acc", "facts acc")]
    rows = [[td(label), td(name)] + [td(get(quant, name, k), f"sft.quantization.{name}.{k}") for k, _ in cols]
            for name, label in QUANT_MODELS]
    out = [table(["model", "key"] + [c for _, c in cols], rows)]
    summary_keys = [("qat_recovery_ppl", "QAT recovery of PTQ's perplexity cost"),
                    ("qat_recovery_target", "recovery target"), ("qat_target_met", "target met"),
                    ("ptq_degradation_ppl", "PTQ degradation (ppl)"), ("qat_degradation_ppl", "QAT INT4 degradation (ppl)"),
                    ("qat_int4_minus_full_ppl", "QAT's own INT4 gap (ppl)"),
                    ("qat_full_minus_full_no_qat_ppl", "QAT training's full-precision cost (ppl)"),
                    ("qat_recovery_ppl_own", "recovery, each model vs its own full precision"),
                    ("qat_recovery_resolved", "recovery resolved")]
    summary_keys += [(k, k.replace("_", " ")) for k in SPREAD_KEYS[2:] if k in m]
    sizes = m.get("int4_bytes") or {}
    out.append('<div class="row"><div>' + table(["", "value"], [[td(label), td(m.get(k), f"sft.{k}")]
                                                                 for k, label in summary_keys]) + "</div><div>"
               + table(["INT4 export", "value"], [[td(k.replace("_", " ")), td(sizes.get(k), f"sft.int4_bytes.{k}")]
                                                  for k in ("quantized_params", "fp16_bytes", "int4_bytes", "scale_bytes",
                                                            "ratio_with_scales")]) + "</div></div>")
    seeds, spread = m.get("seeds"), m.get("spread")
    if isinstance(seeds, list) and seeds:
        keys = [k for k in SPREAD_KEYS if any(k in s for s in seeds)]
        rows = [[td(f"seed offset {s.get('seed_offset')}")] + [td(s.get(k)) for k in keys] for s in seeds]
        rows.append([td("mean ± std")] + [td(None, f"sft.spread.{k}", html_value=(
            f"{fmt(get(spread, k, 'mean'))} ± {fmt(get(spread, k, 'std'))}" if get(spread, k, "mean") is not None
            else _NR)) for k in keys])
        out.append("<h3>Per seed</h3>" + table(["seed"] + [k.replace("_", " ") for k in keys], rows))
    else:
        out.append("<h3>Per seed</h3>" + note(f"one seed (sft.seeds = 1): spread {NOT_RECORDED}"))
    data = m.get("data") or {}
    if data:
        out.append("<h3>SFT data</h3>" + table(["train sequences", "train target tokens", "val sequences", "samples"],
                                               [[td(data.get("train_sequences")), td(data.get("train_target_tokens")),
                                                 td(data.get("val_sequences")), td(None, html_value=_reasons(data.get("samples")))]]))
    return section("sft", "SFT and INT4", "".join(out))
