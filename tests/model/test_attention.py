"""MLA paths, DSA selection and the masks (documents, sliding window)."""

import pytest
import torch

from kernels.topk import deterministic_topk
from model.config import preset
from model.model import GLMModel


def test_absorbed_decode_equals_explicit(tiny_model):
    x = torch.randint(0, 8192, (2, 90))  # longer than index_topk: sparse selection in both paths
    with torch.no_grad():
        full = tiny_model(x).logits                                    # explicit, no cache
        cache = tiny_model.new_cache()
        pre = tiny_model(x[:, :70], cache=cache).logits                # explicit prefill
        steps = [tiny_model(x[:, t:t + 1], cache=cache).logits for t in range(70, 80)]  # absorbed
        chunk = tiny_model(x[:, 80:], cache=cache).logits              # absorbed, several queries
    got = torch.cat([pre] + steps + [chunk], 1)
    assert (got - full).abs().max().item() < 1e-4
    assert cache.length == 90 and cache.c[0].shape[-1] == tiny_model.config.kv_lora_rank


def test_sparse_with_k_at_least_length_equals_dense():
    torch.manual_seed(0)
    cfg = preset("tiny", index_topk=128)
    m = GLMModel(cfg).eval()
    x = torch.randint(0, 8192, (2, 100))
    with torch.no_grad():
        sparse = m(x, return_indexer=True)
        dense = m(x, dense_attention=True)
    assert (sparse.indexer[0].indices[:, -1] >= 0).sum() == 2 * 100  # the last row selects all keys
    assert (sparse.logits - dense.logits).abs().max().item() < 1e-5
    # ... while a genuinely sparse selection changes the output
    m_sparse = GLMModel(cfg.replace(index_topk=8)).eval()
    m_sparse.load_state_dict(m.state_dict())
    with torch.no_grad():
        assert (m_sparse(x).logits - dense.logits).abs().max().item() > 1e-3


def test_topk_is_deterministic_with_ties(tiny_model):
    # Zero indexer weights make every allowed key score exactly 0.0: all ties.
    with torch.no_grad():
        for layer in tiny_model.layers:
            layer.self_attn.indexer.weights_proj.weight.zero_()
    x = torch.randint(0, 8192, (1, 100))
    runs = []
    for _ in range(3):
        with torch.no_grad():
            runs.append(torch.stack([o.indices for o in tiny_model(x, return_indexer=True).indexer]))
    assert all(torch.equal(r, runs[0]) for r in runs)
    K = tiny_model.config.index_topk
    assert torch.equal(runs[0][0, 0, 99], torch.arange(K))  # ties -> lowest positions
    scores = torch.zeros(3, 10)
    assert torch.equal(deterministic_topk(scores, 4), torch.arange(4).expand(3, 4))


def test_packed_documents_equal_separate_sequences(tiny_model):
    a, b = torch.randint(0, 8192, (1, 30)), torch.randint(0, 8192, (1, 80))
    packed = torch.cat([a, b], 1)
    doc_ids = torch.cat([torch.zeros(1, 30), torch.ones(1, 80)], 1).long()
    with torch.no_grad():
        lp = tiny_model(packed, doc_ids=doc_ids).logits
        la, lb = tiny_model(a).logits, tiny_model(b).logits
    assert (lp[:, :30] - la).abs().max().item() < 1e-5
    assert (lp[:, 30:] - lb).abs().max().item() < 1e-5


def test_sliding_window_layers():
    torch.manual_seed(0)
    cfg = preset("tiny", attention_pattern=("swa",) * 4, sliding_window=16, mtp_depth=0)
    m = GLMModel(cfg).eval()
    x = torch.randint(0, 8192, (1, 40))
    y = x.clone()
    y[0, 0] = (x[0, 0] + 1) % 8192
    with torch.no_grad():
        lx, ly = m(x).logits, m(y).logits
    # 4 layers of window 16 reach back 4*15 = 60 > 40 tokens... but one layer reaches only 15:
    one = GLMModel(cfg.replace(num_layers=1, attention_pattern=("swa",), first_k_dense=1)).eval()
    with torch.no_grad():
        ox, oy = one(x).logits, one(y).logits
    assert (ox[0, 16:] - oy[0, 16:]).abs().max().item() == 0.0   # token 0 is out of every window
    assert (ox[0, 15] - oy[0, 15]).abs().max().item() > 0.0     # ... but inside position 15's
    assert (lx - ly).abs().max().item() > 0.0


def test_attention_probs_and_indexer_outputs_for_dsa_training(tiny_model):
    x = torch.randint(0, 8192, (2, 100))
    out = tiny_model(x, return_indexer=True, return_attn_probs=True)
    H = tiny_model.config.num_heads
    for io, p in zip(out.indexer, out.attn_probs):
        assert p.shape == (2, 100, 100) and not p.requires_grad
        assert torch.allclose(p.sum(-1), torch.full((2, 100), float(H)), atol=1e-4)
        # sparse mode: probability mass only on the selected keys
        sel = torch.zeros(2, 100, 101, dtype=torch.bool).scatter_(-1, io.indices.masked_fill(io.indices < 0, 100), True)
        assert p.masked_fill(sel[..., :100], 0).abs().max() == 0
        assert io.scores.requires_grad and io.scores.shape == (2, 100, 100)
    # the indexer's loss reaches only indexer parameters
    loss = sum(torch.logsumexp(io.scores, -1).sum() for io in out.indexer)
    loss.backward()
    for n, prm in tiny_model.named_parameters():
        has = prm.grad is not None and prm.grad.abs().sum() > 0
        assert has == (".indexer." in n and not n.startswith("mtp.")), n


