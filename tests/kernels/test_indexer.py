import torch
import pytest

from kernels.indexer import indexer_scores, indexer_scores_reference, indexer_topk
from kernels.topk import topk_reference
from tests.kernels._interpret import require_interpreter, run_interpreted


def _inputs(B=2, T=5, S=11, H=3, D=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g, dtype=dtype)
    k = torch.randn(B, S, D, generator=g, dtype=dtype)
    w = torch.randn(B, T, H, generator=g, dtype=dtype)
    return q, k, w


def _naive(q, k, w, offset):
    B, T, H, _ = q.shape
    S = k.shape[1]
    out = torch.full((B, T, S), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            for s in range(S):
                if s <= t + offset:
                    out[b, t, s] = sum(float(w[b, t, j]) * max(0.0, float(q[b, t, j] @ k[b, s]))
                                       for j in range(H))
    return out


@pytest.mark.parametrize("offset", [0, 4, 20])
def test_scores_match_naive_loop(offset):
    q, k, w = _inputs(seed=offset)
    got = indexer_scores(q, k, w, causal_offset=offset)
    want = _naive(q.double(), k.double(), w.double(), offset)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite].double(), want[finite], rtol=1e-5, atol=1e-5)


def test_low_precision_inputs_accumulate_in_fp32():
    q, k, w = _inputs(seed=3, dtype=torch.bfloat16)
    got = indexer_scores(q, k, w)
    want = indexer_scores_reference(q.float(), k.float(), w.float())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("offset", [0, 6])
def test_chunked_topk_matches_full_scores(chunk, offset):
    q, k, w = _inputs(T=9, S=16, seed=chunk)
    q[:, :, 0] = 0.0                                          # head 0 scores exactly 0: ties
    idx = indexer_topk(q, k, w, topk=4, causal_offset=offset, chunk=chunk)
    want = topk_reference(indexer_scores_reference(q, k, w, offset), 4)
    assert torch.equal(idx, want)
    assert (idx[:, 0, 1 + offset:] == -1).all()              # the first query sees offset+1 keys


def test_shape_errors_name_the_argument():
    q, k, w = _inputs()
    with pytest.raises(ValueError, match="k must"):
        indexer_scores(q, k[..., :4], w)
    with pytest.raises(ValueError, match="w must"):
        indexer_scores(q, k, w[:, :, :2])
    with pytest.raises(ValueError, match="causal_offset"):
        indexer_scores(q, k, w, causal_offset=-1)


def _triton_check():
    require_interpreter()
    from kernels.indexer import indexer_scores_triton
    for offset, (T, S) in [(0, (5, 11)), (3, (7, 20)), (30, (4, 9))]:
        q, k, w = _inputs(T=T, S=S, D=6, seed=offset)
        ref = indexer_scores_reference(q, k, w, offset)
        out = indexer_scores_triton(q, k, w, offset, block_t=4, block_s=8)
        assert torch.equal(out.isinf(), ref.isinf())
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_triton_matches_reference_under_interpreter():
    run_interpreted(__name__, "_triton_check")


def test_topk_int32_indices_equal_int64():
    q, k, w = _inputs(T=9, S=16, seed=5)
    a = indexer_topk(q, k, w, topk=6, causal_offset=2, chunk=4)
    b = indexer_topk(q, k, w, topk=6, causal_offset=2, chunk=4, index_dtype=torch.int32)
    assert a.dtype == torch.long and b.dtype == torch.int32 and torch.equal(a, b.long())
    with pytest.raises(ValueError, match="index_dtype"):
        indexer_topk(q, k, w, topk=6, index_dtype=torch.float32)


@pytest.mark.parametrize("block", [1, 2, 64])
def test_scores_blocking_does_not_change_results(block):
    q, k, w = _inputs(T=7, S=13, seed=6)
    torch.testing.assert_close(indexer_scores_reference(q, k, w, 3, block=block),
                               _naive(q.double(), k.double(), w.double(), 3).float(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B", [1, 2])
def test_reference_scores_are_differentiable(B):
    """model/indexer.py trains through indexer_scores_reference: gradients must flow."""
    q, k, w = (x.double().requires_grad_() for x in _inputs(B=B, T=6, S=9, seed=7))
    got = indexer_scores_reference(q, k, w, 2, block=4)
    logits = torch.einsum("bthd,bsd->bths", q, k).relu()
    want = (w[..., None] * logits).sum(2)
    future = torch.arange(9)[None, :] > torch.arange(6)[:, None] + 2
    want = want.masked_fill(future, float("-inf"))
    assert torch.equal(got.isinf(), want.isinf())
    g = torch.randn(B, 6, 9, dtype=torch.float64).masked_fill(future, 0.0)
    fin = ~future
    torch.testing.assert_close(got[:, fin], want[:, fin].float(), rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad((got.double().masked_fill(future, 0) * g).sum(), (q, k, w))
    wants = torch.autograd.grad((want.masked_fill(future, 0) * g).sum(), (q, k, w))
    for a, b in zip(grads, wants):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
