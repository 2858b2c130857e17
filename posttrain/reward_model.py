"""The `reward-model` stage: an outcome reward model (ORM) for general RL, Bradley-Terry on
preference pairs built from the repo's real data.

    sft (weights), tokenize (tokenizer) --> reward-model

The model: the SFT GLM model with a scalar head, r(x, y) = w . norm(h_last) + b + a . [mean, min
of log p(y_t | y_<t, x) over the reply's tokens], h_last the last hidden state at the
conversation's last token (user prompt + assistant reply, chat template, thinking off;
left-truncated to `max_len` tokens so the end of the reply, where the corruptions below live, is
always seen); RewardModel says why the likelihood terms. Loss: Bradley-Terry, -log sigmoid(r(x, y_chosen) - r(x, y_rejected)).

The pairs (chosen = a reference answer, rejected = the same answer damaged; one pair per problem):
    gsm8k       GSM8K train problems after the lines SFT holds out (`gsm8k_skip`). Chosen: the human
                rationale + "#### answer". Rejected, alternating by problem:
                  wrong_number  the same rationale with a wrong final number (answer + d, d != 0)
                  truncated     the first half of the rationale's lines, no final answer
    mbpp        MBPP training ids (601-974). Chosen: the reference code. Rejected: one mutation
                that breaks it (a comparison, arithmetic operator or boolean flipped; with none
                present, the last half of the lines dropped)
    arithmetic  domains.arithmetic train pairs. Chosen: the sum's digits; rejected: one digit wrong
    tool        GSM8K train problems after the gsm8k pairs' with the calculator declared. Chosen: the
                solution's first calculator call (the tool call as SFT's tool_calc demonstrations
                make it). Rejected, by turns:
                  plain_wrong   a plain answer with a wrong final number, no call
                  malformed     the same call with its markup broken (an unterminated argument,
                                an undeclared tool, an unclosed call, a value without its key)
                  wrong_step    a call whose expression (one number changed) computes none of
                                the solution's calculator steps
Replies are the raw text the model writes (chat.template.reply_text: special tokens and the end
token included) in a one-turn conversation with the pair's tools declared (chat.template.reply_ids),
so a tool call is a sequence of the same tokens a policy's call is.
A pair is held out when crc32(prompt) % 100 < heldout_percent: the held-out pairwise accuracy
(the share of held-out pairs scored chosen > rejected; a tie counts one half) is the stage's
headline number, also read by rl-general. The construction is deterministic given the seed.

Artifact: backbone.safetensors (model.hf.save_state), head.safetensors (the scalar head and the
likelihood weights), orm.json (metrics, max_len, and the held-out scores' mean and std, overall and
per family of prompts (with tools declared or not: score_scales), which the judge standardises by),
metrics.jsonl, loss.png. Checkpoints (training.checkpoint) hold model,
heads, optimizer and step; each step's minibatch is a pure function of (seed, step), so resume is exact.
"""
from __future__ import annotations

import json
import logging
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from chat.template import Message, ToolCall, reply_ids, reply_text
from data_processing.tokenizer import load_tokenizer
from domains import arithmetic
from domains.pools import MBPP_TRAIN_IDS
from runtime.stage import Workdir
from rl import trainer
from rl.algorithms import PREFERENCE_LOSSES, PreferenceLossName
from rl.orm import RewardModel, save_reward_model
from rl.ranks import SINGLE, ParallelConfig, Ranks, check_placement
from rl.trainer import OptimConfig
from model.model import GLMModel
from training import checkpoint, metrics

log = logging.getLogger("glmforge")


class RewardModelConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(200, ge=1, description="optimizer steps")
    batch_pairs: int = Field(16, ge=1, description="preference pairs per optimizer step")
    optim: OptimConfig = Field(OptimConfig(lr=1e-5), description="the trainer's AdamW and gradient clip")
    loss: PreferenceLossName = Field("bradley_terry", description="preference loss by name "
                                     "(rl.algorithms.PREFERENCE_LOSSES)")
    max_len: int = Field(512, ge=8, description="tokens per conversation (the last ones are kept)")
    gsm8k_path: str = Field("{samples}/gsm8k/train.jsonl", description=(
        "GSM8K train problems the gsm8k pairs are built from ({samples} expands)"))
    gsm8k_skip: int = Field(200, ge=0, description="GSM8K train lines SFT holds out")
    gsm8k_pairs: int = Field(2000, ge=0, description=(
        "preference pairs from GSM8K problems (a wrong final number, or a truncated rationale)"))
    mbpp_path: str = Field("{samples}/mbpp/mbpp.jsonl", description=(
        "MBPP problems the mbpp pairs are built from ({samples} expands)"))
    mbpp_pairs: int = Field(374, ge=0, description=(
        "preference pairs from MBPP training problems (the reference code against one breaking mutation)"))
    arithmetic_pairs: int = Field(500, ge=0, description=(
        "preference pairs from the synthetic addition task (one digit wrong)"))
    tool_pairs: int = Field(600, ge=0, description=(
        "preference pairs from GSM8K problems with the calculator declared: the solution's first calculator "
        "call against a plain wrong answer, the call malformed, or a call that computes no step of the solution"))
    heldout_percent: int = Field(10, ge=1, le=50, description=(
        "percent of the pairs held out (by a hash of the prompt) for the held-out pairwise accuracy"))
    eval_batch: int = Field(32, ge=1, description="pairs per forward pass of the held-out evaluation")
    checkpoint_every: int = Field(50, ge=1, description="steps between checkpoints (and one at the end)")
    keep_last: int = Field(2, ge=1, description="complete checkpoints kept")
    parallel: ParallelConfig = Field(ParallelConfig(), description="the trainer's ranks (rl.ranks); one: in the "
                                     "stage's process")

    @model_validator(mode="after")
    def _placement(self) -> "RewardModelConfig":
        check_placement("reward-model", self.parallel, None)     # it generates nothing
        return self


# ---------------------------------------------------------------- pairs
@dataclass(frozen=True)
class Pair:
    kind: str            # gsm8k/wrong_number, gsm8k/truncated, mbpp/mutated, arithmetic/digit, tool/...
    prompt: str
    chosen: str          # raw replies (reply_text): what the model writes, end token included
    rejected: str
    tools: tuple[dict, ...] | None = None     # declared in the conversation's system prompt


_MUTATIONS = [("==", "!="), ("!=", "=="), ("<=", ">"), (">=", "<"), (" < ", " >= "), (" > ", " <= "),
              (" + ", " - "), (" - ", " + "), (" * ", " + "), ("True", "False"), ("False", "True"),
              (" and ", " or "), (" or ", " and ")]


