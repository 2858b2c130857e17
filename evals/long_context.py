"""A RULER-like synthetic long-context suite: find facts planted in a haystack of real text.

Tasks (RULER's NIAH and variable-tracking families, answers a few tokens long so greedy
decoding is cheap on CPU):
  single_key         one needle "The value of key K is V." in the haystack; ask for V.
  multi_key          the same with distractor needles for other keys.
  multi_value        several needles share one key; ask for all values, in order of appearance.
  variable_tracking  a chain "VAR A = V." ... "VAR B = VAR A." ... plus a distractor chain;
                     ask for the value of the chain's last variable.
Every prompt ends with a question line "What is ...? Answer: <the needle's words up to the
value>", and the expected continuation is " V" (first line, stripped, compared exactly).

Lengths are in tokens of the given tokenizer (within +-5% of the target, at most the target).
The haystack is consecutive sentences of a real corpus (filler_texts), never random characters;
sentences with digits are dropped so a number in the prompt is always a planted value.

Train/eval separation: keys are pseudo-words; crc32(key) % 5 == 0 reserves a key for
evaluation, every other key is for training documents. No training document can therefore
contain an evaluation example's key, whatever the seeds.

Baselines for the paper's comparison (RULER, 9B: full 75.28, DSA ~75, interleaved SWA 44.93):
`baseline_configs` derives full / dsa / swa ModelConfigs from one base config.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from data_processing.document import Document
from data_processing.tokenizer import EOS
from model.config import ModelConfig

TASKS = ("single_key", "multi_key", "multi_value", "variable_tracking")
LENGTH_TOLERANCE = 0.05
REPO = Path(__file__).resolve().parents[1]
DEFAULT_FILLER = REPO / "samples" / "tinyshakespeare" / "input.txt"

_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"
_MULTI_KEY_DISTRACTORS = 3
_MULTI_VALUES = 3
_FIT_ATTEMPTS = 20
_CHAIN_HOPS = 3            # variables in each chain: VAR A = V, VAR B = VAR A, VAR C = VAR B


@dataclass(frozen=True)
class Example:
    task: str
    length: int          # target prompt length in tokens
    prompt: str          # ends with the question line
    answer: str          # expected continuation, without the leading space
    n_tokens: int        # actual prompt length in tokens
    keys: tuple[str, ...]  # every key / variable name planted in the prompt


# ---------------------------------------------------------------- haystack
def filler_sentences(texts: Sequence[str], min_words: int = 4, max_words: int = 40) -> list[str]:
    """Corpus texts -> sentences with collapsed whitespace. Sentences with digits or '=' are
    dropped (they could be mistaken for a planted value or assignment)."""
    out = []
    for text in texts:
        for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
            n = len(s.split())
            if min_words <= n <= max_words and not re.search(r"[0-9=]", s):
                out.append(s)
    return out


class _Haystack:
    """Sentences and their token counts, encoded once per suite."""

    def __init__(self, tokenizer, filler_texts: Sequence[str]):
        self.tokenizer = tokenizer
        self.sentences = filler_sentences(filler_texts)
        if len(self.sentences) < 50:
            raise ValueError(f"filler_texts give only {len(self.sentences)} usable sentences (need >= 50 "
                             "sentences of 4-40 words without digits); pass more real text")
        # Byte-level BPE pre-splits on spaces, so " " + sentence costs the same inside a prompt.
        self.counts = [len(e.ids) for e in tokenizer.encode_batch([" " + s for s in self.sentences])]

    def n_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)

    def fit(self, rng: random.Random, length: int, needles: list[str], depths: list[float],
            question: str) -> tuple[str, int]:
        """The longest prompt of at most `length` tokens: consecutive sentences from a random
        start, the needles at their depths (0 = start, 1 = end), then the question."""
        # Counted with a leading space: inside the prompt every needle follows a space.
        base = self.n_tokens(" " + _assemble([], needles, depths, question))
        if base > length * (1 - LENGTH_TOLERANCE):
            raise ValueError(f"length {length} is too short: needles and question alone take {base} tokens")
        # A single long word (a speaker's name in capitals, with a small vocabulary) can cost
        # more than the tolerance; then another stretch of the corpus is tried.
        for _ in range(_FIT_ATTEMPTS):
            prompt, got = self._fit_from(rng.randrange(len(self.sentences)), length, base, needles, depths, question)
            if got >= length * (1 - LENGTH_TOLERANCE):
                return prompt, got
        raise ValueError(f"could not fill a {length}-token prompt to within {LENGTH_TOLERANCE:.0%} in "
                         f"{_FIT_ATTEMPTS} tries (last: {got} tokens); use a longer length")

    def _fit_from(self, k: int, length: int, base: int, needles: list[str], depths: list[float],
                  question: str) -> tuple[str, int]:
        """The longest prompt of at most `length` tokens whose filler starts at sentence k."""
        # Enough consecutive sentences to overshoot (by the per-sentence counts), plus one more
        # in case those counts run a little high.
        n = len(self.sentences)
        total, words = base, []
        while total <= length:
            words.append(self.sentences[k % n].split())
            total += self.counts[k % n]
            k += 1
        words.append(self.sentences[k % n].split())

        def build(m: int) -> str:
            """The prompt with the first m filler words (sentence boundaries kept)."""
            filler, left = [], m
            for w in words:
                if left <= 0:
                    break
                filler.append(" ".join(w[:left]))
                left -= len(w)
            return _assemble(filler, needles, depths, question)

        # Tokens grow with every added word: bisect on the real count for the most that fit.
        lo, hi = 0, sum(len(w) for w in words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.n_tokens(build(mid)) <= length:
                lo = mid
            else:
                hi = mid - 1
        prompt = build(lo)
        return prompt, self.n_tokens(prompt)


def _assemble(filler: list[str], needles: list[str], depths: list[float], question: str) -> str:
    """Needles go before filler sentence round(depth * len(filler)); needles are given in
    ascending depth, so their relative order (a chain's, the values') is kept."""
    at = [round(d * len(filler)) for d in depths]
    pieces, j = [], 0
    for i, sentence in enumerate(filler):
        while j < len(needles) and at[j] <= i:
            pieces.append(needles[j])
            j += 1
        pieces.append(sentence)
    pieces.extend(needles[j:])
    return " ".join(pieces) + "\n" + question


def default_filler_texts() -> list[str]:
    """The shipped haystack corpus (samples/tinyshakespeare)."""
    if not DEFAULT_FILLER.exists():
        raise ValueError(f"haystack corpus {DEFAULT_FILLER} is missing")
    return [DEFAULT_FILLER.read_text()]


# ---------------------------------------------------------------- keys and tasks
def is_eval_key(key: str) -> bool:
    """One key in five belongs to evaluation, the rest to training documents."""
    return zlib.crc32(key.lower().encode()) % 5 == 0


def _key(rng: random.Random, split: str, taken: set[str]) -> str:
    while True:
        key = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(3))
        if is_eval_key(key) == (split == "eval") and key not in taken:
            taken.add(key)
            return key


def _values(rng: random.Random, n: int) -> list[str]:
    return [str(v) for v in rng.sample(range(1000, 10000), n)]


def _depths(rng: random.Random, n: int) -> list[float]:
    return sorted(rng.random() for _ in range(n))


def _needle(key: str, value: str) -> str:
    return f"The value of key {key} is {value}."


def _ask_key(key: str) -> str:
    # The answer restates the needle's words up to the value: the value then follows the same
    # tokens as in the haystack, which a small model can learn to copy (an induction pattern).
    return f"What is the value of key {key}? Answer: The value of key {key} is"


def _task(task: str, rng: random.Random, split: str) -> tuple[list[str], list[float], str, str, list[str]]:
    """-> (needles in depth order, depths, question, answer, keys)."""
    taken: set[str] = set()
    if task == "single_key":
        key, (value,) = _key(rng, split, taken), _values(rng, 1)
        return [_needle(key, value)], _depths(rng, 1), _ask_key(key), value, [key]
    if task == "multi_key":
        keys = [_key(rng, split, taken) for _ in range(_MULTI_KEY_DISTRACTORS + 1)]
        values = _values(rng, len(keys))
        q = rng.randrange(len(keys))
        return ([_needle(k, v) for k, v in zip(keys, values)], _depths(rng, len(keys)),
                _ask_key(keys[q]), values[q], keys)
    if task == "multi_value":
        key, values = _key(rng, split, taken), _values(rng, _MULTI_VALUES)
        question = f"What are all the values of key {key}? Answer: The values of key {key} are"
        return [_needle(key, v) for v in values], _depths(rng, len(values)), question, ", ".join(values), [key]
    if task == "variable_tracking":
        chains = [[_key(rng, split, taken).upper() for _ in range(_CHAIN_HOPS)] for _ in range(2)]
        values = _values(rng, 2)
        lines = []
        for names, value in zip(chains, values):
            lines.append([f"VAR {names[0]} = {value}."] +
                         [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])])
        # Interleave the two chains at random while keeping each chain's order.
        needles, queues = [], [list(lines[0]), list(lines[1])]
        while queues[0] or queues[1]:
            c = rng.choice([i for i in (0, 1) if queues[i]])
            needles.append(queues[c].pop(0))
        asked = chains[0][-1]
        question = f"What is the value of VAR {asked}? Answer: VAR {asked} is"
        return needles, _depths(rng, len(needles)), question, values[0], chains[0] + chains[1]
    raise ValueError(f"unknown task {task!r}; choose from {TASKS}")


def check_lengths_and_tasks(lengths: Sequence[int], tasks: Sequence[str], where: str = "") -> None:
    """`where` prefixes the field names in the error (e.g. "long_eval.")."""
    if not lengths or any(int(n) <= 0 for n in lengths):
        raise ValueError(f"{where}lengths must be positive token counts, got {list(lengths)}")
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"{where}tasks: unknown tasks {bad or list(tasks)}; choose from {TASKS}")


def _check_args(lengths: Sequence[int], n_per_task: int, tasks: Sequence[str]) -> None:
    check_lengths_and_tasks(lengths, tasks)
    if n_per_task < 1:
        raise ValueError(f"n_per_task must be >= 1, got {n_per_task}")


def _generate(tokenizer, lengths, n_per_task, seed, filler_texts, tasks, split) -> list[Example]:
    _check_args(lengths, n_per_task, tasks)
    hay = _Haystack(tokenizer, filler_texts)
    out = []
    for length in lengths:
        for task in tasks:
            for i in range(n_per_task):
                # One generator per example: an example does not depend on which others exist.
                rng = random.Random(f"{split}/{seed}/{task}/{length}/{i}")
                needles, depths, question, answer, keys = _task(task, rng, split)
                prompt, n = hay.fit(rng, int(length), needles, depths, question)
                out.append(Example(task, int(length), prompt, answer, n, tuple(keys)))
    return out


def generate_suite(tokenizer, lengths: Sequence[int], n_per_task: int, seed: int,
                   filler_texts: Sequence[str], tasks: Sequence[str] = TASKS) -> list[Example]:
    """The evaluation examples: n_per_task of every task at every length (deterministic)."""
    return _generate(tokenizer, lengths, n_per_task, seed, filler_texts, tasks, "eval")


def training_documents(tokenizer, lengths: Sequence[int], n_per_task: int, seed: int,
                       filler_texts: Sequence[str], tasks: Sequence[str] = TASKS) -> list[Document]:
    """Retrieval documents for the long-context training mix, in the evaluation's formats but
    with training keys only: prompt + " " + answer (the packer appends <|endoftext|>, which
    teaches the model to stop after the answer). Keep lengths below the packed seq_len."""
    return [Document(f"long-context/{ex.task}/{ex.length}/{seed}/{i}", f"{ex.prompt} {ex.answer}",
                     "long-context-synthetic", {"task": ex.task, "length": ex.length})
            for i, ex in enumerate(_generate(tokenizer, lengths, n_per_task, seed, filler_texts, tasks, "train"))]


def key_value_documents(n: int, seed: int, sizes: Sequence[int] = (4, 8, 12, 16)) -> list[Document]:
    """Dense recall documents: a list of needles, then every key asked again in shuffled order
    with its answer. Training keys only. The haystack formats give a model one copy event (the
    value) per document; here every answer line is one, which is what makes a small model form
    the attention pattern retrieval needs (match the key, copy what followed it) in CPU minutes
    rather than hours; the haystack documents then teach it to ignore the filler."""
    if n < 0 or not sizes or min(sizes) < 1:
        raise ValueError(f"need n >= 0 and positive sizes, got n={n}, sizes={list(sizes)}")
    out = []
    for i in range(n):
        rng = random.Random(f"kv/{seed}/{i}")
        taken: set[str] = set()
        keys = [_key(rng, "train", taken) for _ in range(rng.choice(list(sizes)))]
        values = _values(rng, len(keys))
        asked = rng.sample(range(len(keys)), len(keys))
        # Each answer line ends right after the value (then a newline), as the evaluation scores
        # it: exact_match takes the continuation's first line, so a model taught "V." here
        # would answer "4821." and be scored wrong.
        text = " ".join(_needle(k, v) for k, v in zip(keys, values)) + "\n" + "\n".join(
            f"{_ask_key(keys[j])} {values[j]}" for j in asked)
        out.append(Document(f"long-context/key_value/{seed}/{i}", text, "long-context-synthetic",
                            {"task": "key_value", "length": len(keys)}))
    return out


# ---------------------------------------------------------------- scoring
def exact_match(continuation: str, answer: str) -> bool:
    """The continuation's first line, stripped, must be exactly the answer."""
    return continuation.split("\n", 1)[0].strip() == answer


