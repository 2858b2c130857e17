"""The curation funnel: documents in and out of each step, why they were dropped, decontamination
hits, quality scores and what was packed for pretraining."""
from __future__ import annotations

import base64

from glmforge import pipeline
from glmforge.report.data import RunData
from glmforge.report.pieces import (
    _NR, NOT_RECORDED, _figure, _reasons, fmt, get, note, number, pct, png, section, table, td,
)

# the funnel's stages, from the registry: it ends where tokenizing begins
CURATION = tuple(s.name for s in pipeline.CURATION if s.name not in ("tokenize", "pack"))


def curation(run: RunData) -> str:
    m = {s: run.metrics(s) for s in CURATION}
    quality_cfg = get(run.record.config, "quality") or {}
    mode = quality_cfg.get("mode")
    ingest_in = None
    if number(m["ingest"].get("documents")) is not None and number(m["ingest"].get("quarantined")) is not None:
        ingest_in = m["ingest"]["documents"] + m["ingest"]["quarantined"]
    mh, sem = m["dedup-minhash"], m["dedup-semantic"]
    steps = [
        # (stage, in, out, dropped, text bytes out, why dropped)
        ("ingest", ingest_in, m["ingest"].get("documents"), m["ingest"].get("quarantined"),
         m["ingest"].get("text_bytes"), "quarantined: " + _reasons(m["ingest"].get("quarantine_reasons"))
         + "<br>sources: " + _reasons(m["ingest"].get("documents_per_source"))),
        ("quality", m["quality"].get("documents_in"), m["quality"].get("kept"), m["quality"].get("removed"), None,
         (f"score below threshold {fmt(quality_cfg.get('threshold'))}" if mode == "filter" else
          f"mode {fmt(mode)}: kept all, weighted by score bucket (effective documents "
          f"{fmt(m['quality'].get('effective_documents'))})")),
        ("dedup-exact", m["dedup-exact"].get("documents_in"), m["dedup-exact"].get("kept"),
         m["dedup-exact"].get("removed"), None, "exact duplicates"),
        ("dedup-minhash", mh.get("documents_in"), mh.get("kept"), mh.get("removed"), None,
         f"near duplicates (MinHash: {fmt(mh.get('candidate_pairs'))} candidate pairs, "
         f"{fmt(mh.get('verified_pairs'))} verified, {fmt(mh.get('clusters'))} clusters)"),
        ("dedup-semantic", sem.get("documents_in"), sem.get("kept"), sem.get("removed"), None,
         f"semantic duplicates ({fmt(sem.get('embedder'))}, {fmt(sem.get('clusters'))} clusters)"),
        ("issue-pr", m["issue-pr"].get("pull_requests"), m["issue-pr"].get("pairs"),
         m["issue-pr"].get("skipped"), None, "pull requests skipped: " + _reasons(m["issue-pr"].get("skipped_by_reason"))
         + f"; quarantined lines: {fmt(m['issue-pr'].get('quarantined'))}"),
        ("decontaminate", m["decontaminate"].get("documents_in"), m["decontaminate"].get("kept"),
         m["decontaminate"].get("removed"), None, "eval n-gram hits: " + _reasons(m["decontaminate"].get("hits"))),
    ]
    rows = []
    for stage, n_in, n_out, dropped, text_bytes, why in steps:
        share = dropped / n_in if number(dropped) is not None and number(n_in) else None
        rows.append([td(stage), td(n_in, f"{stage}.in"), td(n_out, f"{stage}.out"), td(dropped, f"{stage}.dropped"),
                     td(None, html_value=pct(share)), td(text_bytes, f"{stage}.text_bytes"),
                     td(parquet_bytes(run, stage), f"{stage}.parquet_bytes"), td(None, html_value=why)])
    out = [funnel_chart(steps),
           table(["step", "in", "out", "dropped", "dropped %", "text bytes", "Parquet bytes out", "why dropped"], rows),
           note("issue-pr's \"in\" counts pull requests and its \"out\" issue-PR pairs; they join the documents "
                "at decontaminate. Text bytes: recorded by ingest only; Parquet bytes: the kept shards' published "
                "size.")]
    hits, sizes = m["decontaminate"].get("hits"), m["decontaminate"].get("eval_examples")
    if isinstance(hits, dict) or isinstance(sizes, dict):
        evals = sorted(set(hits or {}) | set(sizes or {}))
        out.append("<h3>Decontamination hits per eval set</h3>" + table(
            ["eval set", "eval examples", "documents removed"],
            [[td(e), td(get(sizes, e), f"decontaminate.eval_examples.{e}"), td(get(hits, e), f"decontaminate.hits.{e}")]
             for e in evals]) + note(f"A document is removed when it shares a {m['decontaminate'].get('ngram', '?')}-gram "
                                     "with an eval example."))
    else:
        out.append("<h3>Decontamination hits per eval set</h3>" + _NR)
    q = m["quality"]
    quant = q.get("score_quantiles") or {}
    qrows = [[td("mode"), td(mode)], [td("mean score"), td(q.get("mean_score"), "quality.mean_score")]]
    qrows += [[td(f"score quantile {k}"), td(v, f"quality.score_quantiles.{k}")] for k, v in sorted(quant.items())]
    qrows += [[td("effective documents (sum of bucket weights)"), td(q.get("effective_documents"),
                                                                      "quality.effective_documents")]]
    for name, c in sorted((q.get("classifiers") or {}).items()):
        qrows.append([td(f"classifier {name}: held-out precision / recall"),
                      td(None, html_value=f"{fmt(c.get('precision'))} / {fmt(c.get('recall'))} "
                                          f"(n={fmt(c.get('heldout'))})")])
    hist = run.file_bytes("quality", q["histogram"]) if isinstance(q.get("histogram"), str) else None
    hist_html = (f'<img class="chart" alt="quality score histogram" src="data:image/png;base64,'
                 f'{base64.b64encode(hist).decode()}">' if hist else note(f"quality histogram: {NOT_RECORDED}"))
    out.append("<h3>Quality scores and buckets</h3>" + f'<div class="row"><div>{table(["", "value"], qrows)}</div>'
               f"<div>{hist_html}</div></div>")
    p = run.metrics("pack")
    out.append("<h3>Packed for pretraining</h3>" + table(
        ["documents", "after quality upsampling", "train sequences", "train tokens", "val sequences", "val tokens",
         "sequence length"],
        [[td(p.get(k), f"pack.{k}") for k in ("documents", "documents_after_upsampling", "train_sequences",
                                              "train_tokens", "val_sequences", "val_tokens", "seq_len")]]))
    return section("curation", "Curation funnel", "".join(out))


