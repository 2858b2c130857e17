"""The evaluation gates across post-training and the recipe's effects (with the seed sweeps that
include the run)."""
from __future__ import annotations

from glmforge import pipeline
from glmforge.report.data import RunData
from glmforge.report.pieces import _NR, NOT_RECORDED, esc, fmt, get, note, section, table, td

# the post-training stages, from the registry: those after SFT
POSTTRAIN = tuple(s.name for s in pipeline.POSTTRAIN if s.name != "sft")


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
            + note(f"{effects.summary_line(sw['spread'])} Wall time per seed: {walls}."))