def evaluate(model: torch.nn.Module, tokenizer, examples: Sequence[Example],
             max_new_tokens: int | None = None) -> dict[str, dict[int, float]]:
    """Greedy continuation of every prompt, scored by exact match.

    max_new_tokens None = the answer's token count + 2 per example (room for a newline or
    end-of-text; more would only cost decode time, as the first line is all that is scored).
    Returns {task: {length: accuracy}} plus "overall": {length: accuracy over all tasks}.
    """
    from model.generate import generate

    if not examples:
        raise ValueError("no examples to evaluate")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = tokenizer.token_to_id(EOS)
    hits: dict[tuple[str, int], list[bool]] = {}
    for ex in examples:
        ids = torch.tensor([tokenizer.encode(ex.prompt).ids])
        budget = max_new_tokens or len(tokenizer.encode(" " + ex.answer).ids) + 2
        gen = generate(model, ids, budget, greedy=True, eos_token_id=eos)
        text = tokenizer.decode(gen.new_tokens[0].tolist(), skip_special_tokens=True)
        hits.setdefault((ex.task, ex.length), []).append(exact_match(text, ex.answer))
        hits.setdefault(("overall", ex.length), []).append(exact_match(text, ex.answer))
    result: dict[str, dict[int, float]] = {}
    for (task, length), h in sorted(hits.items(), key=lambda kv: (kv[0][0] == "overall", kv[0])):
        result.setdefault(task, {})[length] = sum(h) / len(h)
    return result


