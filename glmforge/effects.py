"""The recipe's effects, read from one run's stage metrics, and their spread over runs.

One row per effect the pipeline is meant to show (issue 35; docs/results/effects.md, "The effects through the
pipeline"), each a number taken from a stage's published metrics and the check it has to pass:

    long_context_full      dsa-adapt: dense attention's MQAR accuracy, mean over lengths   >= 0.8
    long_context_dsa_gap   DSA minus dense, mean over lengths                              >= -0.02
    long_context_swa_gap   sliding window minus dense, mean over lengths                   <= -0.30
    qat_recovery_facts     sft: share of PTQ's fact-answer perplexity cost QAT wins back   >= 2/3
    reasoning_reward_gain  rl-reasoning: reward, last tenth of steps minus first tenth      >= 0.15
    reasoning_heldout_gain rl-reasoning: held-out accuracy, k samples per prompt at the
                           rollout temperature (the held-out expected reward), gain in
                           standard errors                                                 > 2
    reasoning_heldout_greedy  the same, greedy; passes too at its ceiling (before >= 0.95)
                           when it did not fall by more than two standard errors           > 2
    agentic_heldout_gain   rl-agentic: held-out accuracy after minus before (mean over
                           envs); passes too at a ceiling (before >= 0.95) with reward up  > 0
    agentic_heldout_sampled  rl-agentic: held-out accuracy, k episodes per task at the
                           rollout temperature, gain in standard errors (the least over envs) > 2
    reward_model_accuracy  reward-model: held-out pairwise accuracy after training         >= 0.7
    general_verified_gain  rl-general: verified accuracy last minus first (mean over what it
                           verifies), with every gate of the stage passed                  > 0
    distill_recovered      distill: share of what the student was behind its teachers that
                           it won back (mean over the evals where it was behind)           > 0
    self_distill_round_gain  rl-reasoning@2 (iterative self-distillation's second round)
                           minus rl-reasoning: held-out sampled accuracy after each, in
                           standard errors (only when the config runs two rounds)          > 2

A row whose stage did not run (or did not record the number) is None and neither passes nor
fails; a row whose stage failed (a gate stopped it) is None and fails. `spread` gives mean and
sample std over several runs (a seed sweep) and whether the check held in each."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

Metrics = dict[str, dict[str, Any]]     # stage name -> that stage's metrics


@dataclass(frozen=True)
class Effect:
    name: str
    stage: str
    description: str
    target: str                                         # the check, as shown
    value: Callable[[Metrics], Optional[float]]
    passes: Callable[[float, Metrics], bool]


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _long_context(m: Metrics, method: str) -> Optional[float]:
    acc = (m.get("dsa-adapt") or {}).get("long_context_accuracy") or {}
    full, other = acc.get("full") or {}, acc.get(method) or {}
    lengths = sorted(set(full) & set(other), key=int)
    if not lengths:
        return None
    mean = lambda table: sum(float(table[n]) for n in lengths) / len(lengths)  # noqa: E731
    return mean(other) - (mean(full) if method != "full" else 0.0)


def _greedy_passes(v: float, m: Metrics) -> bool:
    h = (m.get("rl-reasoning") or {}).get("heldout_accuracy") or {}
    return v > 2 or ((_num(h.get("before")) or 0) >= 0.95 and v >= -2)


def _first_last_gain(v: Any) -> Optional[float]:
    if not isinstance(v, dict) or _num(v.get("first")) is None or _num(v.get("last")) is None:
        return None
    return v["last"] - v["first"]


def _agentic_gain(m: Metrics) -> Optional[float]:
    acc = (m.get("rl-agentic") or {}).get("heldout_accuracy")
    if not isinstance(acc, dict) or not acc:
        return None
    gains = [e["after"] - e["before"] for e in acc.values()
             if isinstance(e, dict) and _num(e.get("after")) is not None and _num(e.get("before")) is not None]
    return sum(gains) / len(gains) if gains else None


def _agentic_passes(v: float, m: Metrics) -> bool:
    s = m.get("rl-agentic") or {}
    at_ceiling = all(isinstance(e, dict) and (_num(e.get("before")) or 0) >= 0.95
                     for e in (s.get("heldout_accuracy") or {}).values())
    return v > 0 or (at_ceiling and (_first_last_gain(s.get("reward")) or 0) > 0)


def _agentic_sampled(m: Metrics) -> Optional[float]:
    acc = (m.get("rl-agentic") or {}).get("heldout_sampled_accuracy")
    gains = [_num(e.get("gain_in_stderr")) for e in (acc or {}).values() if isinstance(e, dict)]
    return min(gains) if gains and None not in gains else None


def _verified_gain(m: Metrics) -> Optional[float]:
    per = (m.get("rl-general") or {}).get("verified_accuracy")
    gains = [g for g in (_first_last_gain(v) for v in (per or {}).values()) if g is not None]
    return sum(gains) / len(gains) if gains else None


def _gates_passed(m: Metrics, stage: str) -> bool:
    """Every gate in the stage's table ({gated stage: {eval: {"passed", ...}}}, rl.gates) passed."""
    gates = (m.get(stage) or {}).get("gates")
    return isinstance(gates, dict) and bool(gates) and all(
        g.get("passed") is not False for per in gates.values() if isinstance(per, dict)
        for g in per.values() if isinstance(g, dict))


