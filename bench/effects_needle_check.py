"""Sanity checks of the RULER-like needle tasks (evals/long_context.py) as the pipeline trains and
scores them (issue 16): is the task what it claims to be?

Checks, on a byte-level BPE trained like the pipeline's (8,192 ids, on the shipped samples):
  1. key ids: the key's token ids in the question equal its ids in the needle (BPE could merge a
     leading space or the following "?" / " is" differently);
  2. prompt/answer split: a training document (prompt + " " + answer) tokenizes to exactly the
     evaluation prompt's ids followed by the answer's ids, so what the model learns to emit after
     the prompt is what the scorer expects;
  3. answer format: what follows the value in each kind of training document, against what
     exact_match accepts (first line, stripped, equal to the value);
  4. packing: how many retrieval documents the packer (data_processing.packing.pack, as
     training/longdata.pack_long calls it) splits across two packed sequences, which leaves the
     question in a sequence without its needle (the answer then cannot be retrieved and the LM
     loss on it teaches guessing).
  5. question-token ambiguity: how often the question's last token occurs in the prompt.

    DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 .venv/bin/python bench/effects_needle_check.py [--smoke]

Measured (--lengths 128,256,512 as the tiny preset's DSA stages, seq_len 1024; 18 s): keys and
prompts tokenize consistently (960/960 keys, 4.0 tokens per key; 240/240 documents); the
key-value documents taught "V." where the scorer wants "V" (exact_match(" 4821.", "4821") is
False; fixed in evals/long_context.py); the packer split 31 % of the retrieval documents across
two sequences (about length / seq_len each); the question's last token (" is") occurs 4.5
times per prompt.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_processing.document import Document  # noqa: E402
from data_processing.packing import PackConfig, PackedDataset, pack  # noqa: E402
from data_processing.tokenizer import EOS, train_tokenizer  # noqa: E402
from evals import long_context as lc  # noqa: E402


def corpus() -> list[str]:
    texts = [(REPO / "samples/tinyshakespeare/input.txt").read_text()[:1_000_000]]
    stdlib = Path(random.__file__).parent
    texts += [p.read_text(errors="ignore") for p in sorted(stdlib.glob("*.py"))[:200]]
    return texts


def spans(text: str, word: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"\b" + re.escape(word) + r"\b", text)]


def ids_over(enc, start: int, end: int) -> tuple[int, ...]:
    """Ids of the tokens overlapping [start, end) (offsets are byte-level character offsets)."""
    return tuple(i for i, (a, b) in zip(enc.ids, enc.offsets) if a < end and b > start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="256,512,1024")
    ap.add_argument("--n", type=int, default=20, help="examples per task and length")
    ap.add_argument("--seq-len", type=int, default=1024, help="packed sequence length (tiny dsa stages: 1024)")
    ap.add_argument("--smoke", action="store_true", help="lengths 128,256 and 4 examples")
    args = ap.parse_args()
    lengths = [128, 256] if args.smoke else [int(x) for x in args.lengths.split(",")]
    n = 4 if args.smoke else args.n
    t0 = time.perf_counter()
    tok = train_tokenizer(corpus(), vocab_size=8192)
    filler = lc.default_filler_texts()
    suite = lc.generate_suite(tok, lengths, n, 0, filler)
    train = lc._generate(tok, lengths, n, 1, filler, lc.TASKS, "train")

    # 1. key ids in the question vs the needle
    mismatch, checked, key_tokens = 0, 0, []
    for ex in suite + train:
        enc = tok.encode(ex.prompt)
        for key in ex.keys:
            occ = spans(ex.prompt, key)
            if len(occ) < 2:
                continue
            seqs = {ids_over(enc, a, b) for a, b in occ}
            checked += 1
            mismatch += len(seqs) > 1
            key_tokens.append(len(next(iter(seqs))))
    print(f"1. key ids equal in needle and question: {checked - mismatch}/{checked} keys "
          f"(tokens per key: mean {sum(key_tokens) / max(1, len(key_tokens)):.2f}, max {max(key_tokens)})")

    # 2. training document = prompt ids + answer ids
    bad = 0
    for ex in train:
        p = tok.encode(ex.prompt).ids
        full = tok.encode(f"{ex.prompt} {ex.answer}").ids
        bad += full[: len(p)] != p or full[len(p):] != tok.encode(" " + ex.answer).ids
    print(f"2. training document = eval prompt ids + answer ids: {len(train) - bad}/{len(train)}")

    # 3. what follows the answer in each training format
    kv = lc.key_value_documents(20, 1)
    after = {m.group(1) for d in kv for m in re.finditer(r" is \d+(.?)", d.text.split("\n", 1)[1])}
    print(f"3. after the value: haystack documents -> <|endoftext|> (packer); key-value documents -> {sorted(after)}; "
          f"exact_match(' 4821.', '4821') = {lc.exact_match(' 4821.', '4821')}")

    # 4. packing splits
    docs = lc.training_documents(tok, lengths, n, 1, filler)
    rng = random.Random(0)
    text = filler[0]
    for i in range(len(docs) * 2):             # plain text documents of mixed length around them
        a = rng.randrange(0, len(text) - 20000)
        docs.append(Document(f"text/{i}", text[a: a + rng.randrange(500, 12000)], "text", {}))
    with tempfile.TemporaryDirectory() as d:
        pack(docs, tok, PackConfig(seq_len=args.seq_len, val_fraction=0.0, upsample=False, fim_rate=0.0, seed=0), Path(d))
        ds = PackedDataset(Path(d), "train")
        eos = tok.token_to_id(EOS)
        want = {tuple(tok.encode(f"{ex.prompt} {ex.answer}").ids) for ex in
                lc._generate(tok, lengths, n, 1, filler, lc.TASKS, "train")}
        whole = 0
        for i in range(len(ds)):
            item = ds[i]
            ids, starts = item["input_ids"].tolist(), item["doc_starts"].tolist() + [len(item["input_ids"])]
            for a, b in zip(starts, starts[1:]):
                seg = ids[a:b]
                if seg and seg[-1] == eos:
                    seg = seg[:-1]
                whole += tuple(seg) in want
    per_len = {L: f"{L / args.seq_len:.0%}" for L in lengths}
    print(f"4. retrieval documents packed whole into one sequence: {whole}/{len(want)} "
          f"(split across two sequences: {1 - whole / len(want):.0%}; expected ~length/seq_len = {per_len})")

    # 5. the question's last token in the prompt
    counts = []
    for ex in suite:
        ids = tok.encode(ex.prompt).ids
        counts.append(ids.count(ids[-1]))
    print(f"5. the prompt's last token occurs {sum(counts) / len(counts):.1f} times per prompt on average "
          f"(min {min(counts)}, max {max(counts)})")
    print(f"wall {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
