"""The page's building blocks: "not recorded", escaping and number formats, table cells and
sections, and the charts (matplotlib figures as inline PNGs)."""
from __future__ import annotations

import base64
import html
import io
import json
import math
from typing import Any, Iterable

NOT_RECORDED = "not recorded"
_NR = f'<span class="nr">{NOT_RECORDED}</span>'
STATE_COLOURS = {"done": "#2f9e44", "cached": "#4dabf7", "failed": "#e03131", "interrupted": "#f08c00",
                 "running": "#7048e8", "not run": "#adb5bd"}


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


def _reasons(d: Any) -> str:
    if not isinstance(d, dict):
        return _NR
    return ", ".join(f"{esc(k)}: {fmt(v)}" for k, v in sorted(d.items())) or "none"


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
