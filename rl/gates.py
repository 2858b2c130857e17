"""Evaluation gates: each post-training stage must not silently undo an earlier one.

Every gated stage (rl-reasoning, rl-general, distill; rl-agentic through the same three calls)
measures one fixed set of evals on its input model ("before") and on its result ("after"):

    arithmetic_acc       greedy accuracy on held-out synthetic addition (domains.arithmetic)   higher
    gsm8k_acc            greedy accuracy on GSM8K test questions (thinking off)           higher
    heldout_ppl          perplexity of the GSM8K test reference answers (assistant tokens) lower
    tool_call_validity   share of replies to calculator-tool prompts that make at least
                         one tool call and parse cleanly (rl.judges.valid_tool_call)     higher

All evals run the full-precision weights greedily, so before/after differ only by the stage.
A stage's config declares a tolerance per eval (`gates.tolerances`): an accuracy may drop by at
most `tolerance` (absolute), perplexity may rise by at most `tolerance` x before (relative). An
eval without a tolerance is recorded, not gated. An accuracy is a share of n prompts, so a drop
also has to exceed the eval's own noise to fail: twice the standard error of the difference of
two binomial shares over n (`noise` in the table; 0.47 at n = 8 and p = 0.5, 0.14 at n = 100),
else a stage fails on which 8 GSM8K questions happen to flip. Where the noise exceeds the tolerance
the gate cannot see a regression of the tolerance's size: gates.json marks it `detects: false`. When a gate fails, the stage writes its table
(gates.json / gates.md / gates.png) and raises GateError carrying the table: it ends failed,
never done. Long-context accuracy is not measured (the tiny models have 256-token contexts).

The chain: each gated stage's artifact holds gates.json = {"chain": [{"stage", "evals"}...],
"gates": {stage: {eval: {before, after, tolerance, passed}}}}; a stage extends its parent's chain
(or starts it with its parent's measured "before"), so the last stage's gates.md / gates.png show
every eval across sft -> rl-reasoning -> rl-agentic -> rl-general -> distill. Each entry carries the
`spec` it was measured under (eval settings, seed, MEASURE_VERSION): greedy evals of the same
weights give the same numbers, so a stage takes its input model's evals from that artifact's own
entry when the spec matches (`recorded`) instead of measuring them again.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from chat.template import STOP_TOKENS, Message, encode
from domains import arithmetic
from domains.task import Task
from model.model import GLMModel
from rl.judges import valid_tool_call
from rl.rollout import RolloutEngine, SamplingParams, TurnCache, prompt_ids

# bumped whenever measure() changes what it computes: evals recorded under another version are
# measured again, not reused
MEASURE_VERSION = 1

# eval name -> +1 (higher is better) or -1 (lower is better)
EVALS: dict[str, int] = {"arithmetic_acc": 1, "gsm8k_acc": 1, "heldout_ppl": -1, "tool_call_validity": 1}
GATES_FILE = "gates.json"


class GateEvalConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    arithmetic: int = Field(200, ge=1, description="held-out addition prompts")
    gsm8k_path: str = Field("{samples}/gsm8k/test.jsonl", description="GSM8K test questions ({samples} expands)")
    # sized so that each accuracy's noise (2 standard errors of a difference) is below its default
    # tolerance where the tiny model's shares sit: gsm8k near 0 (at n 32 the demo's 0.05-0.07
    # gave 0.105-0.121, above the 0.1 tolerance, on three stages: 0.06-0.07 at n 96, and below
    # 0.1 up to a share of 0.13), tool calls near 0.5 (0.18 at n 64), addition anywhere (0.10 at
    # 0.5, 0.075 at 0.8 at n 200; at n 100 the demo's 0.75-0.88 gave 0.10-0.11); gates.json says
    # where it is not
    gsm8k: int = Field(96, ge=1, description="GSM8K test questions (accuracy and perplexity)")
    tool: int = Field(64, ge=1, description="GSM8K test questions offered the calculator (tool_call_validity)")
    gsm8k_max_new_tokens: int = Field(48, ge=1, description="generation budget per GSM8K answer")
    tool_max_new_tokens: int = Field(32, ge=1, description="generation budget per reply to a calculator-tool prompt")
    batch: int = Field(64, ge=1, description="sequences per forward / generate call")


class GateConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    evals: GateEvalConfig = Field(GateEvalConfig(), description=(
        "the evaluations measured on the stage's input model (before) and its result (after)"))
    tolerances: dict[str, float] = Field(
        {"arithmetic_acc": 0.1, "gsm8k_acc": 0.1, "heldout_ppl": 0.25, "tool_call_validity": 0.2},
        description="eval -> allowed regression (absolute for accuracies, relative for perplexity)")

    @field_validator("tolerances")
    @classmethod
    def _known(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(set(v) - set(EVALS))
        if bad:
            raise ValueError(f"gates.tolerances: unknown evals {bad}; known: {', '.join(EVALS)}")
        if any(t < 0 for t in v.values()):
            raise ValueError("gates.tolerances must be >= 0")
        return v


class GateError(RuntimeError):
    """A stage broke a gate; str() carries the whole table."""

    def __init__(self, stage: str, table: str):
        self.stage, self.table = stage, table
        super().__init__(f"{stage}: evaluation gate failed (a tolerance in the stage's `gates.tolerances` was "
                         f"exceeded); the stage ends failed:\n{table}")


# ---------------------------------------------------------------- measuring
class _Direct(RolloutEngine):
    """The rollout engine's batched greedy decoding on the model itself (no copy)."""

    def __init__(self, model: GLMModel, tokenizer, batch: int):
        self.tokenizer, self.model, self.batch_size, self.int4, self.version = tokenizer, model, batch, None, 0
        self.stop_ids = [tokenizer.token_to_id(t) for t in STOP_TOKENS]
        self.pad_id = tokenizer.token_to_id("<|pad|>")
        self.turns = TurnCache(limit=4 * batch)


