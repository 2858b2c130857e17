import torch
import pytest
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kernels.sparse_attention import (SparseAttention, dense_reference_attention,
                                      sparse_attention, sparse_attention_mqa)
from kernels.topk import topk_reference
from tests.kernels._interpret import require_interpreter, run_interpreted


def _causal_indices(B, T, S, K, seed, offset=None, empty_rows=0):
    """Random top-K causal selections (like the indexer's), -1 padded; first rows may be empty."""
    g = torch.Generator().manual_seed(seed)
    offset = S - T if offset is None else offset
    scores = torch.randn(B, T, S, generator=g)
    future = torch.arange(S)[None, :] > torch.arange(T)[:, None] + offset
    scores = scores.masked_fill(future, float("-inf"))
    scores[:, :empty_rows] = float("-inf")
    return topk_reference(scores, K)


def _qkv(B, T, S, H, D, DV, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()
    return mk(B, T, H, D), mk(B, S, H, D), mk(B, S, H, DV)


def _fwd_bwd(fn, q, k, v, dout):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("chunk", [1, 3, 128])
def test_forward_and_backward_match_dense_reference(chunk):
    B, T, S, H, D, DV, K = 2, 7, 12, 2, 5, 3, 4
    q, k, v = _qkv(B, T, S, H, D, DV, seed=chunk)
    idx = _causal_indices(B, T, S, K, seed=chunk, offset=1, empty_rows=1)
    dout = torch.randn(B, T, H, DV, dtype=torch.float64)
    got = _fwd_bwd(lambda *a: sparse_attention(*a, idx, 0.4, chunk=chunk), q, k, v, dout)
    want = _fwd_bwd(lambda *a: dense_reference_attention(*a, idx, 0.4), q, k, v, dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_gradcheck_tiny():
    q, k, v = _qkv(1, 4, 6, 2, 3, 2, seed=5)
    idx = _causal_indices(1, 4, 6, 3, seed=5, empty_rows=1)
    assert torch.autograd.gradcheck(lambda q, k, v: sparse_attention(q, k, v, idx, 0.7, chunk=2),
                                    (q, k, v))


def test_empty_rows_give_zero_output_and_zero_grad():
    q, k, v = _qkv(1, 3, 5, 2, 4, 4, seed=2)
    idx = torch.tensor([[[-1, -1], [0, -1], [-1, -1]]])
    out = sparse_attention(q, k, v, idx, 0.5)
    assert torch.all(out[:, 0] == 0) and torch.all(out[:, 2] == 0)
    dq, = torch.autograd.grad(out.sum(), q)
    assert torch.all(dq[:, 0] == 0) and torch.all(dq[:, 2] == 0)


def test_equals_causal_dense_attention_when_k_covers_all_keys():
    B, T, H, D = 2, 9, 3, 8
    q, k, v = _qkv(B, T, T, H, D, D, seed=3)
    idx = _causal_indices(B, T, T, K=T + 2, seed=3)           # K >= S: every causal key
    scale = D ** -0.5
    out = sparse_attention(q, k, v, idx, scale)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale)
    torch.testing.assert_close(out, sdpa.transpose(1, 2))


def test_mqa_form_matches_dense_with_shared_kv():
    B, T, S, H, D, DV, K = 1, 5, 8, 3, 6, 4, 3
    q, _, _ = _qkv(B, T, S, H, D, DV, seed=4)
    kv = torch.randn(B, S, D, dtype=torch.float64, requires_grad=True)
    idx = _causal_indices(B, T, S, K, seed=4)
    dout = torch.randn(B, T, H, DV, dtype=torch.float64)
    out = sparse_attention_mqa(q, kv, idx, 0.3, dv=DV)
    k_h, v_h = kv[:, :, None].expand(B, S, H, D), kv[:, :, None, :DV].expand(B, S, H, DV)
    want = dense_reference_attention(q, k_h, v_h, idx, 0.3)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(torch.autograd.grad(out, (q, kv), dout),
                               torch.autograd.grad(want, (q, kv), dout))


class _LargestTensor(TorchDispatchMode):
    """Records the largest numel among all tensors produced by any op (views included)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_sparse_path_never_builds_a_t_by_s_tensor():
    B, T, H, D, K = 1, 512, 1, 4, 8                            # T * S = 262144
    q, k, v = _qkv(B, T, T, H, D, D, seed=6, dtype=torch.float32)
    idx = _causal_indices(B, T, T, K, seed=6)
    with _LargestTensor() as sparse:
        out = sparse_attention(q, k, v, idx, 0.5, chunk=64)
        torch.autograd.grad(out.sum(), (q, k, v))
    with _LargestTensor() as dense:                           # the probe does see (T, S)
        dense_reference_attention(q, k, v, idx, 0.5)
    assert dense.largest >= T * T
    assert sparse.largest <= T * K                            # indices / chunk*K*H*D scratch


def test_bad_arguments():
    q, k, v = _qkv(1, 3, 5, 2, 4, 4, seed=0)
    idx = torch.zeros(1, 3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="indices"):
        sparse_attention(q, k, v, idx[0], 0.5)
    with pytest.raises(ValueError, match="v must"):
        sparse_attention(q, k, v[:, :, :1], idx, 0.5)
    with pytest.raises(ValueError, match="scale"):
        sparse_attention(q, k, v, idx, -1.0)


def _triton_check():
    require_interpreter()
    B, T, S, H, D, DV, K = 2, 6, 10, 2, 5, 3, 20               # K > block and > S: -1 padding
    for dtype in (torch.float32, torch.float64):
        q, k, v = _qkv(B, T, S, H, D, DV, seed=7, dtype=dtype)
        idx = _causal_indices(B, T, S, K, seed=7, offset=2, empty_rows=1)
        dout = torch.randn(B, T, H, DV, dtype=dtype)
        got = _fwd_bwd(lambda *a: SparseAttention.apply(*a, idx, 0.6, 4, True), q, k, v, dout)
        want = _fwd_bwd(lambda *a: SparseAttention.apply(*a, idx, 0.6, 4, False), q, k, v, dout)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # MQA layout: stride-0 head dim on the shared kv
    kv = torch.randn(B, S, D, dtype=torch.float64, requires_grad=True)
    k_h, v_h = kv[:, :, None].expand(B, S, H, D), kv[:, :, None, :DV].expand(B, S, H, DV)
    outs = [SparseAttention.apply(q, k_h, v_h, idx, 0.6, 4, tri) for tri in (True, False)]
    grads = [torch.autograd.grad(o, kv, dout)[0] for o in outs]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5)


def test_triton_forward_backward_match_reference_under_interpreter():
    run_interpreted(__name__, "_triton_check")


def _mqa_inputs(B, T, S, H, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g, dtype=dtype).requires_grad_()
    kv = torch.randn(B, S, D, generator=g, dtype=dtype).requires_grad_()
    return q, kv


def _mqa_dense(q, kv, idx, scale, dv):
    B, S, D = kv.shape
    H = q.shape[2]
    return dense_reference_attention(q, kv[:, :, None].expand(B, S, H, D),
                                     kv[:, :, None, :dv].expand(B, S, H, dv), idx, scale)


@pytest.mark.parametrize("chunk", [None, 1, 3, 128])
@pytest.mark.parametrize("index_dtype", [torch.long, torch.int32])
def test_mqa_forward_and_backward_match_dense_reference(chunk, index_dtype):
    B, T, S, H, D, DV, K = 2, 7, 12, 3, 6, 4, 5                 # batch > 1, empty rows, -1 slots
    q, kv = _mqa_inputs(B, T, S, H, D, seed=11)
    idx = _causal_indices(B, T, S, K, seed=11, offset=1, empty_rows=1).to(index_dtype)
    dout = torch.randn(B, T, H, DV, dtype=torch.float64)
    out = sparse_attention_mqa(q, kv, idx, 0.4, dv=DV, chunk=chunk)
    want = _mqa_dense(q, kv, idx.long(), 0.4, DV)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(torch.autograd.grad(out, (q, kv), dout), torch.autograd.grad(want, (q, kv), dout)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert torch.all(out[:, 0] == 0)                          # empty row: zeros


def test_mqa_gradcheck_tiny():
    q, kv = _mqa_inputs(2, 4, 6, 2, 3, seed=12)
    idx = _causal_indices(2, 4, 6, 3, seed=12, empty_rows=1)
    assert torch.autograd.gradcheck(
        lambda q, kv: sparse_attention_mqa(q, kv, idx, 0.7, dv=2, chunk=3), (q, kv))


def test_mqa_low_precision_matches_float32():
    q, kv = _mqa_inputs(1, 9, 9, 4, 8, seed=13, dtype=torch.float32)
    idx = _causal_indices(1, 9, 9, 4, seed=13)
    want = sparse_attention_mqa(q, kv, idx, 0.3, dv=6)
    got = sparse_attention_mqa(q.detach().bfloat16(), kv.detach().bfloat16(), idx, 0.3, dv=6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.detach(), rtol=3e-2, atol=3e-2)


def test_mqa_path_never_builds_a_t_by_s_tensor():
    B, T, H, D, K = 1, 512, 2, 4, 8
    q, kv = _mqa_inputs(B, T, T, H, D, seed=14, dtype=torch.float32)
    idx = _causal_indices(B, T, T, K, seed=14)
    with _LargestTensor() as sparse:
        out = sparse_attention_mqa(q, kv, idx, 0.5, dv=3, chunk=64)
        torch.autograd.grad(out.sum(), (q, kv))
    assert sparse.largest <= T * max(K, H * D)                # indices, q / dq, chunk scratch
