"""One HTML page of a whole run: what `glmforge report` writes and the pipeline flow links to.

Everything comes from the store alone: the run record (runs/ID.json), the manifests of the run's
artifacts and the small files the stages publish in them (metrics.jsonl, gates.json, the quality
histogram). So the page is the same for a local or an S3 store, and it can be written for a
finished, failed or running run. It is self-contained: inline CSS, charts as base64 PNGs
(matplotlib), no script and nothing fetched (a Content-Security-Policy says so to the browser),
so it opens from disk and can be mailed. Every string is escaped; a metric a stage did not record
shows as "not recorded", never as 0.

Sections: the run and its stages (states, wall time, the command that resumes a failed stage),
the curation funnel, training (loss curves, context phases, DSA warm-up, long context), SFT and
INT4 (the quantization table), post-training (rewards, held-out accuracy, masked shares,
staleness, reward model, gates, reward re-checks), and lineage (artifacts, parents, digests).

Numbers sit in cells marked data-metric="STAGE.path.to.metric", which the tests compare with
`glmforge status --json`.
"""
from __future__ import annotations

import base64
import datetime as dt
import hashlib
import html
import io
import json
import math
import shlex
from pathlib import Path
from typing import Any, Iterable

from glmforge import pipeline
from runtime.runner import RunRecord
from runtime.store import Manifest, Store, artifact_prefix, default_home

NOT_RECORDED = "not recorded"
_NR = f'<span class="nr">{NOT_RECORDED}</span>'

# the panels' stages, from the registry: the curation funnel ends where tokenizing begins, the
# training curves run through SFT, the post-training panels begin after it
CURATION = tuple(s.name for s in pipeline.CURATION if s.name not in ("tokenize", "pack"))
CONTEXT = tuple(s.name for s in pipeline.TRAINING if s.name.startswith("context-"))
TRAINING = (*(s.name for s in pipeline.TRAINING), "sft")
POSTTRAIN = tuple(s.name for s in pipeline.POSTTRAIN if s.name != "sft")
RL = ("rl-reasoning", "rl-agentic", "rl-general")   # the stages with reward curves
# the quantization table's models, in the order the argument runs (posttrain.sft MODELS)
QUANT_MODELS = (("full_no_qat", "full precision, trained without QAT"), ("ptq_int4", "PTQ: that model rounded to INT4"),
                ("full", "full precision, trained with QAT"), ("qat_int4", "QAT: that model in INT4"))
SPREAD_KEYS = ("ptq_degradation_ppl", "qat_recovery_ppl", "ptq_degradation_facts_ppl_pct",
               "ptq_degradation_facts_acc_points", "qat_recovery_facts_ppl", "qat_recovery_facts_acc")
STATE_COLOURS = {"done": "#2f9e44", "cached": "#4dabf7", "failed": "#e03131", "interrupted": "#f08c00",
                 "running": "#7048e8", "not run": "#adb5bd"}


# ---------------------------------------------------------------- reading the run