def mutate_code(code: str, rng: random.Random) -> str:
    """One behaviour-changing edit of the code (module doc)."""
    options = [(a, b) for a, b in _MUTATIONS if a in code]
    if options:
        a, b = rng.choice(options)
        spots = [m.start() for m in re.finditer(re.escape(a), code)]
        i = rng.choice(spots)
        return code[:i] + b + code[i + len(a):]
    lines = code.rstrip().split("\n")
    return "\n".join(lines[: max(1, len(lines) // 2)]) + ("\n" if len(lines) > 1 else "\n    pass\n")


def gsm8k_pairs(path: str, skip: int, n: int, seed: int) -> list[Pair]:
    from domains.gsm8k import read_gsm8k

    rng = random.Random(seed)
    out = []
    for i, p in enumerate(read_gsm8k(path)[skip:skip + n]):
        chosen = f"{p.rationale}\n#### {p.answer}"
        if i % 2 == 0:
            try:
                wrong = float(p.answer) + rng.choice([-1, 1]) * rng.randint(1, 9)
                wrong_s = str(int(wrong)) if wrong == int(wrong) else str(wrong)
            except ValueError:
                wrong_s = p.answer + "0"
            out.append(Pair("gsm8k/wrong_number", p.question, plain(chosen), plain(f"{p.rationale}\n#### {wrong_s}")))
        else:
            lines = p.rationale.split("\n")
            cut = "\n".join(lines[: max(1, len(lines) // 2)])
            if len(lines) == 1:
                cut = p.rationale[: max(1, len(p.rationale) // 2)]
            out.append(Pair("gsm8k/truncated", p.question, plain(chosen), plain(cut)))
    return out


def mbpp_pairs(path: str, n: int, seed: int) -> list[Pair]:
    from data_processing.common import expand_path

    rng = random.Random(seed + 1)
    p = expand_path(path)
    out = []
    for ln, line in enumerate(Path(p).read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            tid, code, tests = int(rec["task_id"]), str(rec["code"]), list(rec["test_list"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{p}:{ln}: not an MBPP record ({e})") from None
        if tid not in MBPP_TRAIN_IDS:
            continue
        code = code.replace("\r\n", "\n")
        bad = mutate_code(code, rng)
        if bad != code:
            prompt = f"{rec['text'].strip()} Your code should pass this test:\n{tests[0]}"
            out.append(Pair("mbpp/mutated", prompt, plain(f"```python\n{code}\n```"), plain(f"```python\n{bad}\n```")))
        if len(out) >= n:
            break
    return out


def arithmetic_pairs(n: int, seed: int) -> list[Pair]:
    rng = random.Random(seed + 2)
    return [Pair("arithmetic/digit", t.prompt, plain(t.answer), plain(arithmetic.corrupted(t.answer, rng)))
            for t in arithmetic.tasks(n, "train", seed)]


_BREAKS = (("</arg_value>", ""), ("calculator", "calc"), ("</tool_call>", ""), ("<arg_key>expression</arg_key>", ""))


def tool_pairs(path: str, skip: int, n: int, seed: int) -> list[Pair]:
    """The `tool` pairs (module doc) from the problems after line `skip`, at most n: problems
    whose calculator steps the calculator reproduces (as SFT's tool_calc keeps them)."""
    from domains.gsm8k import read_gsm8k, reproduced_steps
    from domains.tools import CALCULATOR, calculator, same_number

    rng = random.Random(seed + 3)
    tools = (CALCULATOR,)
    out: list[Pair] = []
    for p in read_gsm8k(path)[skip:]:
        if len(out) >= n:
            break
        steps = reproduced_steps(p)
        if not p.calls or steps is None:
            continue
        expr = p.calls[0][1]
        chosen = reply_text(Message("assistant", tool_calls=(ToolCall("calculator", {"expression": expr}),)))
        kind = ("plain_wrong", "malformed", "wrong_step")[len(out) % 3]
        if kind == "plain_wrong":
            try:
                wrong = float(p.answer) + rng.choice([-1, 1]) * rng.randint(1, 9)
            except ValueError:
                continue
            rejected = plain(f"The answer is {int(wrong) if wrong == int(wrong) else wrong}.")
        elif kind == "malformed":
            a, b = rng.choice(_BREAKS)
            rejected = chosen.replace(a, b, 1)
        else:
            numbers = list(re.finditer(r"\d+(\.\d+)?", expr))
            m = rng.choice(numbers)
            bad = expr[:m.start()] + str(int(float(m.group())) + rng.randint(1, 9)) + expr[m.end():]
            try:
                if any(same_number(calculator(bad), x) for x in steps):
                    continue
            except ValueError:
                continue
            rejected = reply_text(Message("assistant", tool_calls=(ToolCall("calculator", {"expression": bad}),)))
        out.append(Pair(f"tool/{kind}", p.question, chosen, rejected, tools))
    return out


def plain(text: str) -> str:
    """A plain reply as the model writes it (no tool call): the text and the end token."""
    return reply_text(Message("assistant", text))


def build_pairs(cfg: RewardModelConfig, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(train, held out), split by a hash of the prompt."""
    pairs = (gsm8k_pairs(cfg.gsm8k_path, cfg.gsm8k_skip, cfg.gsm8k_pairs, seed)
             + mbpp_pairs(cfg.mbpp_path, cfg.mbpp_pairs, seed) + arithmetic_pairs(cfg.arithmetic_pairs, seed)
             + tool_pairs(cfg.gsm8k_path, cfg.gsm8k_skip + cfg.gsm8k_pairs, cfg.tool_pairs, seed))
    if not pairs:
        raise ValueError("reward-model: no preference pairs (gsm8k_pairs, mbpp_pairs, arithmetic_pairs, tool_pairs "
                         "all 0?)")
    held = [p for p in pairs if zlib.crc32(p.prompt.encode()) % 100 < cfg.heldout_percent]
    train = [p for p in pairs if zlib.crc32(p.prompt.encode()) % 100 >= cfg.heldout_percent]
    if not train or not held:
        raise ValueError(f"reward-model: {len(train)} train / {len(held)} held-out pairs; need both > 0")
    return train, held


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """Share of pairs scored chosen > rejected; a tie counts one half."""
    if chosen.shape != rejected.shape or chosen.numel() == 0:
        raise ValueError(f"pairwise_accuracy: shapes {tuple(chosen.shape)} / {tuple(rejected.shape)}")
    return float(((chosen > rejected).float() + 0.5 * (chosen == rejected).float()).mean())


@torch.no_grad()
def heldout_accuracy(rm: RewardModel, chosen: list[tuple[list[int], int]], rejected: list[tuple[list[int], int]],
                     kinds: list[str], batch: int, with_tools: list[bool] | None = None) -> dict[str, Any]:
    """Pairwise accuracy (all, per kind), the mean margin, and the scale of the scores: their mean
    and std over the held-out replies of each family of prompts, those that declare tools and
    those that do not (`scales`; the judge standardises each reply by its prompt's family: on the
    tiny preset a malformed call scores so far below everything else that one scale for both
    made the plain replies' differences 4x smaller)."""
    c, r = rm.score_ids(chosen, batch), rm.score_ids(rejected, batch)
    per_kind = {}
    for k in sorted(set(kinds)):
        sel = torch.tensor([x == k for x in kinds])
        per_kind[k] = pairwise_accuracy(c[sel], r[sel])
    both = torch.cat([c, r])
    tools = torch.tensor(with_tools or [False] * len(kinds))
    scales = {}
    for family, sel in (("plain", ~tools), ("tools", tools)):
        scores = torch.cat([c[sel], r[sel]])
        if scores.numel() > 1:
            scales[family] = {"mean": float(scores.mean()), "std": float(scores.std())}
    return {"accuracy": pairwise_accuracy(c, r), "per_kind": per_kind, "n": len(kinds),
            "margin": float((c - r).mean()), "score_mean": float(both.mean()), "score_std": float(both.std()),
            "scales": scales}


# ---------------------------------------------------------------- the stage
def run_reward_model(cfg: RewardModelConfig, inputs: dict[str, Path], workdir: Workdir) -> dict[str, Any]:
    if cfg.parallel.launch.world_size > 1:
        from rl.launch import run_on_ranks

        return run_on_ranks("reward-model", cfg, inputs, workdir, cfg.parallel.launch)
    return train(cfg, inputs, workdir)


def train(cfg: RewardModelConfig, inputs: dict[str, Path], workdir: Workdir, ranks: Ranks = SINGLE
          ) -> dict[str, Any] | None:
    """The stage in this process, or as one of `ranks` (rl.launch): each rank scores its share of
    the step's pairs, the loss scaled to the whole batch's mean (rl.ranks; the backbone's experts
    sharded over them with parallel.expert_parallel); rank 0 evaluates and publishes."""
    seed = workdir.seed
    lead = ranks.rank == 0
    tokenizer = load_tokenizer(inputs["tokenize"])
    backbone = trainer.load_policy(inputs["rl-reasoning"], "rl-reasoning", tokenizer, seed)
    pad_id = tokenizer.token_to_id("<|pad|>")
    rm = RewardModel(backbone, pad_id)
    train, held = build_pairs(cfg, seed)
    enc = lambda ps, side: [reply_ids(tokenizer, p.prompt, getattr(p, side), cfg.max_len, p.tools)  # noqa: E731
                            for p in ps]
    tr_c, tr_r = enc(train, "chosen"), enc(train, "rejected")
    he_c, he_r, kinds = enc(held, "chosen"), enc(held, "rejected"), [p.kind for p in held]
    with_tools = [bool(p.tools) for p in held]
    root, log_path = workdir.checkpoint / trainer.CHECKPOINTS, workdir.checkpoint / "metrics.jsonl"
    fresh = checkpoint.select_resume(root) is None
    before = heldout_accuracy(rm, he_c, he_r, kinds, cfg.eval_batch, with_tools) if fresh and lead else {}  # whole model
    ranks = ranks.with_experts_sharded(rm, cfg.parallel.expert_parallel)
    policy = trainer.policy_for(rm, cfg.optim, None, ranks, cfg.parallel.zero_stage)
    opt = policy.optimizer
    resumed = trainer.load_latest(root, policy, log_path, "reward-model")
    start = 0
    if resumed is not None:
        start, before = resumed[0], resumed[1]["before"]
    rm.train()

    def one_step(step: int) -> dict[str, Any]:
        rng = random.Random(seed * 1_000_003 + step)
        idx, scale = ranks.share([rng.randrange(len(train)) for _ in range(cfg.batch_pairs)])
        scores = rm([tr_c[i] for i in idx] + [tr_r[i] for i in idx])
        c, r = scores[: len(idx)], scores[len(idx):]
        loss = PREFERENCE_LOSSES[cfg.loss](c, r)
        gnorm = trainer.clip_and_step(rm, opt, loss * scale, cfg.optim.grad_clip, ranks)
        n = len(idx) * (scale > 0)
        sums = ranks.sum([float(loss.detach()) * n, pairwise_accuracy(c.detach(), r.detach()) * n,
                          float((c - r).detach().mean()) * n, float(n)])
        return {"step": step, "loss": sums[0] / sums[3], "train_pair_accuracy": sums[1] / sums[3],
                "margin": sums[2] / sums[3], "grad_norm": gnorm}

    trainer.run_steps("reward-model", policy, one_step, start=start, steps=cfg.steps, root=root, log_path=log_path,
                      workdir=workdir, checkpoint_every=cfg.checkpoint_every, keep_last=cfg.keep_last,
                      meta=lambda: {"before": before}, describe=lambda r: f"loss {r['loss']:.3f}")
    rm = trainer.whole_model(rm, ranks, lambda: RewardModel(GLMModel(backbone.config), pad_id))   # a collective
    if not lead:
        return None
    after = heldout_accuracy(rm, he_c, he_r, kinds, cfg.eval_batch, with_tools)
    records = metrics.read(log_path)
    out = workdir.out
    kinds_count: dict[str, int] = {}
    for p in train + held:
        kinds_count[p.kind] = kinds_count.get(p.kind, 0) + 1
    result = {
        "steps": len(records),
        "pairs": {"train": len(train), "heldout": len(held), "by_kind": kinds_count},
        "heldout_pairwise_accuracy": {"before": before["accuracy"], "after": after["accuracy"], "n": after["n"]},
        "heldout_accuracy_per_kind": after["per_kind"],
        "loss": {"first": records[0]["loss"], "last": records[-1]["loss"]} if records else None,
        "trainer_ranks": ranks.world,
        "placement": {"trainer_ranks": ranks.world, "expert_parallel": cfg.parallel.expert_parallel},
    }
    save_reward_model(rm, out, {"heldout_pairwise_accuracy": after["accuracy"], "per_kind": after["per_kind"],
                                "n": after["n"], "max_len": cfg.max_len,
                                "score_mean": after["score_mean"], "score_std": after["score_std"],
                                "score_scales": after["scales"]})
    trainer.publish("reward-model", out, records, plot=lambda rs, o: plot(rs, o / "loss.png", result))
    return result


def plot(records: list[dict[str, Any]], png: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["loss"] for r in records], label="Bradley-Terry loss")
    ax.plot(steps, [r["train_pair_accuracy"] for r in records], label="train pair accuracy", alpha=0.6)
    h = result["heldout_pairwise_accuracy"]
    ax.scatter([0, steps[-1]], [h["before"], h["after"]], color="red", zorder=3, label="held-out pairwise accuracy")
    ax.set_xlabel("step")
    ax.set_title("reward-model (ORM)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
