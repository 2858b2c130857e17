"""training/synthetic.py and packing.with_samples: synthetic token tasks mixed into packed text,
and the MQAR part of dsa-adapt's long-context table."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from data_processing.packing import PackedDataset, with_samples
from data_processing.tokenizer import TOKENIZER_FILE
from training import dsa, synthetic
from training.data import IGNORE, collate
from training.dsa import LongEvalConfig
from training.synthetic import RESERVED_IDS, SyntheticConfig, SyntheticDocs


def test_with_samples_keeps_the_text_and_appends_masked_samples(packed, tmp_path):
    src = PackedDataset(packed["pack"], "train")
    T = src.seq_len
    extra = [([7] * T, [0] * (T - 1) + [1]), ([8] * (T // 2), [1] * (T // 2))]
    meta = with_samples(packed["pack"], tmp_path / "mixed", {"train": extra})
    out = PackedDataset(tmp_path / "mixed", "train")
    assert meta["loss_mask"] and len(out) == len(src) + 2
    for i in range(len(src)):                        # the text: same tokens, same document starts
        a, b = src[i], out[i]
        assert np.array_equal(a["input_ids"], b["input_ids"]) and np.array_equal(a["doc_starts"], b["doc_starts"])
        assert b["loss_mask"].all()                  # every text token stays a target
    tail = [out[len(src)], out[len(src) + 1]]
    assert tail[0]["input_ids"].tolist() == [7] * T and tail[0]["loss_mask"].tolist() == extra[0][1]
    assert tail[1]["input_ids"][: T // 2].tolist() == [8] * (T // 2)
    assert tail[1]["loss_mask"][T // 2:].sum() == 0  # padding is never a target
    # a batch mixing text and a masked sample: text keeps its full LM labels
    batch = collate([out[0], tail[0]], out.meta["pad_id"])
    text_labels = collate([src[0]], src.meta["pad_id"])["labels"][0]
    assert torch.equal(batch["labels"][0], text_labels)
    assert (batch["labels"][1] != IGNORE).sum() == 1 and batch["labels"][1, T - 2] == 7
    assert len(PackedDataset(tmp_path / "mixed", "val")) == len(PackedDataset(packed["pack"], "val"))
    with pytest.raises(ValueError, match="more than seq_len"):
        with_samples(packed["pack"], tmp_path / "long", {"train": [([1] * (T + 1), [1] * (T + 1))]})
    with pytest.raises(ValueError, match=r"splits \['test'\]"):
        with_samples(packed["pack"], tmp_path / "bad", {"test": []})


def test_copy_samples_target_exactly_the_copyable_tokens():
    base, T = 600, 64
    for ids, mask in synthetic.copy_samples(base, T, 8, "s"):
        assert len(ids) == len(mask) == T and all(base <= t < base + RESERVED_IDS for t in ids)
        targets = [t for t in range(T) if mask[t]]
        assert targets == list(range(targets[0], targets[-1] + 1))      # one contiguous repeat
        n = len(targets) + 1                                            # the run's first token is not a target
        start = targets[0] - 1
        assert ids[start: start + n] == ids[:n]                         # the run, repeated
        assert T // 8 <= n <= T // 3


def test_mqar_layout_uses_reserved_ids_and_text_filler():
    spec = synthetic.mqar_spec(600, 128, 16)
    assert spec.key_ids == (600, 664) and spec.value_ids == (664, 728) and spec.filler_ids == (32, 600)
    cfg = SyntheticConfig(docs=[{"task": "copy", "length": 64, "count": 2}, {"task": "mqar", "length": 128, "count": 3}])
    samples = synthetic.samples(cfg, 600, seed=1)
    assert [len(ids) for ids, _ in samples] == [64, 64, 128, 128, 128]
    assert samples == synthetic.samples(cfg, 600, seed=1)
    assert samples != synthetic.samples(cfg, 600, seed=2)
    ids, mask = samples[-1]
    assert sum(mask) == 16 and all(664 <= ids[t] < 728 for t in range(128) if mask[t])   # targets: values
    with pytest.raises(ValueError, match="docs"):
        SyntheticConfig(docs=[])
    with pytest.raises(ValueError, match=r"synthetic.docs\[0\]: seq_len=40 is too short for 16 pairs"):
        SyntheticConfig(docs=[SyntheticDocs(task="mqar", length=40, count=1)])
    with pytest.raises(ValueError, match=rf"vocab_size >= tokenizer's 600 \+ {RESERVED_IDS}"):
        synthetic.check_vocab(700, 600, "context-1")


def test_mix_into_records_the_layout_and_is_reused(packed, tmp_path):
    T = PackedDataset(packed["pack"], "train").seq_len
    docs = [SyntheticDocs(task="copy", length=T // 4, count=8), SyntheticDocs(task="mqar", length=T, count=2)]
    cfg = SyntheticConfig(docs=docs, mqar_pairs=8)
    meta = synthetic.mix_into(packed["pack"], tmp_path / "m", cfg, 512, seed=0)
    assert meta["synthetic"] == {"base": 512, "reserved": RESERVED_IDS, "mqar_pairs": 8,
                                 "docs": [d.model_dump() for d in docs]}
    assert meta["splits"]["train"]["added_samples"] == 10
    text = len(PackedDataset(packed["pack"], "train"))
    assert len(PackedDataset(tmp_path / "m", "train")) == text + 2 + 2    # four copy docs per sequence
    with pytest.raises(ValueError, match=rf"lengths \[{2 * T}\] exceed the stage's seq_len {T}"):
        synthetic.mix_into(packed["pack"], tmp_path / "m2", SyntheticConfig(
            docs=[SyntheticDocs(task="copy", length=2 * T, count=1)]), 512, seed=0)
    (tmp_path / "m" / "train" / "00000" / "tokens.bin").write_bytes(b"")   # a retry must not repack
    assert synthetic.mix_into(packed["pack"], tmp_path / "m", cfg, 512, seed=0) == json.loads(
        (tmp_path / "m" / "meta.json").read_text())
    assert (tmp_path / "m" / "train" / "00000" / "tokens.bin").read_bytes() == b""


class RecallWithin(torch.nn.Module):
    """An MQAR oracle that only sees `window` tokens back: at a repeated token it predicts what
    followed the token's earlier occurrence, when that lies in the window; else token 0."""

    def __init__(self, vocab: int, window: int | None):
        super().__init__()
        self.window = window
        self.config = SimpleNamespace(max_position_embeddings=4096, vocab_size=vocab)

    def forward(self, ids):
        B, T = ids.shape
        logits = torch.zeros(B, T, self.config.vocab_size)
        for b in range(B):
            seen: dict[int, int] = {}
            row = ids[b].tolist()
            for t, tok in enumerate(row):
                p = seen.get(tok)
                if p is not None and (self.window is None or t - p < self.window):
                    logits[b, t, row[p + 1]] = 1.0
                seen.setdefault(tok, t)
        return SimpleNamespace(logits=logits)


