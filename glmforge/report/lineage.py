"""Lineage: every stage's artifact, its parents and content digest, and the graph of them."""
from __future__ import annotations

from glmforge.report.data import RunData
from glmforge.report.pieces import STATE_COLOURS, _figure, esc, note, png, section, table, td


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
