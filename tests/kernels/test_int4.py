import torch
import pytest

from kernels.int4 import (dequantize_int4, fake_quantize_int4, int4_matmul, int4_matmul_reference,
                          pack_int4, quantize_int4, unpack_int4)
from tests.kernels._interpret import require_interpreter, run_interpreted


def _weight(N=12, Kin=64, seed=0, dtype=torch.float32):
    return torch.randn(N, Kin, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_pack_convention_is_pinned():
    q = torch.tensor([[-8, 7, 0, -1]], dtype=torch.int8)
    # (q_odd + 8) << 4 | (q_even + 8): (-8, 7) -> 0xF0, (0, -1) -> 0x78
    assert pack_int4(q).tolist() == [[0xF0, 0x78]]


def test_pack_unpack_round_trip_all_pairs():
    vals = torch.arange(-8, 8, dtype=torch.int8)
    q = torch.stack(torch.meshgrid(vals, vals, indexing="ij"), -1).reshape(2, -1)  # all 256 pairs
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 128)
    assert torch.equal(unpack_int4(packed), q)
    assert len(set(packed.flatten().tolist())) == 256        # a bijection onto bytes


def test_quantize_range_and_error_bound():
    w = _weight()
    q, scales = quantize_int4(w, group_size=16)
    assert q.dtype == torch.int8 and q.shape == w.shape and scales.shape == (12, 4)
    assert scales.dtype == w.dtype
    assert q.min() >= -8 and q.max() <= 7
    s_col = scales.repeat_interleave(16, dim=1)
    err = (dequantize_int4(pack_int4(q), scales, 16) - w).abs()
    assert torch.all(err <= 0.5 * s_col * (1 + 1e-6))        # half a step, clamp included
    # amax / 7.5 puts the group's extreme at +-7.5 (up to rounding of w / s): a positive one
    # clamps to 7, a negative one rounds to -8 (or -7 when w / s lands just inside -7.5)
    g = w.view(12, 4, 16)
    at = g.abs().argmax(-1, keepdim=True)
    extreme, q_ext = g.gather(-1, at), q.view(12, 4, 16).gather(-1, at)
    assert torch.all(q_ext[extreme > 0] == 7)
    assert torch.all((q_ext[extreme < 0] == -8) | (q_ext[extreme < 0] == -7))
    assert (q_ext == -8).any()


def test_fake_quantize_matches_dequantize_and_ste_gradient():
    w = _weight(seed=1).requires_grad_()
    upstream = torch.randn_like(w)
    out = fake_quantize_int4(w, 32)
    q, scales = quantize_int4(w, 32)
    torch.testing.assert_close(out, dequantize_int4(pack_int4(q), scales, 32))
    (grad,) = torch.autograd.grad(out, w, upstream)
    # identity through round; zero where round(w/s) left [-8, 7] (only the +7.5 group maxima)
    in_range = torch.round(w / scales.repeat_interleave(32, 1)) <= 7
    assert torch.equal(grad, upstream * in_range)
    assert 0 < (~in_range).sum() <= scales.numel()


@pytest.mark.parametrize("group_size", [32, 16])
def test_int4_matmul_matches_dequantise_then_matmul(group_size):
    w = _weight(N=10, Kin=64, seed=2)
    q, scales = quantize_int4(w, group_size)
    packed = pack_int4(q)
    x = torch.randn(2, 3, 64)
    out = int4_matmul(x, packed, scales, group_size)
    assert out.shape == (2, 3, 10)
    torch.testing.assert_close(out, x @ dequantize_int4(packed, scales, group_size).T)


def test_bad_group_size_and_shapes():
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4(_weight(Kin=48), group_size=32)
    with pytest.raises(ValueError, match="group_size"):
        fake_quantize_int4(_weight(Kin=48), group_size=32)
    q, scales = quantize_int4(_weight(), 32)
    with pytest.raises(ValueError, match="x's last dim"):
        int4_matmul(torch.randn(2, 32), pack_int4(q), scales, 32)
    with pytest.raises(ValueError, match="q must lie"):
        pack_int4(torch.tensor([8, 0], dtype=torch.int8))


def _triton_check():
    require_interpreter()
    from kernels.int4 import int4_matmul_triton
    for N, Kin, gs, M in [(10, 64, 32, 5), (20, 96, 16, 33), (7, 48, 6, 3)]:  # ragged blocks
        w = _weight(N=N, Kin=Kin, seed=N)
        q, scales = quantize_int4(w, gs)
        packed = pack_int4(q)
        x = torch.randn(M, Kin)
        out = int4_matmul_triton(x, packed, scales, gs, block_m=16, block_n=16, block_kh=16)
        torch.testing.assert_close(out, int4_matmul_reference(x, packed, scales, gs),
                                   rtol=1e-5, atol=1e-5)


def test_triton_matches_reference_under_interpreter():
    run_interpreted(__name__, "_triton_check")