def _greedy(engine: RolloutEngine, prefixes: list[list[int]], max_new: int) -> list[list[int]]:
    out = engine.complete(prefixes, SamplingParams(temperature=0.0, max_new_tokens=max_new), torch.Generator())
    return [toks for toks, *_ in out]


def _problems(cfg: GateEvalConfig):
    from domains.gsm8k import read_gsm8k

    probs = read_gsm8k(cfg.gsm8k_path)[: max(cfg.gsm8k, cfg.tool)]
    if not probs:
        raise ValueError(f"gates: {cfg.gsm8k_path} has no GSM8K problems")
    return probs


@torch.no_grad()
def perplexity(model: GLMModel, tokenizer, conversations: list[list[Message]], batch: int) -> float:
    """exp(mean NLL) over the assistant tokens (the template's loss mask)."""
    pad = tokenizer.token_to_id("<|pad|>")
    encoded = [encode(tokenizer, m, thinking_mode="turn") for m in conversations]
    nll, n = 0.0, 0
    for i in range(0, len(encoded), batch):
        part = encoded[i:i + batch]
        T = max(len(e.ids) for e in part) - 1
        ids = torch.full((len(part), T), pad, dtype=torch.long)
        tgt = torch.full((len(part), T), pad, dtype=torch.long)
        att = torch.zeros(len(part), T, dtype=torch.long)
        m = torch.zeros(len(part), T)
        for b, e in enumerate(part):
            k = len(e.ids) - 1
            ids[b, :k], tgt[b, :k], att[b, :k] = torch.tensor(e.ids[:-1]), torch.tensor(e.ids[1:]), 1
            m[b, :k] = torch.tensor(e.loss_mask[1:], dtype=torch.float)
        logp = model(ids, attention_mask=att).logits.float().log_softmax(-1).gather(-1, tgt[..., None])[..., 0]
        nll -= float((logp * m).sum())
        n += int(m.sum())
    return math.exp(nll / max(n, 1))


