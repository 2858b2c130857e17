"""The synthetic arithmetic domain: a task at a tiny model's edge of competence.

    prompt   " a1 a0 + b1 b0 ="          (digits space-separated: one token per digit)
    answer   " s0 s1 s2"                 the sum's digits, least significant first, zero-padded
                                          to digits+1 places ( 34 + 57 = 91  ->  " 1 9 0")

Reversed digits make the carry learnable left to right: each answer digit depends on the two
operand digits of its place and the carry out of the previous answer digit. Pairs are split
into train and held-out sets by a hash of (a, b), so evaluation pairs never appear in SFT
demonstrations or RL prompts. Demonstrations may carry one wrong digit (`corrupt`), which
keeps the SFT model's sampled accuracy in the 0.3-0.6 band where GRPO has reward variance.
"""
from __future__ import annotations

import random
import zlib

from domains.task import Task

DOMAIN = "arithmetic"
DIGITS = 2                  # operand digits: two-digit addition, at the tiny model's edge
HELDOUT_PER_MILLE = 100     # 10% of the pairs are held out (810 of 8,100)


def spaced(n: int, width: int) -> str:
    return "".join(f" {d}" for d in str(n).zfill(width))


def answer_digits(a: int, b: int, digits: int) -> str:
    return "".join(f" {d}" for d in reversed(str(a + b).zfill(digits + 1)))


def expression(a: int, b: int, digits: int = DIGITS) -> str:
    """The calculator expression in the prompt's notation ("3 4 + 5 7"): one token per digit, as in
    the prompt, so a call is a copy (byte-level BPE merges "34" into one token the prompt never has)."""
    return f"{spaced(a, digits)} +{spaced(b, digits)}".strip()


def task(a: int, b: int, digits: int = DIGITS) -> Task:
    return Task(DOMAIN, f"{spaced(a, digits)} +{spaced(b, digits)} =", answer_digits(a, b, digits),
                {"a": a, "b": b, "digits": digits})


def is_heldout(a: int, b: int, heldout_per_mille: int = HELDOUT_PER_MILLE) -> bool:
    return zlib.crc32(f"{a}+{b}".encode()) % 1000 < heldout_per_mille


def pairs(split: str, digits: int = DIGITS, heldout_per_mille: int = HELDOUT_PER_MILLE) -> list[tuple[int, int]]:
    """Every (a, b) with `digits`-digit operands (leading digit non-zero) in the split."""
    lo, hi = 10 ** (digits - 1), 10 ** digits
    want = split == "heldout"
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return [(a, b) for a in range(lo, hi) for b in range(lo, hi) if is_heldout(a, b, heldout_per_mille) == want]


LISTED_DIGITS = 3           # up to three-digit operands a split is listed (810K pairs); wider is sampled


def random_pair(split: str, digits: int, rng: random.Random,
                heldout_per_mille: int = HELDOUT_PER_MILLE) -> tuple[int, int]:
    """One pair of the split, uniform, by rejection: for operands too wide to list (four digits
    are 81M pairs)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    lo, hi, want = 10 ** (digits - 1), 10 ** digits, split == "heldout"
    while True:
        a, b = rng.randrange(lo, hi), rng.randrange(lo, hi)
        if is_heldout(a, b, heldout_per_mille) == want:
            return a, b


def tasks(n: int, split: str, seed: int, digits: int = DIGITS, heldout_per_mille: int = HELDOUT_PER_MILLE) -> list[Task]:
    """n tasks of a split, drawn with replacement in a seeded order (held-out: without, capped).
    Operands wider than LISTED_DIGITS are drawn without listing the split (random_pair)."""
    rng = random.Random(seed)
    if digits > LISTED_DIGITS:
        if split == "train":
            return [task(*random_pair(split, digits, rng, heldout_per_mille), digits) for _ in range(n)]
        drawn: dict[tuple[int, int], None] = {}
        while len(drawn) < n:
            drawn[random_pair(split, digits, rng, heldout_per_mille)] = None
        return [task(a, b, digits) for a, b in drawn]
    pool = pairs(split, digits, heldout_per_mille)
    if split == "heldout":
        rng.shuffle(pool)
        return [task(a, b, digits) for a, b in pool[:n]]
    return [task(*rng.choice(pool), digits) for _ in range(n)]


def corrupted(answer: str, rng: random.Random) -> str:
    """The answer with one digit replaced by a different digit."""
    ds = answer.split()
    i = rng.randrange(len(ds))
    ds[i] = str((int(ds[i]) + rng.randrange(1, 10)) % 10)
    return "".join(f" {d}" for d in ds)
