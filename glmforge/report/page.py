"""The page: the run's header (its stages, wall times, the commands that resume it), the CSS, and
the whole page put together and written; the Prefect artifact's markdown summary."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import shlex
from pathlib import Path
from typing import Any

from glmforge.report.curation import curation
from glmforge.report.data import RunData
from glmforge.report.gates import effects_section
from glmforge.report.lineage import lineage
from glmforge.report.pieces import (
    NOT_RECORDED, STATE_COLOURS, _figure, esc, fmt, note, number, png, section, table, td,
)
from glmforge.report.posttraining import posttraining
from glmforge.report.quantization import sft_section
from glmforge.report.training import training
from runtime.runner import RunRecord
from runtime.store import Store, default_home


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