def test_long_context_table_scores_mqar_and_beyond_the_window(packed, monkeypatch):
    tok = Tokenizer.from_file(str(packed["tokenize"] / TOKENIZER_FILE))
    vocab = tok.get_vocab_size() + RESERVED_IDS
    models = {"full": RecallWithin(vocab, None), "swa": RecallWithin(vocab, 32)}
    monkeypatch.setattr(dsa, "load_state", lambda path: models[Path(path).name])
    cfg = LongEvalConfig(lengths=(128, 256), tasks=(), mqar_docs=4, mqar_pairs=8)
    table, detail = dsa.long_context_table({n: Path(n) for n in models}, packed["tokenize"], cfg, 32)
    assert table["full"] == {128: 1.0, 256: 1.0}
    assert detail["full"]["mqar_beyond_window"] == {128: 1.0, 256: 1.0}
    assert detail["swa"]["mqar_beyond_window"] == {128: 0.0, 256: 0.0}
    assert 0 < table["swa"][128] < 1 and table["swa"][256] <= table["swa"][128]
    models["small"] = RecallWithin(vocab - 1, None)
    with pytest.raises(ValueError, match="reserved ids"):
        dsa.long_context_table({"small": Path("small")}, packed["tokenize"], cfg, 32)
    with pytest.raises(ValueError, match="tasks"):
        LongEvalConfig(tasks=())                      # nothing to score


def test_facts_come_from_one_table_and_are_scored_teacher_forced():
    first, second, table = synthetic.facts(600)
    assert (first, second) == (728, 792) and table.min() >= 856 and table.max() < 600 + RESERVED_IDS
    assert torch.equal(table, synthetic.facts(600)[2])                    # the same table everywhere
    for ids, mask in synthetic.facts_samples(600, 66, 4, "s"):
        for t in range(0, 66, 3):
            a, b, v = ids[t: t + 3]
            assert v == table[a - first, b - second] and mask[t: t + 3] == [0, 0, 1]

    class Lookup(torch.nn.Module):      # knows the table: right with probability ~1 (or never)
        def __init__(self, wrong: bool):
            super().__init__()
            self.wrong = wrong

        def forward(self, ids):
            logits = torch.zeros(*ids.shape, 600 + RESERVED_IDS)
            for b in range(ids.shape[0]):
                for t in range(1, ids.shape[1]):
                    a, k = int(ids[b, t - 1]) - first, int(ids[b, t]) - second
                    if 0 <= a < 64 and 0 <= k < 64:
                        logits[b, t, int(table[a, k]) - (1 if self.wrong else 0)] = 30.0
            return SimpleNamespace(logits=logits)

    right = synthetic.facts_scores(Lookup(False), 600, 3, "x")
    assert right["acc"] == 1.0 and right["ppl"] == pytest.approx(1.0, abs=1e-6) and right["n"] == 66
    wrong = synthetic.facts_scores(Lookup(True), 600, 3, "x")
    assert wrong["acc"] == 0.0 and wrong["ppl"] > 1e10