class RunData:
    """The run record and, per stage, its manifest and published files, read lazily from the store."""

    def __init__(self, store: Store, record: RunRecord):
        self.store, self.record = store, record
        self.stages = {s["name"]: s for s in record.stages}
        self.problems: list[str] = []  # files that could not be read, shown in the header
        self._manifests: dict[str, Manifest | None] = {}

    def metrics(self, stage: str) -> dict[str, Any]:
        return (self.stages.get(stage) or {}).get("metrics") or {}

    def manifest(self, stage: str) -> Manifest | None:
        if stage not in self._manifests:
            key = (self.stages.get(stage) or {}).get("key")
            m = None
            if key and self.stages[stage]["state"] in ("done", "cached"):
                try:
                    m = self.store.manifest(stage, key)
                except Exception as e:  # a damaged manifest: the rest of the page still shows
                    self.problems.append(f"{stage}/{key}: manifest unreadable ({e})")
            self._manifests[stage] = m
        return self._manifests[stage]

    def files(self, stage: str, suffix: str) -> list[str]:
        m = self.manifest(stage)
        return sorted(f.path for f in m.files if f.path.endswith(suffix)) if m else []

    def file_bytes(self, stage: str, path: str) -> bytes | None:
        """A published file, checked against its manifest digest; None when absent or damaged."""
        m = self.manifest(stage)
        entry = next((f for f in m.files if f.path == path), None) if m else None
        if entry is None:
            return None
        where = f"{artifact_prefix(m.stage, m.key)}/{m.data_prefix}/{path}"
        try:
            data = self.store.get_bytes(where)
        except FileNotFoundError:
            self.problems.append(f"{self.store.uri}/{where}: listed in the manifest but missing")
            return None
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            self.problems.append(f"{self.store.uri}/{where}: content does not match the manifest digest")
            return None
        return data

    def json_file(self, stage: str, path: str) -> Any | None:
        data = self.file_bytes(stage, path)
        try:
            return json.loads(data) if data is not None else None
        except ValueError as e:
            self.problems.append(f"{stage}/{path}: not JSON ({e})")
            return None

    def steps(self, stage: str, path: str = "metrics.jsonl") -> list[dict[str, Any]]:
        """The per-step records of a stage's metrics.jsonl ([] when it has none)."""
        data = self.file_bytes(stage, path)
        rows = []
        for line in (data or b"").decode(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a torn last line of an interrupted writer
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def shown_state(self, stage: str) -> str:
        s = self.stages.get(stage)
        if s is None:
            return "not run"
        # execute() stamps `started` before a stage runs; the state says "not run" until it ends
        if s["state"] == "not run" and s.get("started") and s.get("seconds") is None \
                and self.record.shown_state() == "running":
            return "running"
        return s["state"]


# ---------------------------------------------------------------- HTML pieces


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def get(d: Any, *path: str) -> Any:
    """d[path[0]][path[1]]...; None when any step is missing."""
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def fmt(v: Any) -> str:
    """A value as escaped HTML: ints with thousands separators, floats to 4 significant digits."""
    if v is None:
        return _NR
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else esc(v)
    if isinstance(v, (list, tuple)):
        return esc(", ".join(map(str, v))) if v else "none"
    if isinstance(v, dict):
        return esc(json.dumps(v, sort_keys=True)) if v else "none"
    return esc(v)


def pct(v: Any) -> str:
    x = number(v)
    return _NR if x is None else f"{100 * x:.1f}%"


def td(v: Any, metric: str | None = None, html_value: str | None = None, cls: str = "") -> str:
    attrs = (f' data-metric="{esc(metric)}"' if metric else "") + (f' class="{esc(cls)}"' if cls else "")
    return f"<td{attrs}>{html_value if html_value is not None else fmt(v)}</td>"


def table(head: Iterable[str], rows: Iterable[Iterable[str]], cls: str = "") -> str:
    """`rows`: lists of <td> strings (td()); the header is escaped here."""
    h = "".join(f"<th>{esc(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(r) + "</tr>" for r in rows)
    return f'<table class="{esc(cls)}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


def section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{esc(anchor)}"><h2>{esc(title)}</h2>{body}</section>'


def first_last(v: Any) -> tuple[Any, Any]:
    return get(v, "first"), get(v, "last")


# ---------------------------------------------------------------- charts


def _figure(ncols: int, width: float, height: float, nrows: int = 1):
    from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend

    fig = Figure(figsize=(width, height))
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def png(fig, alt: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight", metadata={"Software": None})
    data = base64.b64encode(buf.getvalue()).decode()
    return f'<img class="chart" alt="{esc(alt)}" src="data:image/png;base64,{data}">'


def _empty(ax, title: str) -> None:
    ax.text(0.5, 0.5, NOT_RECORDED, ha="center", va="center", transform=ax.transAxes, color="#868e96")
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_steps(ax, rows: list[dict[str, Any]], series: list[tuple[str, str]], title: str, ylabel: str = "") -> bool:
    """One line per (key, label) of the per-step rows; "not recorded" when none has a value."""
    drawn, steps = 0, set()
    for key, label in series:
        pts = [(r.get("step", i + 1), number(r.get(key))) for i, r in enumerate(rows)]
        pts = [(x, y) for x, y in pts if y is not None and number(x) is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) <= 40 else None, ms=3, lw=1.4, label=label)
            drawn += 1
            steps.update(xs)
    if not drawn:
        _empty(ax, title)
        return False
    from matplotlib.ticker import MaxNLocator

    if len(steps) <= 8:  # a short run: its own steps, not fractions of one
        ax.set_xticks(sorted(steps))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if drawn > 1:
        ax.legend(fontsize=7)
    return True


# ---------------------------------------------------------------- sections


def config_digest(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def _duration(start: str | None, end: str | None) -> float | None:
    try:
        return (dt.datetime.fromisoformat(end) - dt.datetime.fromisoformat(start)).total_seconds()
    except (TypeError, ValueError):
        return None


def run_command(source: dict[str, Any], store_uri: str) -> str:
    """The `glmforge run` that continues this run's config (published stages are reused)."""
    cmd = ["glmforge", "run"]
    if source.get("config_file"):
        cmd += ["--config", source["config_file"]]
    elif source.get("preset"):
        cmd += ["--preset", source["preset"]]
    for o in source.get("overrides") or []:
        cmd += ["--set", o]
    if source.get("until"):
        cmd += ["--until", source["until"]]
    return shlex.join(cmd + ["--store", store_uri])


def header(run: RunData) -> str:
    rec, names = run.record, [s["name"] for s in run.record.stages]
    state = rec.shown_state()
    src = rec.source
    overrides = src.get("overrides") or []
    info = [
        ("run", esc(rec.id)), ("state", f'<span class="state s-{esc(state.replace(" ", "-"))}">{esc(state)}</span>'),
        ("preset", fmt(src.get("preset")) if not src.get("config_file") else "—"),
        ("config file", fmt(src.get("config_file")) if src.get("config_file") else "—"),
        ("overrides", f"{len(overrides)}" + (f"<details><summary>show</summary><pre>{esc(chr(10).join(overrides))}</pre>"
                                             "</details>" if overrides else "")),
        ("config digest", f"<code>{esc(config_digest(rec.config))}</code>"),
        ("store", f"<code>{esc(run.store.uri)}</code>"),
        ("started", fmt(rec.started)), ("ended", fmt(rec.finished) if rec.finished else "—"),
        ("wall time (s)", fmt(_seconds(_duration(rec.started, rec.finished)))),
    ]
    if state == "running":
        info.append(("last heartbeat", fmt(rec.heartbeat)))
    out = ['<table class="kv"><tbody>' + "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in info)
           + "</tbody></table>"]
    rows = []
    for i, name in enumerate(names, 1):
        s = run.stages[name]
        shown = run.shown_state(name)
        err = s.get("error")
        err_html = "" if not err else (f"<details><summary>{esc(err.splitlines()[0][:160])}</summary>"
                                       f"<pre>{esc(err)}</pre></details>")
        rows.append([td(i), td(name), td(shown, f"{name}.state", cls=f"state s-{shown.replace(' ', '-')}"),
                     td(None, html_value=f"<code>{esc(s.get('key') or '—')}</code>"),
                     td(s.get("started") if s.get("started") else None),
                     td(number(s.get("seconds")), f"{name}.seconds"), td(None, html_value=err_html or "")])
    out.append('<div class="row"><div>' + table(["#", "stage", "state", "key", "started", "wall s", "error"], rows)
               + "</div><div>" + wall_chart(run, names) + "</div></div>")
    stuck = [n for n in names if run.shown_state(n) in ("failed", "interrupted")]
    if stuck:
        cmds = [f"glmforge resume {shlex.quote(n)} --run {shlex.quote(rec.id)} --store {shlex.quote(run.store.uri)}"
                for n in stuck]
        out.append("<h3>Resume</h3>" + note("Re-runs the stage from its last checkpoint, reusing every artifact "
                                            "upstream; the run record is updated.")
                   + "".join(f"<pre class=cmd>{esc(c)}</pre>" for c in cmds))
        if any(run.shown_state(n) == "not run" for n in names):
            out.append(note("Then the stages not run yet, with the same config (published stages are reused):")
                       + f"<pre class=cmd>{esc(run_command(src, run.store.uri))}</pre>")
    if run.problems:
        out.append("<h3>Unreadable files</h3><ul>" + "".join(f"<li>{esc(p)}</li>" for p in run.problems) + "</ul>")
    return section("run", f"Run {rec.id}", "".join(out))


def _seconds(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def wall_chart(run: RunData, names: list[str]) -> str:
    if all(number(run.stages[n].get("seconds")) is None for n in names):
        return note(f"wall time per stage: {NOT_RECORDED} (a run recorded before glmforge kept it, or a fully "
                    "cached run recorded without Prefect)")
    fig, axes = _figure(1, 6.2, 0.26 * len(names) + 0.9)
    ax = axes[0][0]
    ys = list(range(len(names)))[::-1]
    longest = max([number(run.stages[n].get("seconds")) or 0.0 for n in names] + [1e-9])
    for y, n in zip(ys, names):
        sec, shown = number(run.stages[n].get("seconds")), run.shown_state(n)
        if sec is None:
            ax.text(0, y, f" {shown}: {NOT_RECORDED}", va="center", fontsize=7, color="#868e96")
            continue
        ax.barh(y, sec, color=STATE_COLOURS.get(shown, "#868e96"))
        ax.text(sec + longest * 0.01, y, f"{sec:.1f} s ({shown})", va="center", fontsize=7)
    ax.set_yticks(ys, names, fontsize=7)
    ax.set_xlim(0, longest * 1.3)
    ax.set_xlabel("wall time in this run (s)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title("wall time per stage", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return png(fig, "wall time per stage")


def _reasons(d: Any) -> str:
    if not isinstance(d, dict):
        return _NR
    return ", ".join(f"{esc(k)}: {fmt(v)}" for k, v in sorted(d.items())) or "none"


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


def _binomial_se(p: Any, n: Any) -> float | None:
    p, n = number(p), number(n)
    return math.sqrt(p * (1 - p) / n) if p is not None and n and 0 <= p <= 1 else None


def _acc_cell(p: Any, se: Any, n: Any, metric: str) -> str:
    if number(p) is None:
        return td(None, metric)
    if number(se) is not None:
        return td(None, metric, f"{fmt(p)} ± {fmt(se)}")
    derived = _binomial_se(p, n)
    return td(None, metric, f"{fmt(p)} ± {fmt(derived)}†" if derived is not None else f"{fmt(p)} ± {_NR}")


def posttraining(run: RunData) -> str:
    out = [reward_charts(run)]
    rows = []
    for s in (*RL, "distill"):
        m = run.metrics(s)
        key = "reverse_kl" if s == "distill" else "reward"
        f, l = first_last(m.get(key))
        rows.append([td(s), td(key.replace("_", " ")), td(m.get("steps"), f"{s}.steps"),
                     td(f, f"{s}.{key}.first"), td(l, f"{s}.{key}.last")])
    out.append(table(["stage", "quantity", "steps", "first", "last"], rows)
               + note("first / last: mean over the first and the last tenth of the steps (at least one)."))
    # held-out accuracy before/after
    rows = []
    for s, key, label in (("rl-reasoning", "heldout_accuracy", "held-out reasoning prompts, greedy"),
                          ("rl-reasoning", "heldout_sampled_accuracy", "held-out reasoning prompts, sampled"),
                          ("rl-reasoning", "gsm8k_test_accuracy", "GSM8K test"), ("rl-agentic", "heldout_accuracy", "greedy"),
                          ("rl-agentic", "heldout_sampled_accuracy", "sampled")):
        v = run.metrics(s).get(key)
        if not isinstance(v, dict):
            mid = f"{s}.{key}"
            rows.append([td(s), td(label or "held-out tasks")]
                        + [td(None, f"{mid}.{k}") for k in ("n", "before", "after", "gain_in_stderr")])
            continue
        groups = ([(label, v, f"{s}.{key}")] if "before" in v      # per environment (rl-agentic):
                  else [(f"{env}, {label}", e, f"{s}.{key}.{env}") for env, e in sorted(v.items())])
        for name, e, mid in groups:
            rows.append([td(s), td(name), td(get(e, "n"), f"{mid}.n"),
                         _acc_cell(get(e, "before"), get(e, "stderr_before"), get(e, "n"), f"{mid}.before"),
                         _acc_cell(get(e, "after"), get(e, "stderr_after"), get(e, "n"), f"{mid}.after"),
                         td(get(e, "gain_in_stderr"), f"{mid}.gain_in_stderr")])
    out.append("<h3>Held-out accuracy</h3>" + table(["stage", "eval", "n", "before ± s.e.", "after ± s.e.",
                                                      "gain in s.e."], rows)
               + note("sampled: the mean of k samples per prompt at the rollout temperature (the held-out expected "
                      "reward), its standard error over the prompts. † the stage recorded n but not the standard "
                      "error: binomial √(p(1−p)/n), computed here."))
    # distillation: how much of each teacher's domain the student kept
    dom = run.metrics("distill").get("domain_accuracy")
    if isinstance(dom, dict) and dom:
        drows = [[td(t), td(e), td(get(v, "teacher"), f"distill.domain_accuracy.{t}.{e}.teacher"),
                  td(get(v, "before"), f"distill.domain_accuracy.{t}.{e}.before"),
                  td(get(v, "after"), f"distill.domain_accuracy.{t}.{e}.after"),
                  td(get(v, "recovered"), f"distill.domain_accuracy.{t}.{e}.recovered")]
                 for t, evals in sorted(dom.items()) for e, v in sorted(evals.items())]
        out.append("<h3>Distillation: each teacher's domain</h3>"
                   + table(["teacher stage", "eval", "teacher's score", "student before", "student after",
                            "recovered"], drows))
    # masked shares
    rows = []
    for s in (*RL, "distill"):
        m, steps = run.metrics(s), run.steps(s)
        mis = m.get("mismatch") if isinstance(m.get("mismatch"), dict) else {}
        rows.append([td(s)] + [_share_cell(m, steps, k, f"{s}.{k}")
                               for k in ("icepop_masked_fraction", "is_masked_fraction")]
                    + [td(None, f"{s}.mismatch.{k}", _first_last(mis.get(k))) for k in ("abs_logp", "k3")])
    out.append("<h3>Train/inference mismatch and the tokens it masks</h3>"
               + table(["stage", "IcePop masked share", "IS masked share", "mean |Δ log p| (first → last)",
                        "K3 KL(rollout‖train) (first → last)"], rows)
               + note("‡ the stage did not record it: the mean over the steps of its metrics.jsonl. The "
                      "mismatch is between the trainer's and the rollout engine's log-probs of the same tokens "
                      "under the same weights (fake-INT4 rollouts, kernels, batch shapes)."))
    out.append(staleness(run))
    out.append(reward_model(run))
    out.append(gates_section(run))
    out.append(recheck_section(run))
    out.append(swe_envs_section(run))
    out.append(rl_prompts_section(run))
    out.append(judges_section(run))
    return section("posttraining", "Post-training", "".join(out))


def judges_section(run: RunData) -> str:
    """rl-general's reward sources scored against the verified outcome before training."""
    m = run.metrics("rl-general").get("judge_accuracy")
    m = m if isinstance(m, dict) else {}
    per = m.get("judges") if isinstance(m.get("judges"), dict) else {}
    rows = [[td(name), td(get(v, "pairwise"), f"rl-general.judge_accuracy.judges.{name}.pairwise"),
             td(get(v, "pairs"), f"rl-general.judge_accuracy.judges.{name}.pairs")] for name, v in sorted(per.items())]
    return ("<h3>rl-general's judges against the verified outcome</h3>"
            + table(["reward source", "right above wrong", "pairs"], rows)
            + note(f"Before training, {fmt(m.get('samples'))} replies of the policy to each of "
                   f"{fmt(m.get('prompts'))} held-out prompts (addition, and GSM8K test questions offered the "
                   f"calculator: a well-formed call is the verified outcome); {pct(m.get('verified_share'))} were "
                   "verified right. Each source's share of the (right, wrong) pairs of replies to one prompt it "
                   "orders right first, a tie counting one half: 0.5 is a judge that cannot see the difference."))


def rl_prompts_section(run: RunData) -> str:
    """rl-prompts: per domain the measured prompts and their pass-rate histogram on the SFT model."""
    from rl.prompts import PASS_RATE_BINS

    m = run.metrics("rl-prompts")
    doms = m.get("domains") if isinstance(m.get("domains"), dict) else {}
    rows = [[td(d), td(get(v, "prompts"), f"rl-prompts.domains.{d}.prompts"),
             td(get(v, "mean_pass_rate"), f"rl-prompts.domains.{d}.mean_pass_rate")]
            + [td(get(v, "histogram", b), f"rl-prompts.domains.{d}.histogram.{b}") for b in PASS_RATE_BINS]
            for d, v in sorted(doms.items())]
    return ("<h3>RL prompts by difficulty (rl-prompts)</h3>"
            + table(["domain", "prompts", "mean pass rate", *(f"pass rate {b}" for b in PASS_RATE_BINS)], rows)
            + note(f"Each prompt's pass rate: the share of {fmt(m.get('samples_per_prompt'))} samples of the SFT "
                   "model rewarded 1, at rl-reasoning's temperature. rl-reasoning draws from this pool when its "
                   "prompt_pool.measured is on (filtered by pass rate, weighted by difficulty)."))


def swe_envs_section(run: RunData) -> str:
    """swe-envs: each source built or not (why), tests, instances by origin, canaries."""
    m = run.metrics("swe-envs")
    per = m.get("per_source") if isinstance(m.get("per_source"), dict) else {}
    rows = [[td(name), td(get(r, "built"), f"swe-envs.per_source.{name}.built"),
             td(get(r, "reason"), f"swe-envs.per_source.{name}.reason"),
             td(get(r, "tests_collected"), f"swe-envs.per_source.{name}.tests_collected"),
             td(get(r, "tests_passing"), f"swe-envs.per_source.{name}.tests_passing"),
             td(get(r, "instances"), f"swe-envs.per_source.{name}.instances"),
             td(get(r, "canaries"), f"swe-envs.per_source.{name}.canaries"),
             td(get(r, "seconds"), f"swe-envs.per_source.{name}.seconds")] for name, r in sorted(per.items())]
    return ("<h3>Environments from real repositories (swe-envs)</h3>"
            + table(["source", "built", "reason", "tests", "passing", "instances", "canaries", "seconds"], rows)
            + note(f"Build rate {pct(m.get('build_rate'))} of {fmt(m.get('sources'))} sources; not built, by reason: "
                   f"{_reasons(m.get('failed_by_reason'))}. Instances {fmt(m.get('instances'))} "
                   f"({fmt(m.get('from_mutants'))} synthesised bugs, {fmt(m.get('from_pairs'))} from issue-PR pairs), "
                   f"{fmt(m.get('instances_per_cpu_minute'))} per CPU-minute; issue-PR pairs mined "
                   f"{fmt(m.get('pairs_mined'))}, of repositories no source holds {fmt(m.get('pairs_without_source'))}."))


def _share_cell(m: dict[str, Any], steps: list[dict[str, Any]], key: str, metric: str) -> str:
    if key in m:
        return td(None, metric, pct(m[key]))
    vals = [number(r.get(key)) for r in steps if number(r.get(key)) is not None]
    return td(None, metric, f"{pct(sum(vals) / len(vals))}‡" if vals else _NR)


def _first_last(v: Any) -> str:
    if not isinstance(v, dict) or number(v.get("first")) is None:
        return _NR
    return f"{number(v['first']):.2g} → {number(v['last']):.2g}"


def reward_charts(run: RunData) -> str:
    panels = []
    for s in RL:
        steps = run.steps(s)
        keys = sorted({k for r in steps for k in r if k.startswith("reward/")})
        series = [("reward", "reward")] + [(k, k.split("/", 1)[1]) for k in keys]
        if s == "rl-agentic":
            series.append(("tool_call_rate", "tool-call rate"))
        panels.append((s, steps, series, f"{s}: reward per step" + (" (per domain)" if keys else "")))
    steps = run.steps("distill")
    keys = sorted({k for r in steps for k in r if k.startswith("reverse_kl/")})
    panels.append(("distill", steps, [("reverse_kl", "mean")] + [(k, k.split("/", 1)[1]) for k in keys],
                   "distill: reverse KL to the teachers"))
    steps = run.steps("reward-model")
    panels.append(("reward-model", steps, [("loss", "loss"), ("train_pair_accuracy", "train pair accuracy")],
                   "reward-model: training"))
    # every policy-gradient stage's mismatch on one panel: rows keyed by stage name
    mixed = [{"step": r.get("step"), s: r["mismatch/k3"]} for s in (*RL, "distill") for r in run.steps(s)
             if "mismatch/k3" in r]
    panels.append(("mismatch", mixed, [(s, s) for s in (*RL, "distill")], "K3 KL(rollout‖train) per step"))
    fig, axes = _figure(3, 13, 6.2, nrows=2)
    for ax, (_, rows, series, title) in zip([a for row in axes for a in row], panels):
        plot_steps(ax, rows, series, title)
    for ax in [a for row in axes for a in row][len(panels):]:
        ax.set_axis_off()
    fig.subplots_adjust(hspace=0.45, wspace=0.22)  # tight_layout would draw the figure once more
    return png(fig, "reward curves per RL stage")


def staleness(run: RunData) -> str:
    hist = run.metrics("rl-agentic").get("version_lag_histogram")
    head = "<h3>rl-agentic: staleness of trained rollouts</h3>"
    if not isinstance(hist, dict) or not hist:
        return head + _NR
    lags = sorted(hist, key=lambda k: int(k) if str(k).lstrip("-").isdigit() else 0)
    fig, axes = _figure(1, 5, 2.6)
    ax = axes[0][0]
    ax.bar(range(len(lags)), [number(hist[k]) or 0 for k in lags], color="#7048e8")
    ax.set_xticks(range(len(lags)), lags, fontsize=7)
    ax.set_xlabel("policy versions behind the trainer", fontsize=8)
    ax.set_ylabel("samples", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title("version lag histogram", fontsize=9)
    t = table(["version lag", "samples"], [[td(k), td(hist[k], f"rl-agentic.version_lag_histogram.{k}")] for k in lags])
    m = run.metrics("rl-agentic")
    extra = table(["", "value"], [[td("trainer wait share"), td(None, "rl-agentic.trainer_wait_fraction",
                                                                pct(m.get("trainer_wait_fraction")))],
                                  [td("dropped as too stale"), td(None, html_value=_reasons(m.get("dropped")))],
                                  [td("worker restarts"), td(m.get("worker_restarts"), "rl-agentic.worker_restarts")]])
    return head + f'<div class="row"><div>{png(fig, "rl-agentic version lag histogram")}</div><div>{t}{extra}</div></div>'


def reward_model(run: RunData) -> str:
    m = run.metrics("reward-model")
    acc = m.get("heldout_pairwise_accuracy") or {}
    rows = [[td("held-out pairwise accuracy"), td(get(acc, "n"), "reward-model.heldout_pairwise_accuracy.n"),
             td(get(acc, "before"), "reward-model.heldout_pairwise_accuracy.before"),
             td(get(acc, "after"), "reward-model.heldout_pairwise_accuracy.after")]]
    per_kind = m.get("heldout_accuracy_per_kind") or {}
    pairs = get(m, "pairs", "by_kind") or {}
    kinds = sorted(set(per_kind) | set(pairs))
    kt = table(["pair kind", "pairs", "held-out accuracy after"],
               [[td(k), td(pairs.get(k)), td(per_kind.get(k), f"reward-model.heldout_accuracy_per_kind.{k}")] for k in kinds])
    return ("<h3>Reward model</h3>" + table(["", "n", "before", "after"], rows) + (kt if kinds else "")
            + note("rl-general uses it as its outcome reward (ORM); its own copy of the held-out pairwise accuracy: "
                   + (fmt(run.metrics("rl-general").get("orm_heldout_pairwise_accuracy")) if run.metrics("rl-general")
                      .get("orm_heldout_pairwise_accuracy") is not None else NOT_RECORDED) + "."))


def gates_section(run: RunData) -> str:
    head = "<h3>Evaluation gates across post-training</h3>"
    source, data = None, None
    for s in reversed(POSTTRAIN):  # the last gated stage's gates.json holds the whole chain
        if "gates.json" in run.files(s, "gates.json"):
            data = run.json_file(s, "gates.json")
            if isinstance(data, dict):
                source = s
                break
    if data is None:
        last = next((s for s in reversed(POSTTRAIN) if isinstance(run.metrics(s).get("gates"), dict)), None)
        if last is None:
            return head + _NR
        data, source = {"chain": [], "gates": run.metrics(last)["gates"]}, last
    chain = [c for c in data.get("chain") or [] if isinstance(c, dict)]
    gates = data.get("gates") or {}
    evals = list(dict.fromkeys([e for c in chain for e in (c.get("evals") or {})]
                               + [e for g in gates.values() for e in (g or {})]))
    out = [note(f"from {source}'s gates.json" if chain else f"from {source}'s metrics (no gates.json: chain values "
                f"{NOT_RECORDED})")]
    if chain:
        rows = []
        for e in evals:
            cells = [td(e)]
            for c in chain:
                st = c.get("stage")
                g = get(gates, st, e)
                mark = "" if not isinstance(g, dict) else (' <span class="ok">✓</span>' if g.get("passed")
                                                           else ' <span class="bad">✗ failed</span>')
                v = get(c, "evals", e)
                cells.append(td(None, f"gates.{e}.{st}", (fmt(v) if v is not None else _NR) + mark))
            rows.append(cells)
        out.append(table(["eval"] + [str(c.get("stage")) for c in chain], rows))
    rows = [[td(st), td(e), td(get(g, "before"), f"gate.{st}.{e}.before"), td(get(g, "after"), f"gate.{st}.{e}.after"),
             td(get(g, "tolerance"), f"gate.{st}.{e}.tolerance"), td(get(g, "noise"), f"gate.{st}.{e}.noise"),
             td(get(g, "detects"), f"gate.{st}.{e}.detects", cls="" if get(g, "detects") is not False else "bad"),
             td(get(g, "passed"), f"gate.{st}.{e}.passed", cls="" if get(g, "passed") is not False else "bad")]
            for st, per in gates.items() for e, g in (per or {}).items()]
    out.append(table(["gated stage", "eval", "before", "after", "tolerance", "noise", "detects", "passed"], rows)
               + note("An accuracy may drop by at most its tolerance (absolute) and its noise; perplexity may rise "
                      "by at most tolerance × before. `detects` is false where the noise exceeds the tolerance: "
                      "a regression of the tolerance's size would pass unseen."))
    return head + "".join(out)


def recheck_section(run: RunData) -> str:
    rows = []
    for s in RL:
        r = run.metrics(s).get("reward_recheck")
        alerts = get(r, "alert_steps")
        rows.append([td(s), td(get(r, "rechecked"), f"{s}.reward_recheck.rechecked"),
                     td(None, f"{s}.reward_recheck.disagreement", pct(get(r, "disagreement"))),
                     td(None, f"{s}.reward_recheck.alert_at", pct(get(r, "alert_at"))),
                     td(alerts, f"{s}.reward_recheck.alert_steps", cls="bad" if alerts else ""),
                     td(get(r, "canary_episodes"), f"{s}.reward_recheck.canary_episodes"),
                     td(None, f"{s}.reward_recheck.canary_cheating_rate", pct(get(r, "canary_cheating_rate"))),
                     td(get(r, "canary_alert_steps"), f"{s}.reward_recheck.canary_alert_steps",
                        cls="bad" if get(r, "canary_alert_steps") else "")])
    return ("<h3>Reward re-checks</h3>" + table(["stage", "rewards re-checked", "disagreement", "alert at",
                                                 "steps that alerted", "canary episodes", "canary cheating rate",
                                                 "canary alerts"], rows)
            + note("An independent re-check of rewarded samples on fresh inputs; a disagreement above the alert "
                   "share at a step suggests the policy exploits its reward. Canary episodes (swe instances whose "
                   "tests contradict their statement) pass only by cheating."))


def lineage(run: RunData) -> str:
    rows = []
    for s in run.record.stages:
        name, m = s["name"], run.manifest(s["name"])
        if m is None:
            rows.append([td(name), td(None, html_value=f"<code>{esc(s.get('key') or '—')}</code>"),
                         td(None, html_value=f"not published ({esc(run.shown_state(name))})"), *[td("")] * 4])
            continue
        parents = "<br>".join(f"{esc(p)}/<code>{esc(k)}</code>" for p, k in sorted(m.parents.items())) or "—"
        rows.append([td(name), td(None, html_value=f"<code>{esc(m.key)}</code>"),
                     td(None, f"{name}.digest", f"<code>{esc(m.digest[:16])}</code>"), td(None, html_value=parents),
                     td(len(m.files)), td(sum(f.size for f in m.files), f"{name}.bytes"),
                     td(None, html_value=f"<code>{esc(run.store.artifact_uri(m.stage, m.key))}</code>", cls="where")])
    graph = lineage_graph(run)
    return section("lineage", "Lineage", graph + table(
        ["stage", "key", "content digest", "parents (stage/key)", "files", "bytes", "where"], rows, cls="small"))


def lineage_graph(run: RunData) -> str:
    """Stages left to right by depth (longest parent chain); arrows from parent to child."""
    names = [s["name"] for s in run.record.stages]
    parents = {}
    for n in names:
        m = run.manifest(n)
        parents[n] = [p for p in (m.parents if m else {}) if p in names]
    depth: dict[str, int] = {}
    for n in names:  # the record lists parents first
        depth[n] = 1 + max((depth.get(p, 0) for p in parents[n]), default=-1)
    if not any(parents.values()):
        return ""
    by_depth: dict[int, list[str]] = {}
    for n in names:
        by_depth.setdefault(depth[n], []).append(n)
    # one column per depth; neighbouring columns alternate up and down so their labels never meet
    pos = {n: (d, 1.6 * ((len(col) - 1) / 2 - i) + (0.4 if d % 2 else -0.4))
           for d, col in by_depth.items() for i, n in enumerate(col)}
    fig, axes = _figure(1, 16, 3.0)
    ax = axes[0][0]
    for n in names:
        for p in parents[n]:
            (x0, y0), (x1, y1) = pos[p], pos[n]
            far = x1 - x0 > 1
            ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                        arrowprops=dict(arrowstyle="-|>", color="#adb5bd" if far else "#495057", lw=0.7,
                                        alpha=0.6 if far else 1.0, shrinkA=14, shrinkB=14,
                                        connectionstyle="arc3,rad=-0.25" if far else "arc3"))
    for n, (x, y) in pos.items():
        ax.text(x, y, n, ha="center", va="center", fontsize=7.5,
                bbox=dict(boxstyle="round,pad=0.3", fc=STATE_COLOURS.get(run.shown_state(n), "#dee2e6"), ec="#495057",
                          lw=0.5, alpha=0.9))
    ax.set_xlim(-0.7, max(x for x, _ in pos.values()) + 0.7)
    ys = [y for _, y in pos.values()]
    ax.set_ylim(min(ys) - 1.2, max(ys) + 1.2)
    ax.set_axis_off()
    return png(fig, "lineage graph") + note("Grey arcs: parents more than one step upstream (tokenize, decontaminate). "
                                            "Colours: the stage's state in this run.")


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#212529;margin:0;background:#f8f9fa}
main{max-width:1360px;margin:0 auto;padding:18px 28px 60px}
h1{font-size:22px;margin:8px 0 4px} h2{font-size:18px;border-bottom:2px solid #dee2e6;padding-bottom:4px;margin-top:34px}
h3{font-size:15px;margin:22px 0 6px}
nav a{margin-right:14px;color:#1c7ed6;text-decoration:none}
section{background:#fff;border:1px solid #e9ecef;border-radius:6px;padding:4px 18px 16px;margin-top:18px;overflow-x:auto}
table{border-collapse:collapse;margin:6px 0;font-size:13px}
th,td{border:1px solid #dee2e6;padding:3px 8px;text-align:left;vertical-align:top}
thead th{background:#f1f3f5} td[data-metric]{font-variant-numeric:tabular-nums;text-align:right}
table.kv th{background:#f1f3f5;width:150px} table.small{font-size:12px}
.nr{color:#868e96;font-style:italic} .note{color:#495057;font-size:12.5px;margin:4px 0 10px}
.state{font-weight:600} .s-done{color:#2b8a3e} .s-cached{color:#1971c2} .s-failed,.bad{color:#c92a2a;font-weight:600}
.s-interrupted{color:#e8590c} .s-running{color:#6741d9} .s-not-run{color:#868e96} .ok{color:#2b8a3e}
.row{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start} img.chart{max-width:100%;display:block;margin:8px 0}
pre{background:#f1f3f5;padding:6px 10px;border-radius:4px;white-space:pre-wrap;word-break:break-all;font-size:12px}
pre.cmd{background:#212529;color:#f8f9fa} code{font-size:12px} td.where code{word-break:break-all}
details summary{cursor:pointer}
"""


def effects_section(run: RunData) -> str:
    """The recipe's effects this run measured, each against its target (glmforge.effects)."""
    from glmforge import effects

    measured = effects.measure({name: run.metrics(name) for name in run.stages},
                               set(effects.failed_stages(run.stages.values())))
    rows = []
    for e in effects.EFFECTS:
        value, passed = measured[e.name]["value"], measured[e.name]["passed"]
        verdict = _NR if passed is None else ("yes" if passed else "no")
        rows.append([td(e.name), td(e.stage), td(e.description), td(value, f"effects.{e.name}"), td(e.target),
                     td(None, f"effects.{e.name}.passed", verdict, cls="bad" if passed is False else "")])
    return section("effects", "Effects", table(["effect", "stage", "what", "value", "target", "met"], rows)
                   + "".join(sweep_table(sw) for sw in run_sweeps(run))
                   + note("What each stage of the recipe is meant to show, from its published metrics "
                          f"({NOT_RECORDED}: the stage did not run or did not measure it; the tiny preset "
                          "leaves out the long-context and INT4 comparisons). `glmforge sweep` gives the "
                          "spread over seeds."))


def run_sweeps(run: RunData) -> list[dict]:
    """The `glmforge sweep` records in the store that include this run."""
    from glmforge import effects

    found = []
    for key in sorted(run.store.list(effects.SWEEPS)):
        try:
            sw = run.store.get_json(key)
        except (OSError, ValueError):
            run.problems.append(f"{run.store.uri}/{key}: unreadable sweep record")
            continue
        if isinstance(sw, dict) and run.record.id in (sw.get("run_ids") or {}).values():
            found.append(sw)
    return found


def sweep_table(sw: dict) -> str:
    """One sweep's spread: each effect's value per seed, mean ± std, on how many seeds it held."""
    from glmforge import effects

    seeds = [str(s) for s in sw["seeds"]]
    rows = []
    for e in effects.EFFECTS:
        s = sw["spread"].get(e.name) or {}
        vals = list((s.get("values") or {}).values())
        cells = [td(v, f"sweep.{e.name}.seed{k}") for k, v in zip(seeds, vals)]
        rows.append([td(e.name), *cells, td(None, f"sweep.{e.name}.mean", effects.mean_std(s)),
                     td(None, f"sweep.{e.name}.held", effects.held_in(s))])
    walls = ", ".join(f"seed {k}: {v / 60:.1f} min" for k, v in (sw.get("wall_s") or {}).items())
    until = f" through {sw['until']}" if sw.get("until") else ""
    return (f"<h3>Seed sweep{esc(until)}: seeds {esc(', '.join(seeds))}</h3>"
            + table(["effect", *[f"seed {k}" for k in seeds], "mean ± std", "held in"], rows)
            + note(f"Wall time per seed: {walls}."))


def tracked_note(record: RunRecord) -> str:
    """The tracker's run of this run (runtime.tracking), linked; its stages are its child runs."""
    t = record.tracking or {}
    if not t.get("link"):
        return ""
    return (f' Tracked in {esc(t.get("backend", ""))}: <a href="{esc(t["link"])}">run {esc(t.get("run_id", ""))}</a>'
            " (each stage a child run).")


def render(store: Store, record: RunRecord) -> str:
    """The whole page (HTML text) for one run record."""
    run = RunData(store, record)
    body = [effects_section(run), curation(run), training(run), sft_section(run), posttraining(run), lineage(run)]
    body.insert(0, header(run))  # last: it lists the files the other sections could not read
    made = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    nav = "".join(f'<a href="#{a}">{esc(t)}</a>' for a, t in (
        ("run", "run"), ("effects", "effects"), ("curation", "curation"), ("training", "training"), ("sft", "SFT and INT4"),
        ("posttraining", "post-training"), ("lineage", "lineage")))
    return (
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
        # nothing may load from anywhere: the page is complete as it is
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; "
        "style-src 'unsafe-inline'\">"
        f"<title>glmforge run {esc(record.id)}</title><style>{CSS}</style></head><body><main>"
        f"<h1>glmforge run {esc(record.id)} — {esc(record.shown_state())}</h1>"
        f'<p class="note">Report written {esc(made)} from {esc(store.uri)}.{tracked_note(record)}</p><nav>{nav}</nav>'
        + "".join(body) + "</main></body></html>"
    )


def default_out_dir() -> Path:
    return default_home() / "reports"


def write_report(store: Store, record: RunRecord, out_dir: Path | None = None) -> Path:
    """Write run-ID.html into out_dir ($GLMFORGE_HOME/reports by default); returns its path."""
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = (out / f"run-{record.id}.html").resolve()
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render(store, record), encoding="utf-8")
    tmp.replace(path)  # a reader never opens a half-written page
    return path


def summary_markdown(record: RunRecord, path: Path) -> str:
    """A short markdown summary of the run and where its page is (the Prefect artifact)."""
    counts: dict[str, int] = {}
    for s in record.stages:
        counts[s["state"]] = counts.get(s["state"], 0) + 1
    lines = [f"## Run `{record.id}`: {record.shown_state()}", "",
             ", ".join(f"{n} {state}" for state, n in counts.items()), "",
             f"The whole run on one page (curation funnel, loss and reward curves, gates, lineage): `{path}`",
             f"(`glmforge report --run {record.id}` writes it again).", "",
             "| stage | state | wall s |", "|---|---|---|"]
    for s in record.stages:
        sec = s.get("seconds")
        lines.append(f"| {s['name']} | {s['state']} | {'' if sec is None else f'{sec:.1f}'} |")
    for s in record.stages:
        if s["state"] in ("failed", "interrupted"):
            error = (s.get("error") or "").splitlines()[:1] or [""]
            lines += ["", f"**{s['name']}** {s['state']}: {error[0][:200]}",
                      f"resume it with `glmforge resume {s['name']} --run {record.id}`"]
    return "\n".join(lines)
