"""Byte-level BPE round trips, packing with document boundaries, PackedDataset local and via Store."""
from __future__ import annotations

import random

import numpy as np
import pytest

from data_processing import packing, tokenizer
from data_processing.document import Document
from data_processing.packing import PackConfig, PackedDataset, fim_transform, pack
from data_processing.tokenizer import EOS, SPECIAL_TOKENS, TokenizeConfig, load_tokenizer
from runtime.stage import Workdir
from runtime.store import LocalStore

from .conftest import gsm8k_records, stdlib_docs, write_docs

ODD_TEXTS = [
    "héllo wörld — naïve café",
    "日本語のテキストと中文文本，还有한국어",
    "emoji 🤗🚀👩‍👩‍👧‍👦 and flags 🇫🇷",
    "control \x00\x01\x07\x1b[31m red \x7f\r\n\ttabs\u2028sep\ufeffbom",
    "   leading and trailing spaces   ",
    "<think>literal special tokens</think><|endoftext|> inside text",
    "",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    docs = stdlib_docs(60) + [Document(f"g{i}", r["question"] + "\n" + r["answer"], "gsm8k") for i, r in enumerate(gsm8k_records(300))]
    src = write_docs(root / "in", docs)
    wd = Workdir.at(root / "tokwd")
    m = tokenizer.run(TokenizeConfig(vocab_size=2048), {"decontaminate": src}, wd)
    return src, wd.out, m, docs


def test_tokenizer_round_trips_bytes_and_has_special_tokens(trained):
    _, out, m, docs = trained
    tok = load_tokenizer(out)
    assert m["vocab_size"] == 2048 and m["bytes_per_token"] > 2.0
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    rng = random.Random(0)
    random_unicode = "".join(chr(rng.choice([rng.randrange(0x20, 0x7F), rng.randrange(0xA0, 0xD7FF), rng.randrange(0x1F300, 0x1FAFF)])) for _ in range(2000))
    for t in ODD_TEXTS + [random_unicode] + [d.text for d in docs[:5]]:
        assert tok.decode(tok.encode(t).ids, skip_special_tokens=False) == t
    ids = tok.encode("<|user|>hi<|assistant|><think>x</think>").ids
    assert ids[0] == tok.token_to_id("<|user|>") and tok.token_to_id("<think>") in ids


def pack_run(trained, tmp_path, **kw):
    src, tok_out, _, _ = trained
    wd = Workdir.at(tmp_path / "pack")
    m = packing.run(PackConfig(**{"seq_len": 128, "val_fraction": 0.1, **kw}), {"decontaminate": src, "tokenize": tok_out}, wd)
    return wd.out, m


def test_pack_boundaries_and_reader(trained, tmp_path):
    out, m = pack_run(trained, tmp_path, sequences_per_shard=100)
    tok = load_tokenizer(out)
    eos = tok.token_to_id(EOS)
    ds = PackedDataset(out)
    assert len(ds) == m["train_sequences"] > 100 and len(ds.shards) >= 2  # several shards
    val = PackedDataset(out, split="val")
    assert len(val) == m["val_sequences"] >= 1
    for i in (0, 1, len(ds) // 2, len(ds) - 1):
        s = ds[i]
        assert s["input_ids"].dtype == np.int64 and s["input_ids"].shape == (128,)
        assert s["doc_starts"][0] == 0 and np.all(np.diff(s["doc_starts"]) > 0)
        for st in s["doc_starts"][1:]:  # every document after the first follows an EOS
            assert s["input_ids"][st - 1] == eos
        # and every EOS inside the window is followed by a document start (or the final padding)
        pad = tok.token_to_id("<|pad|>")
        eos_pos = np.flatnonzero((s["input_ids"][:-1] == eos) & (s["input_ids"][1:] != pad)) + 1
        assert set(eos_pos.tolist()) <= set(s["doc_starts"].tolist())
    # decoded stream of the first sequence starts a real document
    first = tok.decode(ds[0]["input_ids"][: ds[0]["doc_starts"][1] - 1 if len(ds[0]["doc_starts"]) > 1 else 128].tolist(), skip_special_tokens=False)
    assert len(first) > 0


def test_same_index_same_sample_after_reopen_and_through_store(trained, tmp_path):
    out, _ = pack_run(trained, tmp_path)
    a = PackedDataset(out)
    picks = [0, 7, len(a) - 1, 3]
    before = [a[i] for i in picks]
    b = PackedDataset(out)  # reopened
    store = LocalStore(tmp_path / "store")
    for p in sorted(out.rglob("*")):
        if p.is_file():
            store.put_file(f"runs/x/pack/{p.relative_to(out).as_posix()}", p)
    c = PackedDataset((store, "runs/x/pack"))
    for i, s in zip(picks, before):
        for ds in (b, c):
            assert np.array_equal(ds[i]["input_ids"], s["input_ids"])
            assert np.array_equal(ds[i]["doc_starts"], s["doc_starts"])
    with pytest.raises(IndexError):
        a[len(a)]


def test_packing_is_seeded_and_upsamples_by_weight(trained, tmp_path):
    src, tok_out, _, docs = trained
    tok = load_tokenizer(tok_out)
    heavy = [Document(d.id, d.text, d.source, {"quality": {"weight": 3.0 if i % 2 else 0.0}}) for i, d in enumerate(docs[60:120])]
    cfg = PackConfig(seq_len=64, val_fraction=0.0)
    meta = pack(heavy, tok, cfg, tmp_path / "p1")
    assert meta["splits"]["train"]["documents_after_upsampling"] == 3 * 30  # weight 3 -> 3 copies, 0 -> none
    meta2 = pack(heavy, tok, cfg, tmp_path / "p2")
    assert (tmp_path / "p1/train/00000/tokens.bin").read_bytes() == (tmp_path / "p2/train/00000/tokens.bin").read_bytes()
    pack(heavy, tok, cfg.model_copy(update={"seed": 1}), tmp_path / "p3")
    assert (tmp_path / "p1/train/00000/tokens.bin").read_bytes() != (tmp_path / "p3/train/00000/tokens.bin").read_bytes()
    assert meta2 == meta


def test_fim_and_repo_level(trained, tmp_path):
    rng = random.Random(0)
    t = "def f(x):\n    return x + 1\n"
    for _ in range(20):
        s = fim_transform(t, rng, 0.5)
        assert s.startswith("<|fim_prefix|>") and "<|fim_suffix|>" in s and "<|fim_middle|>" in s
        if s.startswith("<|fim_prefix|><|fim_suffix|>"):  # SPM: suffix, then prefix+middle
            suf, pm = s[len("<|fim_prefix|><|fim_suffix|>"):].split("<|fim_middle|>")
            assert pm + suf == t
        else:
            pre, rest = s[len("<|fim_prefix|>"):].split("<|fim_suffix|>")
            suf, mid = rest.split("<|fim_middle|>")
            assert pre + mid + suf == t
    docs = [Document("a.py", "x = 1\n", "code", {"repo": "o/r", "path": "a.py"}),
            Document("b.py", "y = 2\n", "code", {"repo": "o/r", "path": "b.py"}),
            Document("n", "plain text", "web")]
    merged = packing.repo_documents(docs)
    assert [d.text for d in merged] == ["plain text", "<|repo_name|>o/r\n<|file_sep|>a.py\nx = 1\n<|file_sep|>b.py\ny = 2\n"]
    out, m = pack_run(trained, tmp_path, fim_rate=1.0, spm_rate=0.5, code_sources=("stdlib",))
    tok = load_tokenizer(out)
    ds = PackedDataset(out)
    fim_id = tok.token_to_id("<|fim_prefix|>")
    assert any(fim_id in ds[i]["input_ids"] for i in range(min(len(ds), 50)))


def test_missing_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="meta.json"):
        PackedDataset(tmp_path)


def test_documents_flagged_whole_are_never_split(trained, tmp_path):
    """A retrieval document that does not fit in the rest of a sequence starts the next one
    (the rest is padding); unflagged, the same document is split across two sequences."""
    _, tok_out, _, _ = trained
    tok = load_tokenizer(tok_out)
    filler = "word " * 20                                       # 41 tokens with <|endoftext|>
    needle = "The value of key alpha is 4821. " * 6             # 80 tokens with <|endoftext|>
    cfg = PackConfig(seq_len=96, val_fraction=0.0, upsample=False, seed=0, repo_level=False, fim_rate=0.0)
    eos = tok.token_to_id(EOS)
    want = tok.encode(needle).ids + [eos]
    assert len(tok.encode(filler).ids) + 1 + len(want) > 96 >= len(want)

    def packed(flag: dict) -> tuple[list[list[int]], dict]:
        out = tmp_path / str(len(flag))
        docs = [Document("a-filler", filler, "text"), Document("b-needle", needle, "retrieval", flag)]
        meta = pack(docs, tok, cfg, out)
        ds = PackedDataset(out)
        return [ds[i]["input_ids"].tolist() for i in range(len(ds))], meta

    def whole(seqs):
        return any(s[i : i + len(want)] == want for s in seqs for i in range(len(s) - len(want) + 1))

    seqs, meta = packed({packing.WHOLE: True})
    assert seqs[0][:2] == tok.encode(filler).ids[:2]     # the seeded shuffle puts the filler first
    assert seqs[1][:len(want)] == want                    # the needle starts the next sequence
    assert meta["splits"]["train"]["pad_tokens"] == (96 - 41) + (96 - len(want))
    seqs, meta = packed({})
    assert len(seqs) == 2 and not whole(seqs)             # unflagged: it fills the first one's rest