def parquet_bytes(run: RunData, stage: str) -> int | None:
    m = run.manifest(stage)
    if m is None:
        return None
    kept = [f.size for f in m.files if f.path.endswith(".parquet") and not f.path.startswith("removed/")]
    return sum(kept) if kept else None


def funnel_chart(steps: list[tuple]) -> str:
    fig, axes = _figure(1, 9, 0.42 * len(steps) + 0.9)
    ax = axes[0][0]
    ys = list(range(len(steps)))[::-1]
    labelled: set[str] = set()  # one legend entry per colour

    def label(name: str) -> str | None:
        first = name not in labelled
        labelled.add(name)
        return name if first else None

    for y, (stage, n_in, n_out, dropped, *_rest) in zip(ys, steps):
        kept, gone = number(n_out), number(dropped)
        if kept is None:
            ax.text(0, y, f" {NOT_RECORDED}", va="center", fontsize=8, color="#868e96")
            continue
        ax.barh(y, kept, color="#4c6ef5", label=label("out"))
        if gone:
            ax.barh(y, gone, left=kept, color="#fa5252", label=label("dropped"))
        ax.text(kept + (gone or 0), y, f"  {int(kept):,} out" + (f", {int(gone):,} dropped" if gone else ""),
                va="center", fontsize=7)
    ax.set_yticks(ys, [s[0] for s in steps], fontsize=8)
    ax.set_xlabel("documents (issue-pr: pull requests)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title("curation funnel", fontsize=9)
    if labelled:
        ax.margins(x=0.25)
        ax.legend(fontsize=7, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return png(fig, "curation funnel")
