"""SFT conversations built from real sources in the repo, tokenized through the chat template and
packed with their loss masks.

Kinds of sample (every kind cycles through the three thinking modes of chat.template:
interleaved, preserved, turn; in turn mode every other sample switches thinking off):
    reasoning   a GSM8K question answered with its human-written rationale as reasoning (the
                <<a*b=c>> calculator annotations removed); every third one is a two-question,
                two-turn conversation, so interleaved (history reasoning dropped) and preserved
                (kept) render differently.
    tool_calc   the same questions solved with the `calculator` tool: each <<expr=result>>
                annotation becomes a <tool_call>calculator(expression=expr)</tool_call> turn and
                its <tool_response> is what our calculator actually computes for expr (a sample
                whose annotation disagrees with the real result is left out).
    tool_docs   "What does textwrap.dedent do?" answered by calling `search_docs`, a lookup
                over the docstrings of local Python standard-library modules (parsed with ast,
                nothing imported); the tool response is the real docstring.
    code        "write the function given its signature and docstring" for standard-library
                functions; the answer is the function's real source.

Held out (the "val" split and the GSM8K accuracy eval): GSM8K's first `eval_lines` lines (the
decontamination stage treats train_first200.jsonl as an eval set, so training never sees them)
and the standard-library functions whose name hashes into `val_fraction` (crc32, stable across
runs and machines).

Tokenization goes only through chat.template.encode, so the loss mask is 1 on the
assistant's own tokens (kept reasoning, content, tool calls, end token) and 0 elsewhere;
data_processing.packing.pack_samples stores it beside the tokens, with a document start at
every sample so attention never crosses samples.
"""
from __future__ import annotations

import json
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from chat.template import THINKING_MODES, Message, ToolCall, encode
from data_processing.packing import pack_samples
from data_processing.tokenizer import EOS, PAD
from domains import arithmetic
from domains.gsm8k import Problem, read_gsm8k, reproduced_steps
from domains.tools import (
    CALCULATOR,
    MAX_DOC_CHARS,
    SEARCH_DOCS,
    STDLIB,
    DocIndex,
    Function,
    stdlib_functions,
)

KINDS = ("reasoning", "tool_calc", "tool_docs", "code", "arithmetic")
# a self-distill@R artifact (posttrain.self_distill): token-level examples and their counts
DISTILLED, DISTILLED_META = "examples.jsonl", "self_distill.json"
# a file name with "test" as a word: test.jsonl, gsm8k-test.jsonl, test_sample.jsonl (not latest.jsonl)
_TEST_SPLIT = re.compile(r"(?<![a-z])test(?![a-z])")


class SFTDataConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    gsm8k_path: str = Field("{samples}/gsm8k/train.jsonl", description="GSM8K train.jsonl ({samples} expands)")
    eval_lines: int = Field(200, ge=1, description="GSM8K's first lines: held out (decontamination's eval set)")
    reasoning: int = Field(600, ge=0, description="training samples of each kind")
    tool_calc: int = Field(300, ge=0, description=(
        "training samples of GSM8K questions solved with calculator tool calls"))
    tool_docs: int = Field(150, ge=0, description=(
        "training samples answering a standard-library question by calling search_docs"))
    code: int = Field(150, ge=0, description=(
        "training samples writing a standard-library function from its signature and docstring"))
    arithmetic: int = Field(0, ge=0, description="demonstrations of rl-reasoning's synthetic addition task "
                            "(domains.arithmetic): the warm start that puts RL at the edge of competence")
    arithmetic_with_tools: float = Field(0.0, ge=0, le=1, description="share of arithmetic demonstrations "
                                         "that offer the calculator and answer directly")
    arithmetic_tool_calls: float = Field(0.0, ge=0, le=1, description="share of arithmetic demonstrations "
                                         "that call the calculator in the prompt's notation and copy its "
                                         "result (rl.envs.calc_arith with reverse_digits: the agentic warm start)")
    arithmetic_tool_digits: int = Field(2, ge=1, le=4, description="operand digits of those demonstrations "
                                        "(3: rl.envs calc_arith3, sums beyond the direct demonstrations)")
    arithmetic_tool_schema: bool = Field(True, description="show the calculator's schema in those demonstrations' "
                                         "prompt (calc_arith's schema_in_prompt must agree)")
    arithmetic_corrupt: float = Field(0.35, ge=0, lt=1, description="share of arithmetic demonstrations with "
                                      "one wrong digit (keeps sampled accuracy where GRPO has reward variance)")
    val_per_kind: int = Field(16, ge=1, description="held-out conversations of each kind")
    val_fraction: float = Field(0.15, gt=0, lt=1, description="share of stdlib functions held out")
    max_doc_chars: int = Field(MAX_DOC_CHARS, ge=50, description="search_docs returns at most this much of a docstring")
    max_code_chars: int = Field(700, ge=50, description="code tasks use functions up to this source length")
    max_calls: int = Field(4, ge=1, description="tool_calc samples have at most this many calculator calls")
    seed: int = Field(0, description="seed of the training samples' order and of the arithmetic demonstrations")

    @field_validator("gsm8k_path")
    @classmethod
    def _not_test_split(cls, v: str) -> str:
        # GSM8K's test split is for evaluation and decontamination only: SFT trains on this file
        if _TEST_SPLIT.search(Path(v).name.lower()):
            raise ValueError(f"gsm8k_path {v!r} names a test split; SFT trains on this file, "
                             "so point it at GSM8K train.jsonl (test.jsonl is for evaluation only)")
        return v