@torch.no_grad()
def measure(model: GLMModel, tokenizer, cfg: GateEvalConfig, seed: int = 0) -> dict[str, float]:
    """The EVALS of `model` (module doc)."""
    from domains.tools import CALCULATOR
    from rl.rewards import score_sample

    was = model.training
    model.eval()
    try:
        engine = _Direct(model, tokenizer, cfg.batch)
        held = arithmetic.tasks(cfg.arithmetic, "heldout", seed)
        digits = len(held[0].answer.split()) + 1
        outs = _greedy(engine, [prompt_ids(tokenizer, t) for t in held], digits)
        arith = [score_sample(tokenizer.decode(o, skip_special_tokens=True), t).score >= 1.0
                 for o, t in zip(outs, held)]

        probs = _problems(cfg)
        math_tasks = [Task("math", p.question, p.answer) for p in probs]
        tool_tasks, math_tasks, probs = math_tasks[: cfg.tool], math_tasks[: cfg.gsm8k], probs[: cfg.gsm8k]
        outs = _greedy(engine, [prompt_ids(tokenizer, t) for t in math_tasks], cfg.gsm8k_max_new_tokens)
        gsm = [score_sample(tokenizer.decode(o, skip_special_tokens=True), t).score >= 1.0
               for o, t in zip(outs, math_tasks)]

        convs = [[Message("user", p.question, thinking=False), Message("assistant", f"{p.rationale}\n#### {p.answer}")]
                 for p in probs]
        ppl = perplexity(model, tokenizer, convs, cfg.batch)

        tools = [CALCULATOR]
        outs = _greedy(engine, [prompt_ids(tokenizer, t, tools) for t in tool_tasks], cfg.tool_max_new_tokens)
        valid = [valid_tool_call(tokenizer.decode(o, skip_special_tokens=False), tools) for o in outs]
    finally:
        model.train(was)
    return {"arithmetic_acc": sum(arith) / len(arith), "gsm8k_acc": sum(gsm) / len(gsm), "heldout_ppl": ppl,
            "tool_call_validity": sum(valid) / len(valid)}


# ---------------------------------------------------------------- gating
def counts(cfg: GateEvalConfig) -> dict[str, int]:
    """How many prompts each accuracy is a share of (capped by the held-out addition pool)."""
    return {"arithmetic_acc": min(cfg.arithmetic, len(arithmetic.pairs("heldout"))), "gsm8k_acc": cfg.gsm8k,
            "tool_call_validity": cfg.tool}


def noise(before: float, after: float, n: int) -> float:
    """Two standard errors of the difference of two binomial shares over n prompts each (a share
    of 0 or 1 counts as 1/n or 1 - 1/n: one flip is always within reach)."""
    shares = [min(max(p, 1 / n), 1 - 1 / n) for p in (before, after)]
    return 2 * math.sqrt(sum(p * (1 - p) for p in shares) / n)


def passes(name: str, before: float, after: float, tolerance: float) -> bool:
    if EVALS[name] > 0:
        return after >= before - tolerance - 1e-12
    return after <= before * (1 + tolerance) + 1e-12


def gate(before: dict[str, float], after: dict[str, float], tolerances: dict[str, float],
         n: Optional[dict[str, int]] = None) -> dict[str, dict[str, Any]]:
    """{eval: {before, after, tolerance, passed[, noise, detects]}} (tolerance None: recorded, not
    gated). With `n` (counts()), an accuracy fails only past max(tolerance, noise); `detects` is
    False where the noise exceeds the tolerance: a regression of the tolerance's size would pass
    unseen (more prompts, `gates.evals`, would see it)."""
    out = {}
    for name in EVALS:
        if name not in before or name not in after:
            continue
        tol = tolerances.get(name)
        entry = {"before": before[name], "after": after[name], "tolerance": tol}
        if n and name in n:
            entry["noise"] = round(noise(before[name], after[name], n[name]), 4)
        if tol is not None and "noise" in entry:
            entry["detects"] = entry["noise"] <= tol
        allowed = None if tol is None else max(tol, entry.get("noise", 0.0))
        out[name] = {**entry, "passed": True if allowed is None else passes(name, before[name], after[name], allowed)}
    return out