def evaluate_checkpoint(model_dir: str | Path, lengths: Sequence[int], *, n_per_task: int = 10,
                        seed: int = 0, filler_texts: Sequence[str] | None = None,
                        tasks: Sequence[str] = TASKS, dense_attention: bool | None = None,
                        max_new_tokens: int | None = None) -> dict:
    """`glmforge eval long-context --model DIR --lengths 256,512,1024`.

    model_dir: an HF-format checkpoint with tokenizer.json (model.hf.save_pretrained).
    filler_texts: haystack corpus; default the shipped samples/tinyshakespeare/input.txt.
    dense_attention: evaluate a DSA checkpoint with its indexers off (True) or on (False);
    None keeps the checkpoint's setting. Returns a JSON-ready dict.
    """
    from tokenizers import Tokenizer

    from model.hf import load_pretrained
    from model.model import GLMModel

    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").exists():
        raise ValueError(f"{model_dir} has no tokenizer.json")
    if filler_texts is None:
        filler_texts = default_filler_texts()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = load_pretrained(model_dir)
    if dense_attention is not None and dense_attention != model.config.dense_attention:
        state = model.state_dict()
        model = GLMModel(model.config.replace(dense_attention=dense_attention))
        model.load_state_dict(state)
    too_long = [n for n in lengths if n > model.config.max_position_embeddings]
    if too_long:
        raise ValueError(f"lengths {too_long} exceed max_position_embeddings={model.config.max_position_embeddings}")
    examples = generate_suite(tokenizer, lengths, n_per_task, seed, filler_texts, tasks)
    accuracy = evaluate(model.eval(), tokenizer, examples, max_new_tokens)
    return {"model": str(model_dir), "lengths": [int(n) for n in lengths], "n_per_task": n_per_task,
            "seed": seed, "dense_attention": model.config.dense_attention,
            "attention": list(model.config.layer_kinds), "accuracy": accuracy}


