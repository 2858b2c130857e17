"""Symmetric int4 weight quantization (QAT and export), following torchao's int4 weight config.

Per group of `group_size` consecutive input columns of a weight W (out, in):

    scale = amax(|W_group|) / 7.5        (clamped below by the dtype's eps)
    q     = clamp(round(W / scale), -8, 7)              int4 range [-8, 7], zero point 0
    W_hat = q * scale

round() is round-half-to-even (torch.round), so the group's largest positive weight (exactly
+7.5) clamps to +7 and the most negative (-7.5) rounds to -8.

Packing convention (pinned by tests/kernels/test_int4.py): two values per byte along the last
dim, offset by +8 to [0, 15]; the even column goes in the low nibble, the odd column in the high:

    byte[..., i] = ((q[..., 2i+1] + 8) << 4) | (q[..., 2i] + 8)

(torchao writes (q_odd << 4) | q_even after the same +8 offset or after & 0xF.)

Fake quantization for QAT uses a straight-through estimator: the gradient of round() is the
identity and the clamp blocks the gradient of weights whose rounded value falls outside
[-8, 7] (torchao's mask). The scale is treated as a constant (no gradient through amax).

`int4_matmul(x, packed, scales, group_size)` = x @ dequantize(W).T; its Triton kernel unpacks
and scales the weight tile in registers, so the full-precision weight is never materialised.

Shapes: N = out features, Kin = in features, G = Kin / group_size groups, M = rows of x.
    w (N, Kin)   q (N, Kin) int8   packed (N, Kin/2) uint8   scales (N, G)   x (..., Kin)
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the torch path is used
    triton = None

QMIN, QMAX = -8, 7


def _check_group(in_features: int, group_size: int) -> None:
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even int >= 2, got {group_size!r}")
    if in_features % group_size:
        raise ValueError(f"group_size={group_size} must divide the input dim, "
                         f"got in_features={in_features}")


def int4_scales(w: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """w (N, Kin) -> scales (N, G) = amax / 7.5 per group, in w's dtype."""
    if w.dim() != 2:
        raise ValueError(f"w must be (out, in), got shape {tuple(w.shape)}")
    _check_group(w.shape[1], group_size)
    amax = w.detach().reshape(w.shape[0], -1, group_size).abs().amax(-1)  # (N, G)
    scales = amax / ((QMAX - QMIN) / 2)
    return scales.clamp(min=torch.finfo(w.dtype).eps)


def _per_column(scales: torch.Tensor, group_size: int) -> torch.Tensor:
    return scales.repeat_interleave(group_size, dim=-1)        # (N, G) -> (N, Kin)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, Kin) -> (q int8 (N, Kin) in [-8, 7], scales (N, G) in w's dtype)."""
    scales = int4_scales(w, group_size)
    q = torch.clamp(torch.round(w.detach() / _per_column(scales, group_size)), QMIN, QMAX)
    return q.to(torch.int8), scales


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q int8 (..., Kin) in [-8, 7] -> uint8 (..., Kin/2), even column in the low nibble."""
    if q.dtype != torch.int8:
        raise ValueError(f"q must be int8, got {q.dtype}")
    if q.shape[-1] % 2:
        raise ValueError(f"q's last dim must be even, got {q.shape[-1]}")
    if q.numel() and (q.min() < QMIN or q.max() > QMAX):
        raise ValueError(f"q must lie in [{QMIN}, {QMAX}], got [{q.min()}, {q.max()}]")
    u = (q.to(torch.int16) - QMIN).to(torch.uint8)             # [0, 15]
    return (u[..., 1::2] << 4) | u[..., 0::2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (..., Kin/2) -> int8 (..., Kin) in [-8, 7]; inverse of pack_int4."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    low = (packed & 0xF).to(torch.int8) + QMIN
    high = (packed >> 4).to(torch.int8) + QMIN
    return torch.stack([low, high], dim=-1).flatten(-2)       # interleave: even, odd, ...


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """packed (N, Kin/2), scales (N, G) -> W_hat (N, Kin) in scales' dtype."""
    q = unpack_int4(packed)
    _check_group(q.shape[-1], group_size)
    if tuple(scales.shape) != (q.shape[0], q.shape[-1] // group_size):
        raise ValueError(f"scales must be {(q.shape[0], q.shape[-1] // group_size)}, "
                         f"got {tuple(scales.shape)}")
    return q.to(scales.dtype) * _per_column(scales, group_size)


class _FakeQuantizeInt4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, scales_col):
        q = torch.round(w / scales_col)
        ctx.save_for_backward((q >= QMIN) & (q <= QMAX))
        return torch.clamp(q, QMIN, QMAX) * scales_col

    @staticmethod
    def backward(ctx, grad):
        (in_range,) = ctx.saved_tensors
        return grad * in_range, None                          # STE through round, clamp masks


