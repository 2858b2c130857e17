"""Post-training: reward curves, held-out accuracy, distillation, the train/inference mismatch,
staleness, the reward model, reward re-checks, the environments from real repositories (swe-envs),
the RL prompt pool (rl-prompts) and rl-general's judges."""
from __future__ import annotations

import math
from typing import Any

from glmforge.effects import round_gain
from glmforge.report.data import RunData
from glmforge.report.gates import gates_section
from glmforge.report.pieces import (
    _NR, NOT_RECORDED, _figure, _reasons, first_last, fmt, get, note, number, pct, plot_steps, png, section, table,
    td,
)

RL = ("rl-reasoning", "rl-agentic", "rl-general")   # the stages with reward curves


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
    out.append(rounds_section(run))
    return section("posttraining", "Post-training", "".join(out))


def rounds_section(run: RunData) -> str:
    """Iterative self-distillation: per round, what self-distill kept and rl-reasoning's held-out
    accuracy after the round, against round 1's in standard errors (only when rounds ran)."""
    rounds = sorted({int(n.partition("@")[2]) for n in run.stages if "@" in n and n.partition("@")[2].isdigit()})
    if not rounds:
        return ""
    metrics = {n: run.metrics(n) for n in ("rl-reasoning", *(f"rl-reasoning@{r}" for r in rounds))}
    rows = []
    for r in [1, *rounds]:
        at = "" if r == 1 else f"@{r}"
        sd = run.metrics(f"self-distill{at}")
        data = (run.metrics(f"sft{at}").get("data") or {}).get("samples") or {}
        greedy = run.metrics(f"rl-reasoning{at}").get("heldout_accuracy")
        sampled = run.metrics(f"rl-reasoning{at}").get("heldout_sampled_accuracy")
        made = ([td(None, None, "— (SFT's own mix)")] * 3 if r == 1 else
                [td(get(sd, "examples"), f"self-distill{at}.examples"), td(get(sd, "prompts"), f"self-distill{at}.prompts"),
                 td(get(data, "replaced_by_self_distill"), f"sft{at}.data.samples.replaced_by_self_distill")])
        rows.append([td(r), *made,
                     _acc_cell(get(greedy, "after"), get(greedy, "stderr_after"), get(greedy, "n"),
                               f"rl-reasoning{at}.heldout_accuracy.after"),
                     _acc_cell(get(sampled, "before"), get(sampled, "stderr_before"), get(sampled, "n"),
                               f"rl-reasoning{at}.heldout_sampled_accuracy.before"),
                     _acc_cell(get(sampled, "after"), get(sampled, "stderr_after"), get(sampled, "n"),
                               f"rl-reasoning{at}.heldout_sampled_accuracy.after"),
                     td(None, None, "—") if r == 1 else td(round_gain(metrics, r), f"rounds.{r}.gain_in_stderr")])
    return ("<h3>Iterative self-distillation: rounds</h3>"
            + table(["round", "distilled examples", "prompts sampled", "SFT demonstrations replaced",
                     "rl-reasoning held-out greedy after", "sampled before (the round's SFT model)",
                     "sampled after", "sampled after vs round 1, in s.e."], rows)
            + note("Round R (self_distill.iterations) rejection-samples round R−1's rl-reasoning model: its "
                   "verified, distinct responses (at most cap_per_prompt a prompt) replace SFT's direct "
                   "demonstrations of their domain, and SFT and the RL stages run again. The held-out prompts "
                   "are the same in every round."))


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
                   f"calculator: a first call that computes a step of the reference solution is the verified outcome); {pct(m.get('verified_share'))} were "
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