# ---------------------------------------------------------------- baselines
def baseline_configs(base: ModelConfig, lengths: Sequence[int], swa_fraction: float = 0.25
                     ) -> dict[str, ModelConfig]:
    """Like-for-like attention variants of one base config (same widths, depth and MoE):
      full  dense MLA in every layer (no indexers);
      dsa   lightning indexer + top-k in every layer (index_topk from base);
      swa   sliding-window layers interleaved with full ones (odd layers SWA), window =
            swa_fraction * the shortest evaluated length.
    The MTP block, if any, is a DSA block in all three (model.config.kind)."""
    if not lengths:
        raise ValueError("lengths is empty")
    if not 0 < swa_fraction < 1:
        raise ValueError(f"swa_fraction must be in (0, 1), got {swa_fraction}")
    shortest, L = min(lengths), base.num_layers
    if base.index_topk >= shortest:
        raise ValueError(f"index_topk={base.index_topk} >= shortest length {shortest}: DSA would select "
                         "every key and equal full attention; lower index_topk or raise the lengths")
    return {
        "full": base.replace(attention_pattern=("full",) * L, dense_attention=False),
        "dsa": base.replace(attention_pattern=("dsa",) * L, dense_attention=False),
        "swa": base.replace(attention_pattern=tuple("swa" if i % 2 else "full" for i in range(L)),
                            sliding_window=max(1, int(swa_fraction * shortest)), dense_attention=False),
    }
