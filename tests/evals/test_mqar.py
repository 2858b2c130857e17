"""evals/mqar.py: MQAR documents (layout, labels, reserved id ranges) and their scorer, on
hand-checked values."""

from types import SimpleNamespace

import pytest
import torch

from evals.mqar import (IGNORE, MQARSpec, copy_batch, mqar_accuracy, mqar_batch, mqar_document, mqar_samples,
                        score_logits, summarize)

SPEC = MQARSpec(seq_len=20, n_pairs=3, key_ids=(10, 20), value_ids=(20, 30), filler_ids=(1, 5))


def test_pairs_first_document_is_what_it_claims():
    d = mqar_document(SPEC, 0)
    assert d == mqar_document(SPEC, 0)                       # deterministic
    ids, labels = d.input_ids, d.labels
    assert len(ids) == len(labels) == 20
    pairs = {ids[2 * i]: ids[2 * i + 1] for i in range(3)}   # Zoology: pairs at positions 0..5
    assert len(pairs) == 3 and all(10 <= k < 20 and 20 <= v < 30 for k, v in pairs.items())
    assert all(1 <= t < 5 for t in ids[6:] if not 10 <= t < 30)  # everything else is filler
    targets = [t for t, lab in enumerate(labels) if lab != IGNORE]
    assert targets == d.query_pos and len(targets) == 3
    for q, k in zip(d.query_pos, d.key_pos):
        assert ids[q] == ids[k] and labels[q] == pairs[ids[q]] == ids[q + 1] == ids[k + 1]
    assert sorted(ids[q] for q in d.query_pos) == sorted(pairs)   # every key asked exactly once
    assert d.distances == [q - k for q, k in zip(d.query_pos, d.key_pos)]
    assert mqar_document(SPEC, 1) != d


def test_spread_layout_and_fixed_filler():
    spec = MQARSpec(seq_len=40, n_pairs=4, key_ids=(10, 20), value_ids=(20, 30), filler_id=0, layout="spread",
                    pair_fraction=0.5)
    for seed in range(20):
        d = mqar_document(spec, seed)
        assert all(k + 1 < 20 for k in d.key_pos)              # pairs inside the first half
        assert min(d.query_pos) > max(d.key_pos) + 1            # queries after the last pair
        assert d.input_ids.count(0) == 40 - 16                  # 4 pairs + 4 queries, 2 tokens each


def test_batch_and_samples():
    b = mqar_batch(SPEC, 3, "s")
    assert b["input_ids"].shape == b["labels"].shape == (3, 20)
    assert b["input_ids"][1].tolist() == mqar_document(SPEC, "s/1").input_ids
    (ids, mask), = mqar_samples(SPEC, 1, "s")
    d = mqar_document(SPEC, "s/0")
    assert ids == d.input_ids and [t for t, m in enumerate(mask) if m] == [q + 1 for q in d.query_pos]


def test_copy_batch_repeats_at_a_random_offset():
    b = copy_batch(64, 8, (100, 200), 0)
    offsets = set()
    for ids, lab in zip(b["input_ids"].tolist(), b["labels"].tolist()):
        t = [i for i, x in enumerate(lab) if x != IGNORE]
        n = len(t) + 1
        s = t[0]
        assert ids[s: s + n] == ids[:n] and all(lab[i] == ids[i + 1] for i in t)
        offsets.add(s)
    assert len(offsets) > 1


def test_bad_specs():
    with pytest.raises(ValueError, match="overlap"):
        MQARSpec(seq_len=20, n_pairs=3, key_ids=(10, 20), value_ids=(15, 30))
    with pytest.raises(ValueError, match="distinct keys"):
        MQARSpec(seq_len=40, n_pairs=5, key_ids=(10, 14), value_ids=(20, 30))
    with pytest.raises(ValueError, match="too short"):
        MQARSpec(seq_len=11, n_pairs=3, key_ids=(10, 20), value_ids=(20, 30))
    with pytest.raises(ValueError, match="filler_id"):
        MQARSpec(seq_len=20, n_pairs=3, key_ids=(10, 20), value_ids=(20, 30), filler_id=12)