def _set_sparse_form(model, form):
    from model.mla import MLA
    for mod in model.modules():
        if isinstance(mod, MLA):
            mod.sparse_form = form


@pytest.mark.parametrize("T", [40, 64, 100])                  # L < top-k, L == top-k, L > top-k
@pytest.mark.parametrize("padded", [False, True])
def test_explicit_sparse_training_path_equals_absorbed(T, padded):
    """DSA training/prefill in the explicit per-head form == the absorbed (MQA) form: outputs and
    every gradient, fp32, with causal masking, left padding and packed documents."""
    torch.manual_seed(T)
    m = GLMModel(preset("tiny"))                              # index_topk 64, MTP on
    B = 2
    x = torch.randint(0, 8192, (B, T))
    y = torch.randint(0, 8192, (B, T))
    kw = {}
    if padded:
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, : T // 3] = 0                                 # left padding in row 1
        y[1, : T // 3] = -100
        doc = torch.zeros(B, T, dtype=torch.long)
        doc[0, T // 2:] = 1                                   # two packed documents in row 0
        kw = {"attention_mask": mask}
        runs_kw = [dict(kw), {"doc_ids": doc}]
    else:
        runs_kw = [kw]
    for kw in runs_kw:
        got = {}
        for form in ("absorbed", "explicit"):
            _set_sparse_form(m, form)
            m.zero_grad()
            out = m(x, labels=y, **kw)
            out.loss.backward()
            got[form] = (out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()
                                               if p.grad is not None})
        _set_sparse_form(m, "auto")
        (la, ga), (le, ge) = got["absorbed"], got["explicit"]
        torch.testing.assert_close(le, la, rtol=1e-5, atol=1e-5)
        assert ga.keys() == ge.keys() and len(ga) > 0
        for n in ga:
            torch.testing.assert_close(ge[n], ga[n], rtol=1e-5, atol=1e-5, msg=n)


def test_sparse_form_dispatch(tiny_model, monkeypatch):
    """auto -> absorbed for training/prefill on CPU; decode is absorbed whatever the setting."""
    import kernels.sparse_attention as ksa
    import model.mla as mla
    calls = []
    for name in ("sparse_attention", "sparse_attention_mqa"):
        fn = getattr(ksa, name)
        monkeypatch.setattr(mla, name, lambda *a, _n=name, _f=fn, **k: calls.append(_n) or _f(*a, **k))
    x = torch.randint(0, 8192, (1, 80))
    with torch.no_grad():
        tiny_model(x)
        assert set(calls) == {"sparse_attention_mqa"}
        calls.clear()
        _set_sparse_form(tiny_model, "explicit")
        cache = tiny_model.new_cache()
        tiny_model(x[:, :70], cache=cache)                    # prefill: explicit
        assert set(calls) == {"sparse_attention"}
        calls.clear()
        tiny_model(x[:, 70:71], cache=cache)                  # decode: absorbed
        assert set(calls) == {"sparse_attention_mqa"}
        _set_sparse_form(tiny_model, "bogus")
        with pytest.raises(ValueError, match="sparse_form"):
            tiny_model(x)


@pytest.mark.parametrize("chunk", [1, 7, 256])
def test_chunked_selection_equals_selection_from_full_scores(chunk, monkeypatch):
    """Indexer.select (chunks of queries, no [B,T,S] scores) == top-k of Indexer.scores, with
    padding, packed documents, ties (zeroed head) and a cache prefix."""
    from model.indexer import Indexer
    torch.manual_seed(chunk)
    m = GLMModel(preset("tiny")).eval()
    for layer in m.layers:                                    # exact-zero scores: many ties
        layer.self_attn.indexer.wq_b.weight.data[:32] = 0.0
    seen = []
    orig = Indexer.select
    monkeypatch.setattr(Indexer, "select", lambda self, *a, **k: seen.append(
        orig(self, *a, chunk=chunk)) or seen[-1])
    B, T = 2, 90
    x = torch.randint(0, 8192, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :20] = 0
    doc = torch.zeros(B, T, dtype=torch.long)
    doc[0, 50:] = 1
    for kw in ({"attention_mask": mask}, {"doc_ids": doc}):
        seen.clear()
        with torch.no_grad():
            lo = m(x, **kw).logits
            full = m(x, return_indexer=True, **kw)
        want = [o.indices for o in full.indexer]
        assert len(seen) == len(want) and all(torch.equal(s, w) for s, w in zip(seen, want))
        assert torch.equal(lo, full.logits)
    caches = [m.new_cache(), m.new_cache()]                   # after a prefill: past > 0
    with torch.no_grad():
        for c in caches:
            m(x[:, :60], cache=c)
        seen.clear()
        m(x[:, 60:75], cache=caches[0])
        full = m(x[:, 60:75], cache=caches[1], return_indexer=True)
    want = [o.indices for o in full.indexer]
    assert want[0].shape == (B, 15, m.config.index_topk)
    assert len(seen) == len(want) and all(torch.equal(s, w) for s, w in zip(seen, want))
