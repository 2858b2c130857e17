"""Training: the loss curves and held-out perplexity of pretraining, the context phases, the DSA
warm-up and adaptation, SFT's loss, and long-context accuracy."""
from __future__ import annotations

from typing import Any

from glmforge import pipeline
from glmforge.report.data import RunData
from glmforge.report.pieces import _NR, _empty, _figure, fmt, get, note, number, plot_steps, png, section, table, td

# the training curves' stages, from the registry, through SFT
CONTEXT = tuple(s.name for s in pipeline.TRAINING if s.name.startswith("context-"))
TRAINING = (*(s.name for s in pipeline.TRAINING), "sft")


def _loss_series(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [("loss", "loss"), ("lm", "LM"), ("mtp", "MTP")] if rows else []


def training(run: RunData) -> str:
    out = []
    rows = []
    for s in TRAINING:
        m = run.metrics(s)
        rows.append([td(s), td(m.get("steps"), f"{s}.steps"), td(m.get("tokens"), f"{s}.tokens"),
                     td(m.get("seq_len"), f"{s}.seq_len"), td(m.get("loss_first"), f"{s}.loss_first"),
                     td(m.get("loss_last"), f"{s}.loss_last"), td(m.get("mtp_loss_last"), f"{s}.mtp_loss_last"),
                     td(m.get("val_ppl_before"), f"{s}.val_ppl_before"), td(m.get("val_ppl_after"), f"{s}.val_ppl_after"),
                     td(m.get("tokens_per_s"), f"{s}.tokens_per_s")])
    out.append(table(["stage", "steps", "tokens", "seq len", "loss first", "loss last", "MTP loss last",
                      "held-out ppl before", "held-out ppl after", "tokens/s"], rows))
    # pretraining and the held-out perplexity through the chain
    fig, axes = _figure(2, 12, 3.2)
    pre = run.steps("pretrain")
    plot_steps(axes[0][0], pre, _loss_series(pre), "pretrain: training loss", "nats/token")
    pts = [(s, number(run.metrics(s).get("val_ppl_after"))) for s in TRAINING]
    pts = [(s, v) for s, v in pts if v is not None]
    ax = axes[0][1]
    if pts:
        ax.plot(range(len(pts)), [v for _, v in pts], marker="o")
        ax.set_xticks(range(len(pts)), [s for s, _ in pts], rotation=30, ha="right", fontsize=7)
        ax.set_title("held-out perplexity after each stage", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(alpha=0.3)
    else:
        _empty(ax, "held-out perplexity after each stage")
    out.append(png(fig, "pretrain loss and held-out perplexity"))
    # the context phases side by side, one y scale
    fig, axes = _figure(len(CONTEXT), 12, 3.0)
    for ax, s in zip(axes[0], CONTEXT):
        m, rows_s = run.metrics(s), run.steps(s)
        plot_steps(ax, rows_s, _loss_series(rows_s), f"{s}: seq {fmt(m.get('seq_len'))}, RoPE θ {fmt(m.get('rope_theta'))}",
                   "nats/token" if s == CONTEXT[0] else "")
    _share_y(axes[0])
    out.append("<h3>Context extension phases</h3>" + png(fig, "context phases loss curves"))
    # DSA warm-up: the indexer's KL to dense attention and how much of it the top-k keeps
    w = run.metrics("dsa-warmup")
    fig, axes = _figure(2, 12, 3.0)
    warm = run.steps("dsa-warmup")
    plot_steps(axes[0][0], warm, [("kl", "KL(dense ‖ indexer)")], "dsa-warmup: indexer KL", "nats")
    plot_steps(axes[0][1], warm,
               [("recall", "top-k capture (all rows)"), ("recall_sparse_rows", "top-k capture (sparse rows)")],
               f"dsa-warmup: attention mass the top-{fmt(w.get('index_topk'))} keeps", "share")
    probe = [[td(label), td(w.get(f"heldout_{k}_before"), f"dsa-warmup.heldout_{k}_before"),
              td(w.get(f"heldout_{k}_after"), f"dsa-warmup.heldout_{k}_after")]
             for k, label in (("kl", "held-out KL"), ("recall", "held-out top-k capture"),
                              ("recall_sparse_rows", "held-out top-k capture, sparse rows"))]
    out.append("<h3>DSA warm-up</h3>" + png(fig, "DSA warm-up KL and top-k capture")
               + table(["probe", "before warm-up", "after warm-up"], probe))
    # dsa-adapt (with its full / SWA baselines) and sft
    fig, axes = _figure(2, 12, 3.0)
    # the DSA run's metrics.jsonl and its baselines' full/ and swa/metrics.jsonl, one line each
    by_step: dict[Any, dict[str, Any]] = {}
    labels = []
    for path in run.files("dsa-adapt", "metrics.jsonl"):
        label = path.rsplit("/", 1)[0] if "/" in path else "dsa"
        labels.append(label)
        for r in run.steps("dsa-adapt", path):
            by_step.setdefault(r.get("step"), {"step": r.get("step")})[label] = r.get("loss")
    rows_v = [by_step[k] for k in sorted(by_step, key=lambda k: number(k) or 0)]
    plot_steps(axes[0][0], rows_v, [(x, x) for x in labels], "dsa-adapt: training loss (DSA and its baselines)",
               "nats/token")
    sft = run.steps("sft")
    plot_steps(axes[0][1], sft, _loss_series(sft), "sft: training loss", "nats/token")
    out.append("<h3>DSA adaptation and SFT</h3>" + png(fig, "dsa-adapt and sft loss curves"))
    out.append("<h3>Long context: accuracy by length</h3>" + long_context_table(run.metrics("dsa-adapt")))
    return section("training", "Training", "".join(out))


def _share_y(axes) -> None:
    lims = [ax.get_ylim() for ax in axes if ax.has_data()]
    if lims:
        lo, hi = min(a for a, _ in lims), max(b for _, b in lims)
        for ax in axes:
            if ax.has_data():
                ax.set_ylim(lo, hi)


def long_context_table(m: dict[str, Any]) -> str:
    acc = m.get("long_context_accuracy")
    if not isinstance(acc, dict):
        return _NR
    lengths = [str(n) for n in m.get("long_context_lengths") or []] or sorted(
        {k for v in acc.values() for k in (v or {})}, key=lambda k: int(k) if k.isdigit() else 0)
    rows = []
    for variant, label in (("full", "full attention"), ("dsa", "DSA (sparse)"),
                           ("swa", f"SWA (window {m.get('swa_window', '?')})")):
        rows.append([td(label)] + [td(get(acc, variant, n), f"dsa-adapt.long_context_accuracy.{variant}.{n}")
                                   for n in lengths])
    base = m.get("baselines") or {}
    text = note("full and SWA are the baselines trained on the same data and token budget; a baseline left out "
                "of dsa_adapt.baselines shows as not recorded.")
    if base:
        text += table(["baseline", "steps", "loss first", "loss last", "held-out loss after"],
                      [[td(b), td(get(v, "steps")), td(get(v, "loss_first")), td(get(v, "loss_last")),
                        td(get(v, "val_loss_after"))] for b, v in sorted(base.items())])
    return table(["attention"] + [f"{n} tokens" for n in lengths], rows) + text