def test_score_logits_hand_computed():
    logits = torch.zeros(1, 4, 5)
    logits[0, 0, 2] = logits[0, 1, 3] = logits[0, 2, 1] = 1.0
    labels = torch.tensor([[2, IGNORE, 4, IGNORE]])
    assert score_logits(logits, labels) == (1, 2)


def test_summarize_splits_by_window():
    hits = [(True, 3), (False, 10), (True, 10), (False, 50)]
    s = summarize(hits, windows=[10])
    assert s["acc"] == 0.5 and s["n"] == 4
    assert s["acc_within_10"] == 1.0 and s["n_within_10"] == 1
    assert s["acc_beyond_10"] == pytest.approx(1 / 3) and s["n_beyond_10"] == 3


class Oracle(torch.nn.Module):
    """Predicts the token after the previous occurrence of the current token (a perfect
    induction head), or token 0; `wrong_beyond` makes it fail when that occurrence is that far back."""

    def __init__(self, V, wrong_beyond=None):
        super().__init__()
        self.V, self.wrong_beyond = V, wrong_beyond

    def forward(self, ids):
        B, T = ids.shape
        logits = torch.zeros(B, T, self.V)
        for b in range(B):
            seen = {}
            for t in range(T):
                tok = int(ids[b, t])
                if tok in seen and (self.wrong_beyond is None or t - seen[tok] < self.wrong_beyond):
                    logits[b, t, int(ids[b, seen[tok] + 1])] = 1.0
                else:
                    logits[b, t, 0] = 1.0
                seen.setdefault(tok, t)
        return SimpleNamespace(logits=logits)


def test_accuracy_of_an_oracle_and_a_windowed_oracle():
    spec = MQARSpec(seq_len=64, n_pairs=4, key_ids=(10, 20), value_ids=(20, 30), filler_ids=(1, 5))
    assert mqar_accuracy(Oracle(30), spec, 10, 0)["acc"] == 1.0
    s = mqar_accuracy(Oracle(30, wrong_beyond=16), spec, 10, 0, windows=[16])
    assert s["acc_within_16"] == 1.0 and s["acc_beyond_16"] == 0.0 and s["n"] == 40
    assert s["acc"] == pytest.approx(s["n_within_16"] / 40)


def test_text_filler_stays_contiguous():
    text = list(range(100, 140))
    d = mqar_document(SPEC, 0, filler=text)
    planted = set(range(0, 6)) | {q for q in d.query_pos} | {q + 1 for q in d.query_pos}
    assert [t for i, t in enumerate(d.input_ids) if i not in planted] == text[:20 - len(planted)]
    assert d.labels == mqar_document(SPEC, 0).labels and d.query_pos == mqar_document(SPEC, 0).query_pos
    with pytest.raises(ValueError, match="reserve"):
        mqar_document(SPEC, 0, filler=[15] * 20)


def test_fact_batch_uses_one_table_for_every_document():
    from evals.mqar import fact_batch, fact_table

    table = fact_table(3, 4, (50, 60), 0)
    assert table.shape == (3, 4) and table.min() >= 50 and table.max() < 60
    b = fact_batch(14, 5, 10, 20, table, "x")                 # 4 facts + 2 padding tokens
    for ids, lab in zip(b["input_ids"].tolist(), b["labels"].tolist()):
        for f in range(4):
            a, k, v = ids[3 * f: 3 * f + 3]
            assert 10 <= a < 13 and 20 <= k < 24 and v == table[a - 10, k - 20]
            assert lab[3 * f + 1] == v and lab[3 * f] == lab[3 * f + 2] == IGNORE
        assert lab[12:] == [IGNORE, IGNORE]