def _distill_recovered(m: Metrics) -> Optional[float]:
    dom = (m.get("distill") or {}).get("domain_accuracy")
    rec = [_num(e.get("recovered")) for evals in (dom or {}).values() if isinstance(evals, dict)
           for e in evals.values() if isinstance(e, dict)]
    rec = [r for r in rec if r is not None]
    return sum(rec) / len(rec) if rec else None


def round_gain(m: Metrics, r: int = 2) -> Optional[float]:
    """rl-reasoning@r's held-out sampled accuracy after minus round 1's, in standard errors of
    the difference (None: a round not run or not recorded)."""
    first = (m.get("rl-reasoning") or {}).get("heldout_sampled_accuracy") or {}
    later = (m.get(f"rl-reasoning@{r}") or {}).get("heldout_sampled_accuracy") or {}
    vals = [_num(x.get(k)) if isinstance(x, dict) else None for x in (first, later) for k in ("after", "stderr_after")]
    if None in vals:
        return None
    a1, s1, a2, s2 = vals
    se = math.sqrt(s1 ** 2 + s2 ** 2)
    return (a2 - a1) / se if se > 0 else None


def _get(stage: str, *path: str) -> Callable[[Metrics], Optional[float]]:
    def read(m: Metrics) -> Optional[float]:
        v: Any = m.get(stage) or {}
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        return _num(v)
    return read


EFFECTS: tuple[Effect, ...] = (
    Effect("long_context_full", "dsa-adapt", "dense attention's MQAR accuracy (mean over lengths)", ">= 0.8",
           lambda m: _long_context(m, "full"), lambda v, m: v >= 0.8),
    Effect("long_context_dsa_gap", "dsa-adapt", "DSA minus dense attention (mean over lengths)", ">= -0.02",
           lambda m: _long_context(m, "dsa"), lambda v, m: v >= -0.02),
    Effect("long_context_swa_gap", "dsa-adapt", "sliding window minus dense attention (mean over lengths)",
           "<= -0.30", lambda m: _long_context(m, "swa"), lambda v, m: v <= -0.30),
    Effect("qat_recovery_facts", "sft", "share of PTQ's fact-answer perplexity cost that QAT wins back",
           ">= 0.667", _get("sft", "qat_recovery_facts_ppl"), lambda v, m: v >= 2 / 3),
    Effect("reasoning_reward_gain", "rl-reasoning", "reward, last tenth of the steps minus the first", ">= 0.15",
           lambda m: _first_last_gain((m.get("rl-reasoning") or {}).get("reward")), lambda v, m: v >= 0.15),
    Effect("reasoning_heldout_gain", "rl-reasoning", "held-out accuracy sampled at the rollout temperature "
           "(expected reward), gain in standard errors", "> 2",
           _get("rl-reasoning", "heldout_sampled_accuracy", "gain_in_stderr"), lambda v, m: v > 2),
    Effect("reasoning_heldout_greedy", "rl-reasoning", "held-out greedy accuracy, gain in standard errors",
           "> 2, or at its ceiling (before >= 0.95) and not down 2", _get("rl-reasoning", "heldout_accuracy",
                                                                          "gain_in_stderr"), _greedy_passes),
    Effect("agentic_heldout_gain", "rl-agentic", "held-out accuracy after minus before (mean over envs)",
           "> 0, or at its ceiling with reward rising", _agentic_gain, _agentic_passes),
    Effect("agentic_heldout_sampled", "rl-agentic", "held-out accuracy sampled at the rollout temperature, gain in "
           "standard errors (the least over envs)", "> 2", _agentic_sampled, lambda v, m: v > 2),
    Effect("reward_model_accuracy", "reward-model", "held-out pairwise accuracy", ">= 0.7",
           _get("reward-model", "heldout_pairwise_accuracy", "after"), lambda v, m: v >= 0.7),
    Effect("general_verified_gain", "rl-general", "verified accuracy, last tenth minus first (mean), gates "
           "passed", "> 0, every gate passed", _verified_gain, lambda v, m: v > 0 and _gates_passed(m, "rl-general")),
    Effect("distill_recovered", "distill", "share of the gap to its teachers the student won back (mean)", "> 0",
           _distill_recovered, lambda v, m: v > 0),
    Effect("self_distill_round_gain", "rl-reasoning@2", "held-out sampled accuracy after round 2 minus after round "
           "1, in standard errors", "> 2", round_gain, lambda v, m: v > 2),
)