@dataclass(frozen=True)
class SFTExample:
    kind: str
    messages: tuple[Message, ...]
    tools: tuple[dict, ...] | None
    thinking_mode: str
    train_history: bool = True

    def encode(self, tokenizer):
        return encode(tokenizer, self.messages, list(self.tools) if self.tools else None, self.thinking_mode,
                      train_history=self.train_history)


def gsm8k_splits(cfg: SFTDataConfig) -> tuple[list[Problem], list[Problem]]:
    """(train, held out): the first eval_lines lines are held out."""
    probs = read_gsm8k(cfg.gsm8k_path)
    if len(probs) <= cfg.eval_lines:
        raise ValueError(f"{cfg.gsm8k_path}: {len(probs)} problems, need more than eval_lines={cfg.eval_lines}")
    return probs[cfg.eval_lines:], probs[: cfg.eval_lines]


# ---------------------------------------------------------------- conversations
def _mode(i: int) -> tuple[str, bool]:
    """SFTExample i's thinking mode and whether thinking is on (off for every other turn-mode one)."""
    mode = THINKING_MODES[i % 3]
    return mode, not (mode == "turn" and (i // 3) % 2 == 1)


def _qa(p: Problem, thinking: bool) -> list[Message]:
    if thinking:
        return [Message("user", p.question), Message("assistant", f"The answer is {p.answer}.", reasoning=p.rationale)]
    return [Message("user", p.question, thinking=False), Message("assistant", f"{p.rationale}\n#### {p.answer}")]


def reasoning_sample(i: int, probs: list[Problem]) -> SFTExample:
    mode, thinking = _mode(i)
    msgs = _qa(probs[0], thinking)
    if len(probs) > 1:            # a second turn: history reasoning is where the modes differ
        msgs += _qa(probs[1], thinking)
    # Interleaved / turn modes show earlier turns without their reasoning, a context the model
    # never answered from: only the last turn is trained (chat_template.encode's advice).
    return SFTExample("reasoning", tuple(msgs), None, mode, train_history=(mode == "preserved" or len(probs) == 1))


def calc_sample(i: int, p: Problem, max_calls: int) -> SFTExample | None:
    """The problem solved through calculator calls, or None when a call cannot be reproduced."""
    if not p.calls or len(p.calls) > max_calls:
        return None
    mode, thinking = _mode(i)
    msgs = [Message("user", p.question, thinking=thinking)]
    results = reproduced_steps(p)
    if results is None:           # a call the calculator cannot evaluate, or GSM8K's annotation disagrees
        return None
    for (before, expr, _), result in zip(p.calls, results):
        reasoning = (before or f"I need {expr}.") if thinking else ""
        msgs += [Message("assistant", reasoning=reasoning, tool_calls=(ToolCall("calculator", {"expression": expr}),)),
                 Message("tool", result)]
    final = "The answer is " + p.answer + "."
    msgs.append(Message("assistant", final, reasoning=p.rationale if thinking else ""))
    return SFTExample("tool_calc", tuple(msgs), (CALCULATOR,), mode)


def docs_sample(i: int, f: Function, index: DocIndex) -> SFTExample:
    mode, thinking = _mode(i)
    doc = index.search(f.name)
    summary = f.doc.split("\n\n")[0]
    msgs = [Message("user", f"What does `{f.name}` from the Python standard library do?", thinking=thinking),
            Message("assistant", reasoning=f"I should look up the documentation of {f.name}." if thinking else "",
                    tool_calls=(ToolCall("search_docs", {"query": f.name}),)),
            Message("tool", doc),
            Message("assistant", f"`{f.name}{f.signature[f.signature.index('('):]}`: {summary}",
                    reasoning="The documentation answers it; I summarise its first paragraph." if thinking else "")]
    return SFTExample("tool_docs", tuple(msgs), (SEARCH_DOCS,), mode)


def code_sample(i: int, f: Function) -> SFTExample:
    mode, thinking = _mode(i)
    module = f.name.rsplit(".", 1)[0]
    ask = f"Write the Python function `{f.signature}` of the `{module}` module. Its docstring:\n\n{f.doc}"
    reasoning = (f"I need to implement {f.signature} so that it does what the docstring says: "
                 f"{f.doc.splitlines()[0]}") if thinking else ""
    return SFTExample("code", (Message("user", ask, thinking=thinking),
                           Message("assistant", f"```python\n{f.source}\n```", reasoning=reasoning)), None, mode)


def arithmetic_samples(n: int, split: str, seed: int, corrupt: float, with_tools: float = 0.0,
                       tool_calls: float = 0.0, tool_schema: bool = True,
                       tool_digits: int = arithmetic.DIGITS) -> list[SFTExample]:
    """Addition in domains.arithmetic's format, thinking off; held-out pairs only in the val split.
    A `with_tools` share offers the calculator and answers directly: without it the model learns
    that an offered tool is always called, and agentic RL's calc_arith (the same prompt with the
    calculator) starts with no correct answer at all, so no reward variance to learn from.
    A `tool_calls` share calls the calculator with the operands in the prompt's notation and copies
    its answer-format result, as rl.envs.calc_arith(reverse_digits=True) prints it; `corrupt`
    puts one wrong digit into that copy as into direct answers; tool_schema=False leaves the
    schema out of their prompt (calc_arith's schema_in_prompt=False); they add `tool_digits`-digit
    operands (held-out pairs only in the val split, as for the direct ones)."""
    rng = random.Random(seed)
    split = "train" if split == "train" else "heldout"
    wide = tool_digits != arithmetic.DIGITS and tool_calls > 0
    listed = wide and tool_digits <= arithmetic.LISTED_DIGITS
    wide_pairs = arithmetic.pairs(split, tool_digits) if listed else []
    out = []
    for t in arithmetic.tasks(n, split, seed):
        calls = tool_calls and rng.random() < tool_calls                                  # no draw at 0
        if calls and wide:
            pair = rng.choice(wide_pairs) if listed else arithmetic.random_pair(split, tool_digits, rng)
            t = arithmetic.task(*pair, tool_digits)
        answer = arithmetic.corrupted(t.answer, rng) if split == "train" and rng.random() < corrupt else t.answer
        user = Message("user", t.prompt, thinking=False)
        if calls:
            call = ToolCall("calculator", {"expression": arithmetic.expression(t.meta["a"], t.meta["b"],
                                                                               t.meta["digits"])})
            out.append(SFTExample("arithmetic", (user, Message("assistant", tool_calls=(call,)),
                                             Message("tool", t.answer), Message("assistant", answer)),
                              (CALCULATOR,) if tool_schema else None, "turn"))
            continue
        tools = (CALCULATOR,) if with_tools and rng.random() < with_tools else None   # no draw at 0
        out.append(SFTExample("arithmetic", (user, Message("assistant", answer)), tools, "turn"))
    return out


def _valid(make, *args) -> SFTExample | None:
    """Build a sample; text the template refuses (a special-token string inside) is skipped."""
    try:
        return make(*args)
    except ValueError:
        return None


def _take(candidates, n: int) -> list[SFTExample]:
    out = []
    for s in candidates:
        if len(out) == n:
            break
        if s is not None:
            out.append(s)
    return out


def build_samples(cfg: SFTDataConfig) -> dict[str, list[SFTExample]]:
    """{"train": [...], "val": [...]} conversations of every kind (counts from cfg)."""
    train_p, eval_p = gsm8k_splits(cfg)
    funcs = stdlib_functions()
    if not funcs:
        raise ValueError(f"no documented functions found under {STDLIB}")
    held = [f for f in funcs if zlib.crc32(f.name.encode()) % 1000 < cfg.val_fraction * 1000]
    kept = [f for f in funcs if f not in held]
    index = DocIndex(funcs, cfg.max_doc_chars)     # the tool sees the whole corpus
    rng = random.Random(cfg.seed)

    def for_split(probs: list[Problem], fs: list[Function], counts: dict[str, int], split: str) -> list[SFTExample]:
        def pairs():
            i = k = 0
            while k < len(probs):
                # every third group of three is two-turn: one in each thinking mode
                take = 2 if (i // 3) % 3 == 2 and k + 1 < len(probs) else 1
                yield _valid(reasoning_sample, i, probs[k:k + take])
                i, k = i + 1, k + take
        short = [f for f in fs if len(f.source) <= cfg.max_code_chars]
        return (_take(pairs(), counts["reasoning"])
                + _take((_valid(calc_sample, i, p, cfg.max_calls) for i, p in enumerate(probs)), counts["tool_calc"])
                + _take((_valid(docs_sample, i, f, index) for i, f in enumerate(fs)), counts["tool_docs"])
                + _take((_valid(code_sample, i, f) for i, f in enumerate(short)), counts["code"])
                + arithmetic_samples(counts["arithmetic"], split, cfg.seed, cfg.arithmetic_corrupt,
                                     cfg.arithmetic_with_tools, cfg.arithmetic_tool_calls, cfg.arithmetic_tool_schema,
                                     cfg.arithmetic_tool_digits))

    train = for_split(train_p, kept, {k: getattr(cfg, k) for k in KINDS}, "train")
    val = for_split(eval_p, held, {k: cfg.val_per_kind if getattr(cfg, k) else 0 for k in KINDS}, "val")
    rng.shuffle(train)
    return {"train": train, "val": val}


def read_distilled(artifact: Path) -> tuple[list[dict[str, Any]], bool]:
    """A self-distill artifact's examples and whether they replace the original demonstrations."""
    lines = (artifact / DISTILLED).read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()], bool(json.loads((artifact / DISTILLED_META).read_text())["replace"])


def replaced_by(example: SFTExample, domains: set[str]) -> bool:
    """Whether distilled examples of `domains` take this original demonstration's place: the
    direct arithmetic answers (not the calculator calls, the agentic warm start) and the GSM8K
    rationales."""
    if example.kind == "arithmetic":
        return "arithmetic" in domains and not any(m.tool_calls for m in example.messages)
    return example.kind == "reasoning" and "math" in domains


def build_sft_data(cfg: SFTDataConfig, tokenizer, out: Path, seq_len: int,
                   distilled: Path | None = None) -> dict[str, Any]:
    """Build, encode and pack the conversations under `out` (a PackedDataset directory with a
    loss mask). Samples longer than seq_len are dropped and counted. `distilled`: a self-distill
    artifact whose examples join the train split (replacing their domains' demonstrations when
    it says so). Returns statistics."""
    samples = build_samples(cfg)
    splits, stats = {}, {"dropped_too_long": 0}
    extra: list[tuple[list[int], list[int]]] = []
    if distilled is not None:
        examples, replace = read_distilled(distilled)
        if replace:
            domains = {e["domain"] for e in examples}
            kept = [s for s in samples["train"] if not replaced_by(s, domains)]
            stats["replaced_by_self_distill"] = len(samples["train"]) - len(kept)
            samples["train"] = kept
        extra = [(e["prompt_ids"] + e["response_ids"], [0] * len(e["prompt_ids"]) + [1] * len(e["response_ids"]))
                 for e in examples]
    for split, items in samples.items():
        encoded = []
        for s in items:
            enc = s.encode(tokenizer)
            if len(enc.ids) > seq_len:
                stats["dropped_too_long"] += 1
                continue
            encoded.append((enc.ids, enc.loss_mask))
            key = f"{split}/{s.kind}/{s.thinking_mode}"
            stats[key] = stats.get(key, 0) + 1
        if split == "train" and extra:
            fits = [e for e in extra if len(e[0]) <= seq_len]
            stats["dropped_too_long"] += len(extra) - len(fits)
            stats["train/self_distill"] = len(fits)
            encoded += fits
            random.Random(cfg.seed).shuffle(encoded)    # the distilled examples among the others
        if not encoded:
            raise ValueError(f"sft: no {split} sample fits in seq_len={seq_len}")
        splits[split] = encoded
    meta = pack_samples(splits, out, seq_len, tokenizer.token_to_id(PAD), tokenizer.token_to_id(EOS),
                        extra_meta={"sft": stats, "seed": cfg.seed})
    return {"samples": stats, "train_sequences": meta["splits"]["train"]["sequences"],
            "val_sequences": meta["splits"]["val"]["sequences"],
            "train_target_tokens": meta["splits"]["train"]["target_tokens"]}