def read_chain(parent_dir: Optional[Path]) -> dict[str, Any] | None:
    """The parent artifact's gates.json, if it has one."""
    if parent_dir is None or not (Path(parent_dir) / GATES_FILE).exists():
        return None
    path = Path(parent_dir) / GATES_FILE
    try:
        data = json.loads(path.read_text())
        chain, gates = list(data["chain"]), dict(data["gates"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a gates file ({e})") from None
    return {"chain": chain, "gates": gates}


def spec(cfg: GateEvalConfig, seed: int) -> dict[str, Any]:
    """What a measurement depends on besides the weights."""
    return {"version": MEASURE_VERSION, "seed": seed, **cfg.model_dump()}


def entry(stage: str, evals: dict[str, float], measured: dict[str, Any] | None) -> dict[str, Any]:
    return {"stage": stage, "evals": evals, **({"spec": measured} if measured is not None else {})}


def recorded(chain: dict[str, Any] | None, stage: str, measured: dict[str, Any]) -> dict[str, float] | None:
    """`stage`'s evals in a chain (read_chain) if they were measured under `measured` (spec())."""
    for c in (chain or {}).get("chain", []):
        if c.get("stage") == stage and c.get("spec") == measured:
            return dict(c["evals"])
    return None


def extend(parent: dict[str, Any] | None, parent_name: str, stage: str, before: dict[str, float],
           after: dict[str, float], stage_gates: dict[str, dict[str, Any]],
           measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """The parent's chain (or one starting with the parent's measured evals) plus this stage;
    `measured` (spec()) is recorded on the entries this stage measured."""
    if parent is None:
        parent = {"chain": [entry(parent_name, before, measured)], "gates": {}}
    chain = [c for c in parent["chain"] if c["stage"] != stage] + [entry(stage, after, measured)]
    return {"chain": chain, "gates": {**parent["gates"], stage: stage_gates}}


def table(data: dict[str, Any]) -> str:
    """Markdown: one row per eval, one column per stage of the chain, then this stage's gate."""
    chain = data["chain"]
    stage = chain[-1]["stage"]
    g = data["gates"].get(stage, {})
    head = ["eval"] + [c["stage"] for c in chain] + [f"{stage} tolerance", "passed"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in EVALS:
        vals = [c["evals"].get(name) for c in chain]
        if all(v is None for v in vals):
            continue
        e = g.get(name, {})
        tol = e.get("tolerance")
        cells = [name] + ["" if v is None else f"{v:.4g}" for v in vals]
        blind = ", cannot detect it" if e.get("detects") is False else ""
        cells += ["" if tol is None else f"{tol:g}" + (f" (noise {e['noise']:.2g}{blind})" if "noise" in e else ""),
                  "" if not e else ("yes" if e["passed"] else "**NO**")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(data: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chain = data["chain"]
    names = [n for n in EVALS if any(n in c["evals"] for c in chain)]
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), squeeze=False)
    x = list(range(len(chain)))
    for ax, n in zip(axes[0], names):
        ax.plot(x, [c["evals"].get(n, float("nan")) for c in chain], marker="o")
        ax.set_xticks(x, [c["stage"] for c in chain], rotation=40, ha="right", fontsize=7)
        ax.set_title(n + (" (lower better)" if EVALS[n] < 0 else ""), fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle("evaluation gates across post-training")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def finish(stage: str, out: Path, parent: dict[str, Any] | None, parent_name: str, before: dict[str, float],
           after: dict[str, float], tolerances: dict[str, float], n: Optional[dict[str, int]] = None,
           measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """Gate this stage, write gates.json / gates.md / gates.png into `out`, and raise GateError
    when a gate fails. `parent`: read_chain of the parent artifact (None: the chain starts with
    `parent_name`'s measured `before`); `n`: counts() of the evals; `measured`: their spec(). Returns
    the chain's {stage: {eval: {...}}} (status --json's `gates`)."""
    data = extend(parent, parent_name, stage, before, after, gate(before, after, tolerances, n), measured)
    out.mkdir(parents=True, exist_ok=True)
    (out / GATES_FILE).write_text(json.dumps(data, indent=1))
    md = table(data)
    (out / "gates.md").write_text(f"# Evaluation gates: {stage}\n\n{md}\n")
    plot(data, out / "gates.png")
    if not all(e["passed"] for e in data["gates"][stage].values()):
        raise GateError(stage, md)
    return data["gates"]