SWEEPS = "sweeps/"   # store prefix of `glmforge sweep`'s records (the run report shows a run's sweep)


def stage_metrics(record: dict[str, Any]) -> Metrics:
    """{stage: metrics} of a run record as `glmforge status --json` prints it (RunRecord.public())."""
    return {s["name"]: s.get("metrics") or {} for s in record.get("stages", [])
            if s.get("state") in ("done", "cached")}


def failed_stages(stages: Iterable[dict[str, Any]]) -> list[str]:
    """The names of the stages that failed, in pipeline order (a run record's `stages`)."""
    return [s["name"] for s in stages if s.get("state") == "failed"]


def measure_record(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`measure` of a run record as `glmforge status --json` prints it (RunRecord.public())."""
    return measure(stage_metrics(record), set(failed_stages(record.get("stages", []))))


def measure(m: Metrics, failed: set[str] = frozenset()) -> dict[str, dict[str, Any]]:
    """{effect: {"value", "passed", "stage", "target"}} for one run (value/passed None: not measured).
    The rows of a stage in `failed` (a gate stopped it, it crashed) have no value and did not pass."""
    out = {}
    for e in EFFECTS:
        v = None if e.stage in failed else e.value(m)
        passed = False if e.stage in failed else None if v is None else bool(e.passes(v, m))
        out[e.name] = {"value": v, "passed": passed, "stage": e.stage, "target": e.target}
    return out


def spread(runs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Over several runs' `measure` results ({label: measured}): per effect the values, mean,
    sample std (None for fewer than two values) and how many of the runs passed."""
    out = {}
    for e in EFFECTS:
        vals = [r[e.name]["value"] for r in runs.values() if r[e.name]["value"] is not None]
        verdicts = [r[e.name]["passed"] for r in runs.values() if r[e.name]["passed"] is not None]
        out[e.name] = {"values": {k: r[e.name]["value"] for k, r in runs.items()},
                       "mean": statistics.fmean(vals) if vals else None,
                       "std": statistics.stdev(vals) if len(vals) > 1 else None,
                       "passed": sum(verdicts), "measured": len(verdicts), "target": e.target, "stage": e.stage}
    return out


def _fmt(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.3f}"


def mean_std(s: dict[str, Any]) -> Optional[str]:
    """"mean ± std" of one effect's `spread` entry (None: no run measured it)."""
    return None if s.get("mean") is None else f"{s['mean']:.3f} ± {_fmt(s.get('std'))}"


def held_in(s: dict[str, Any]) -> Optional[str]:
    """"passed/measured" of one effect's `spread` entry (None: no run measured it)."""
    return f"{s['passed']}/{s['measured']}" if s.get("measured") else None


def every_run(sp: dict[str, dict[str, Any]]) -> tuple[list[str], list[str]]:
    """Of a `spread`'s effects that some run measured: (held on every run, did not), by name.
    An effect held on every run only when every run measured it and passed."""
    runs = max((len(s.get("values") or {}) for s in sp.values()), default=0)
    measured = [n for n, s in sp.items() if s.get("measured")]
    held = [n for n in measured if sp[n]["passed"] == sp[n]["measured"] == runs]
    return held, [n for n in measured if n not in held]


def summary_line(sp: dict[str, dict[str, Any]]) -> str:
    """"Held in every run: k of n effects measured (not: ...)" of a `spread`."""
    held, not_held = every_run(sp)
    tail = f" (not: {', '.join(not_held)})" if not_held else ""
    return f"Held in every run: {len(held)} of {len(held) + len(not_held)} effects measured{tail}."


def markdown(runs: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The sweep table: one row per effect, a column per run, then mean ± std and the verdicts,
    and the summary line under it."""
    labels = list(runs)
    sp = spread(runs)
    head = ["effect", "stage", "target", *labels, "mean ± std", "held in"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in EFFECTS:
        s = sp[e.name]
        cells = [_fmt(runs[k][e.name]["value"]) + ("" if runs[k][e.name]["passed"] is not False else " ✗")
                 for k in labels]
        lines.append("| " + " | ".join([e.name, e.stage, e.target.replace("|", "/"), *cells,
                                         mean_std(s) or "—", held_in(s) or "—"]) + " |")
    return "\n".join(lines) + "\n\n" + summary_line(sp) + "\n"