def fake_quantize_int4(w: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """QAT forward: W_hat = clamp(round(W / s), -8, 7) * s with a straight-through gradient."""
    scales = int4_scales(w, group_size)                        # detached: no grad through amax
    return _FakeQuantizeInt4.apply(w, _per_column(scales, group_size))


# ------------------------------------------------------------------------------------------
# x @ dequant(W).T

def int4_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                          group_size: int = 32) -> torch.Tensor:
    """Dequantise the whole weight, then matmul (CPU path and test oracle)."""
    w = dequantize_int4(packed, scales, group_size).to(x.dtype)  # (N, Kin)
    return x @ w.T


if triton is not None:

    @triton.jit
    def _int4_matmul_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, KH, group_size,
                            sxm, sxk, swn, swk, ssn, ssg, som, son,
                            BM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr):
        # KH = Kin / 2 packed columns; packed column j holds input columns 2j (low) and 2j+1 (high)
        m = tl.program_id(0) * BM + tl.arange(0, BM)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), tl.float32)
        for j0 in range(0, KH, BKH):
            j = j0 + tl.arange(0, BKH)
            jm = j < KH
            byte = tl.load(w_ptr + n[:, None] * swn + j[None, :] * swk,
                           mask=(n[:, None] < N) & jm[None, :], other=0x88)  # (BN, BKH)
            byte = byte.to(tl.int32)
            s = tl.load(s_ptr + n[:, None] * ssn + ((2 * j[None, :]) // group_size) * ssg,
                        mask=(n[:, None] < N) & jm[None, :], other=0.0).to(tl.float32)
            w_even = ((byte & 0xF) - 8).to(tl.float32) * s      # (BN, BKH), in registers
            w_odd = ((byte >> 4) - 8).to(tl.float32) * s        # a group never splits a pair
            xm = (m[:, None] < M) & jm[None, :]
            x_even = tl.load(x_ptr + m[:, None] * sxm + (2 * j[None, :]) * sxk, mask=xm, other=0.0)
            x_odd = tl.load(x_ptr + m[:, None] * sxm + (2 * j[None, :] + 1) * sxk, mask=xm,
                            other=0.0)
            acc += tl.dot(x_even.to(tl.float32), tl.trans(w_even), input_precision="ieee")
            acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_odd), input_precision="ieee")
        tl.store(out_ptr + m[:, None] * som + n[None, :] * son, acc.to(out_ptr.dtype.element_ty),
                 mask=(m[:, None] < M) & (n[None, :] < N))


def int4_matmul_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                       group_size: int = 32, block_m: int = 32, block_n: int = 32,
                       block_kh: int = 32) -> torch.Tensor:
    """Triton path (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    N, KH = packed.shape
    x2 = x.reshape(-1, x.shape[-1])                            # (M, Kin)
    out = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x2.shape[0], block_m), triton.cdiv(N, block_n))
    if x2.shape[0] and N:
        _int4_matmul_kernel[grid](x2, packed, scales, out, x2.shape[0], N, KH, group_size,
                                  x2.stride(0), x2.stride(1), packed.stride(0), packed.stride(1),
                                  scales.stride(0), scales.stride(1), out.stride(0), out.stride(1),
                                  BM=block_m, BN=block_n, BKH=block_kh)
    return out.reshape(*x.shape[:-1], N)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                group_size: int = 32) -> torch.Tensor:
    """x (..., Kin), packed (N, Kin/2) uint8, scales (N, G) -> x @ dequantize(W).T  (..., N)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be uint8 (N, Kin/2), got {packed.dtype} {tuple(packed.shape)}")
    Kin = 2 * packed.shape[1]
    if x.shape[-1] != Kin:
        raise ValueError(f"x's last dim must be {Kin} (2 * packed.shape[1]), got {x.shape[-1]}")
    _check_group(Kin, group_size)
    if tuple(scales.shape) != (packed.shape[0], Kin // group_size):
        raise ValueError(f"scales must be {(packed.shape[0], Kin // group_size)}, "
                         f"got {tuple(scales.shape)}")
    if x.is_cuda and triton is not None:
        return int4_matmul_triton(x, packed, scales, group_size)
    return int4_matmul_reference(x, packed, scales, group_size)
