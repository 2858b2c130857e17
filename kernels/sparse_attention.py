"""Sparse attention over selected key positions (the attention half of DSA).

Each query t attends only to the keys listed in indices[b, t, :] (shared by all heads; -1 marks
an empty slot and is ignored):

    out[b,t,h] = sum_i softmax_i(scale * q[b,t,h] . k[b, idx_i, h]) * v[b, idx_i, h]

A row whose slots are all empty outputs zeros (and passes back zero gradients). Indices must be
unique within a row (deterministic_topk guarantees it); a repeated index is counted twice.

Memory: the torch reference walks the queries in chunks, gathering (chunk, K) keys at a time,
and the backward pass recomputes the probabilities from the saved log-sum-exp, so nothing of
size (T, S) is ever built; memory is O(T * K) for the indices plus O(chunk * K * H * D) of
scratch. The Triton kernels run one program per (query, head) with an online softmax; the
backward kernel scatters dK and dV with float32 atomics (summation order on GPU is therefore not
fixed run to run; dQ is deterministic).

MQA / absorbed form on CPU (`sparse_attention_mqa`, the form GLM-5 runs DSA in): one gathered
latent row serves every head, so the torch path gathers each query's K rows once and runs all
heads as batched matmuls (forward, and a hand-written backward recomputing from the saved
log-sum-exp, dkv accumulated with index_add_). On CPU it is the fastest form measured even
though it does ~2.1x the FLOPs per (query, key) pair of the per-head form at GLM-5's widths:
one 576-byte latent row gathered per selected key feeds all 16 heads as matmuls, where the
per-head form gathers 16 x (k, v) rows per key and runs (1 x D) products on them, memory-bound.
Measured at GLM-5 widths / 4, 2K tokens, k = 2048, one core: attention forward + backward
1.5 s MQA vs 23.8 s per-head (bench/attention.py, --form explicit); per steady-state query the
MQA path takes
~0.45 ms forward + ~0.9 ms backward, of which ~15% is the two gathers and ~6% the index_add_.
On CUDA it still runs the per-head Triton kernels through a stride-0 head dim (no dedicated MQA
Triton kernel yet).

`dense_reference_attention` builds the full masked (T, S) logits and is only for tests.

Shapes: B batch, T queries, S keys, H heads, K selected keys per query, D = Dqk, Dv.
    q (B, T, H, D)   k (B, S, H, D)   v (B, S, H, Dv)   indices (B, T, K) long   out (B, T, H, Dv)
MQA / absorbed form: kv (B, S, D) is one key per token shared by all heads, and the values are
its first Dv dims (FlashMLA's sparse prefill layout, d_qk = 576, d_v = 512 at full size).
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the torch path is used
    triton = None


def _check_args(q, k, v, indices, scale) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be (B, T, H, D), got shape {tuple(q.shape)}")
    B, T, H, D = q.shape
    if k.dim() != 4 or k.shape[0] != B or k.shape[2] != H or k.shape[3] != D:
        raise ValueError(f"k must be (B={B}, S, H={H}, D={D}), got shape {tuple(k.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"v must be (B, S, H) = {tuple(k.shape[:3])} + (Dv,), got {tuple(v.shape)}")
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (B, T):
        raise ValueError(f"indices must be (B={B}, T={T}, K), got shape {tuple(indices.shape)}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"indices must be an integer tensor, got {indices.dtype}")
    if not isinstance(scale, (int, float)) or scale <= 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)        # bf16/fp16 -> fp32, fp64 stays


# ------------------------------------------------------------------------------------------
# torch reference: chunked forward, recomputing backward
#
# Per chunk of C queries the selected keys are gathered head-major, (B, H, C, K', D), so the
# logits and outputs are batched (1 x D) @ (D x K') products. K' <= K drops trailing slot
# columns that are empty for the whole chunk (early causal rows select fewer than K keys).
# Rows are copied with index_select and the key / value gradients scattered with index_add_
# (was: advanced indexing, ~2x slower per row, and index_put_(accumulate=True); 62 s -> 47 s
# forward + backward at 2K tokens, 16 heads x 64, k = 2048, one core).

def _rows(idx: torch.Tensor, S: int, H: int) -> torch.Tensor:
    """idx (B, C, K) -> (B, H, C, K) row numbers into x.reshape(B * S * H, D); -1 reads key 0."""
    b = torch.arange(idx.shape[0], device=idx.device)[:, None, None, None]
    h = torch.arange(H, device=idx.device)[None, :, None, None]
    return (b * S + idx.clamp(min=0)[:, None]) * H + h


def _gather(x_rows: torch.Tensor, rows: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """x_rows (N, D)[rows] -> (*rows.shape, D) in cdt; index_select copies whole rows."""
    return x_rows.index_select(0, rows.flatten()).view(*rows.shape, x_rows.shape[-1]).to(cdt)


def _chunk_indices(indices: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """indices[:, t0:t1] without the slot columns that are -1 in every row of the chunk."""
    idx = indices[:, t0:t1]
    used = (idx >= 0).flatten(0, 1).any(0).nonzero()
    return idx[..., : int(used.max()) + 1 if used.numel() else 1]


def _probs(q_c, kg, valid, scale, lse=None):
    """q_c (B,H,C,1,D), kg (B,H,C,K,D) -> p (B,H,C,1,K), lse (B,H,C,1) over the valid slots."""
    logits = (q_c @ kg.mT) * scale                             # (B, H, C, 1, K)
    logits = logits.masked_fill(~valid[:, None, :, None, :], float("-inf"))
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)                   # -inf for an empty row
    p = torch.where(valid[:, None, :, None, :], torch.exp(logits - lse[..., None]), 0.0)
    return p, lse


def _auto_chunk(indices: torch.Tensor, H: int, D: int, chunk: int | None) -> int:
    # default: about 16M gathered elements per chunk (64 MB in fp32)
    return chunk or max(1, 2**24 // max(1, indices.shape[-1] * H * D))


def sparse_attention_forward_reference(q, k, v, indices, scale, chunk=None):
    """-> out (B,T,H,Dv) in q's dtype, lse (B,T,H) in the compute dtype."""
    B, T, H, D = q.shape
    S, DV = k.shape[1], v.shape[-1]
    cdt = _compute_dtype(q)
    chunk = _auto_chunk(indices, H, D + DV, chunk)
    k_rows, v_rows = k.reshape(B * S * H, D), v.reshape(B * S * H, DV)
    out = torch.empty(B, T, H, DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, H, dtype=cdt, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        idx = _chunk_indices(indices, t0, t1)                   # (B, C, K')
        rows = _rows(idx, S, H)                                 # (B, H, C, K')
        kg, vg = _gather(k_rows, rows, cdt), _gather(v_rows, rows, cdt)  # (B, H, C, K', D | Dv)
        q_c = q[:, t0:t1].transpose(1, 2)[..., None, :].to(cdt)  # (B, H, C, 1, D)
        p, lse_c = _probs(q_c, kg, idx >= 0, scale)
        out[:, t0:t1] = (p @ vg).squeeze(-2).transpose(1, 2).to(q.dtype)
        lse[:, t0:t1] = lse_c.squeeze(-1).transpose(1, 2)
    return out, lse


def sparse_attention_backward_reference(q, k, v, indices, scale, out, lse, dout, chunk=None):
    """-> dq, dk, dv in the compute dtype, recomputing the probabilities chunk by chunk."""
    B, T, H, D = q.shape
    S, DV = k.shape[1], v.shape[-1]
    cdt = _compute_dtype(q)
    chunk = _auto_chunk(indices, H, D + DV, chunk)
    k_rows, v_rows = k.reshape(B * S * H, D), v.reshape(B * S * H, DV)
    dq = torch.zeros(B, T, H, D, dtype=cdt, device=q.device)
    dk = torch.zeros(B * S * H, D, dtype=cdt, device=q.device)
    dv = torch.zeros(B * S * H, DV, dtype=cdt, device=q.device)
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1)               # (B, T, H)
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        idx = _chunk_indices(indices, t0, t1)                   # (B, C, K')
        rows = _rows(idx, S, H)                                 # (B, H, C, K')
        kg, vg = _gather(k_rows, rows, cdt), _gather(v_rows, rows, cdt)  # (B, H, C, K', D | Dv)
        q_c = q[:, t0:t1].transpose(1, 2)[..., None, :].to(cdt)  # (B, H, C, 1, D)
        do_c = dout[:, t0:t1].transpose(1, 2)[..., None, :].to(cdt)  # (B, H, C, 1, Dv)
        p, _ = _probs(q_c, kg, idx >= 0, scale, lse[:, t0:t1].transpose(1, 2)[..., None])
        dp = do_c @ vg.mT                                       # (B, H, C, 1, K')
        ds = p * (dp - delta[:, t0:t1].transpose(1, 2)[..., None, None])  # softmax backward
        dq[:, t0:t1] = (ds @ kg).squeeze(-2).transpose(1, 2) * scale
        # scatter the per-slot key/value gradients back to their rows (empty slots add 0);
        # index_add_ is serial on CPU (a fixed summation order) and far faster than index_put_
        rows = rows.flatten()
        dk.index_add_(0, rows, (ds.mT * q_c).reshape(-1, D).mul_(scale))
        dv.index_add_(0, rows, (p.mT * do_c).reshape(-1, DV))
    return dq, dk.view(B, S, H, D), dv.view(B, S, H, DV)


# ------------------------------------------------------------------------------------------
# Triton: one program per (query, batch*head), online softmax over blocks of selected keys

if triton is not None:

    @triton.jit
    def _sparse_fwd_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, out_ptr, lse_ptr, scale, H, K, D, DV,
                           sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, sib, sit,
                           sob, sot, soh, slb, slt,
                           BK: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
        t = tl.program_id(0)
        b = tl.program_id(1) // H
        h = tl.program_id(1) % H
        d = tl.arange(0, BD)
        dv = tl.arange(0, BDV)
        q = tl.load(q_ptr + b * sqb + t * sqt + h * sqh + d, mask=d < D, other=0.0).to(tl.float32)
        m = tl.full((), float("-inf"), tl.float32)
        l = tl.zeros((), tl.float32)
        acc = tl.zeros((BDV,), tl.float32)
        for k0 in range(0, K, BK):
            slot = k0 + tl.arange(0, BK)
            idx = tl.load(idx_ptr + b * sib + t * sit + slot, mask=slot < K, other=-1)
            valid = idx >= 0
            idx = tl.where(valid, idx, 0)
            kb = tl.load(k_ptr + b * skb + idx[:, None] * sks + h * skh + d[None, :],
                         mask=valid[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
            logits = tl.sum(kb * q[None, :], axis=1) * scale    # (BK,)
            logits = tl.where(valid, logits, float("-inf"))
            m_new = tl.maximum(m, tl.max(logits, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(logits - m_safe)                          # 0 for empty slots
            vb = tl.load(v_ptr + b * svb + idx[:, None] * svs + h * svh + dv[None, :],
                         mask=valid[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * vb, axis=0)
            l = l * alpha + tl.sum(p, axis=0)
            m = m_new
        has_any = l > 0
        out = tl.where(has_any, acc / tl.where(has_any, l, 1.0), 0.0)
        lse = tl.where(has_any, m + tl.log(tl.where(has_any, l, 1.0)), float("-inf"))
        tl.store(out_ptr + b * sob + t * sot + h * soh + dv, out, mask=dv < DV)
        tl.store(lse_ptr + b * slb + t * slt + h, lse)

    @triton.jit
    def _sparse_bwd_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, lse_ptr, delta_ptr, do_ptr,
                           dq_ptr, dk_ptr, dv_ptr, scale, H, K, D, DV,
                           sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, sib, sit,
                           slb, slt, sdb, sdt, sdh, sgqb, sgqt, sgqh, sgkb, sgks, sgkh,
                           sgvb, sgvs, sgvh,
                           BK: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
        t = tl.program_id(0)
        b = tl.program_id(1) // H
        h = tl.program_id(1) % H
        d = tl.arange(0, BD)
        dv = tl.arange(0, BDV)
        q = tl.load(q_ptr + b * sqb + t * sqt + h * sqh + d, mask=d < D, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + b * sdb + t * sdt + h * sdh + dv, mask=dv < DV,
                     other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + b * slb + t * slt + h)
        delta = tl.load(delta_ptr + b * slb + t * slt + h)
        dq = tl.zeros((BD,), tl.float32)
        for k0 in range(0, K, BK):
            slot = k0 + tl.arange(0, BK)
            idx = tl.load(idx_ptr + b * sib + t * sit + slot, mask=slot < K, other=-1)
            valid = idx >= 0
            idx = tl.where(valid, idx, 0)
            kmask = valid[:, None] & (d[None, :] < D)
            vmask = valid[:, None] & (dv[None, :] < DV)
            kb = tl.load(k_ptr + b * skb + idx[:, None] * sks + h * skh + d[None, :],
                         mask=kmask, other=0.0).to(tl.float32)
            vb = tl.load(v_ptr + b * svb + idx[:, None] * svs + h * svh + dv[None, :],
                         mask=vmask, other=0.0).to(tl.float32)
            logits = tl.sum(kb * q[None, :], axis=1) * scale
            p = tl.where(valid, tl.exp(logits - lse), 0.0)       # (BK,)
            dp = tl.sum(vb * do[None, :], axis=1)
            ds = p * (dp - delta)
            dq += tl.sum(ds[:, None] * kb, axis=0) * scale
            tl.atomic_add(dk_ptr + b * sgkb + idx[:, None] * sgks + h * sgkh + d[None, :],
                          ds[:, None] * q[None, :] * scale, mask=kmask)
            tl.atomic_add(dv_ptr + b * sgvb + idx[:, None] * sgvs + h * sgvh + dv[None, :],
                          p[:, None] * do[None, :], mask=vmask)
        tl.store(dq_ptr + b * sgqb + t * sgqt + h * sgqh + d, dq, mask=d < D)


def _blocks(q, v, K):
    return (min(64, max(16, triton.next_power_of_2(K))), max(16, triton.next_power_of_2(q.shape[-1])),
            max(16, triton.next_power_of_2(v.shape[-1])))


def sparse_attention_forward_triton(q, k, v, indices, scale):
    B, T, H, D = q.shape
    K, DV = indices.shape[-1], v.shape[-1]
    out = torch.empty(B, T, H, DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    if B * T * H == 0:
        return out, lse
    BK, BD, BDV = _blocks(q, v, K)
    _sparse_fwd_kernel[(T, B * H)](
        q, k, v, indices, out, lse, float(scale), H, K, D, DV,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), indices.stride(0), indices.stride(1),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        BK=BK, BD=BD, BDV=BDV)
    return out, lse


def sparse_attention_backward_triton(q, k, v, indices, scale, out, lse, dout):
    B, T, H, D = q.shape
    S, K, DV = k.shape[1], indices.shape[-1], v.shape[-1]
    dout = dout.contiguous()
    delta = (dout.float() * out.float()).sum(-1).contiguous()   # (B, T, H), same layout as lse
    dq = torch.zeros(B, T, H, D, dtype=torch.float32, device=q.device)
    dk = torch.zeros(B, S, H, D, dtype=torch.float32, device=q.device)
    dv = torch.zeros(B, S, H, DV, dtype=torch.float32, device=q.device)
    if B * T * H == 0:
        return dq, dk, dv
    BK, BD, BDV = _blocks(q, v, K)
    _sparse_bwd_kernel[(T, B * H)](
        q, k, v, indices, lse, delta, dout, dq, dk, dv, float(scale), H, K, D, DV,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), indices.stride(0), indices.stride(1),
        lse.stride(0), lse.stride(1), dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        BK=BK, BD=BD, BDV=BDV)
    return dq, dk, dv


# ------------------------------------------------------------------------------------------
# autograd + public API

class SparseAttention(torch.autograd.Function):
    """Saves only q, k, v, indices, out and lse; the backward pass recomputes the probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, indices, scale, chunk, use_triton):
        if use_triton:
            out, lse = sparse_attention_forward_triton(q, k, v, indices, scale)
        else:
            out, lse = sparse_attention_forward_reference(q, k, v, indices, scale, chunk)
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.scale, ctx.chunk, ctx.use_triton = scale, chunk, use_triton
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, indices, out, lse = ctx.saved_tensors
        if ctx.use_triton:
            dq, dk, dv = sparse_attention_backward_triton(q, k, v, indices, ctx.scale, out, lse, dout)
        else:
            dq, dk, dv = sparse_attention_backward_reference(
                q, k, v, indices, ctx.scale, out, lse, dout, ctx.chunk)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                     scale: float, chunk: int | None = None) -> torch.Tensor:
    """q (B,T,H,D), k (B,S,H,D), v (B,S,H,Dv), indices (B,T,K) -> out (B,T,H,Dv).

    Differentiable in q, k, v. `chunk` (queries per step) only affects the torch path; None
    picks about 16M gathered elements per step.
    """
    _check_args(q, k, v, indices, scale)
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    use_triton = q.is_cuda and triton is not None
    return SparseAttention.apply(q, k, v, indices, float(scale), chunk, use_triton)


# ------------------------------------------------------------------------------------------
# MQA / absorbed form, torch path: one gathered latent row serves every head
#
# Per chunk of C queries (batch folded in) the selected rows are gathered once, kg (N, K', D)
# with N = B * C, and every head reads them through batched matmuls whose M dimension is the
# head count, so each gathered byte is used 2H (forward) / 4H (backward) times:
#   forward   logits = (scale q) kg^T            (N, H, K')      out = p kg[..., :Dv]
#   forward   softmax with one exp pass: p = exp(logits - max), out = (p v) / sum p
#   backward  [logits | dp] = [scale q | dout 0] kg^T   (one bmm, M = 2H)
#             ds = p (dp - delta);  dq = scale ds kg;  dkg = [p | ds]^T [dout 0 | scale q]
# and dkg is scattered into dkv (B * S, D) with index_add_. Empty slots read row 0 under a -inf
# bias, so their p and ds are exactly 0 and they add nothing.

def _mqa_auto_chunk(H: int, K: int, D: int, chunk: int | None) -> int:
    # default: the gathered rows of a chunk (C * K * D) near 1M elements, so the chunk's
    # gather, logits and the bmm operands stay in L2/L3 while all heads reuse them
    return chunk or max(1, min(64, 2**20 // max(1, K * D)))


def _mqa_chunk(kv_rows, indices, t0, t1, S):
    """-> idx (B, C, K'), rows (B*C*K',) into kv_rows, bias (B*C, 1, K') or None."""
    idx = _chunk_indices(indices, t0, t1)                       # (B, C, K')
    B, C, K = idx.shape
    valid = idx >= 0
    rows = idx.clamp(min=0)
    if B > 1:
        rows = rows + (torch.arange(B, device=idx.device) * S)[:, None, None].to(rows.dtype)
    bias = None
    if not bool(valid.all()):
        bias = torch.zeros(B * C, 1, K, dtype=kv_rows.dtype, device=idx.device)
        bias.masked_fill_(~valid.reshape(B * C, 1, K), float("-inf"))
    return idx, rows.reshape(-1), bias


def sparse_attention_mqa_forward_reference(q, kv, indices, scale, dv, chunk=None):
    """q (B,T,H,D), kv (B,S,D) -> out (B,T,H,dv) in q's dtype, lse (B,T,H) in the compute dtype."""
    B, T, H, D = q.shape
    S = kv.shape[1]
    cdt = _compute_dtype(q)
    chunk = _mqa_auto_chunk(H, indices.shape[-1], D, chunk)
    kv_rows = kv.reshape(B * S, D).to(cdt).contiguous()
    out = torch.empty(B, T, H, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, H, dtype=cdt, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        idx, rows, bias = _mqa_chunk(kv_rows, indices, t0, t1, S)
        N, K = idx.shape[0] * idx.shape[1], idx.shape[2]
        kg = kv_rows.index_select(0, rows).view(N, K, D)         # (N, K', D)
        q_c = q[:, t0:t1].reshape(N, H, D).to(cdt) * scale      # (N, H, D)
        if bias is None:
            logits = torch.bmm(q_c, kg.mT)                      # (N, H, K')
        else:
            logits = torch.baddbmm(bias, q_c, kg.mT)
        # one exp pass: p = exp(logits - max), normalised after the value product; the max
        # slot contributes exp(0) = 1, so l >= 1 on every row with a valid slot, and an empty
        # row (max -inf) gets p = 0, l = 0 -> out 0, lse -inf
        m = logits.amax(-1, keepdim=True)                       # (N, H, 1)
        m = torch.where(torch.isinf(m), 0.0, m)
        p = logits.sub_(m).exp_()                               # 0 on empty slots
        l = p.sum(-1, keepdim=True)                             # (N, H, 1)
        o = torch.bmm(p, kg[..., :dv]).div_(l.clamp(min=1.0))   # (N, H, dv)
        out[:, t0:t1] = o.view(B, t1 - t0, H, dv).to(q.dtype)
        lse[:, t0:t1] = l.log_().add_(m).view(B, t1 - t0, H)
    return out, lse


def sparse_attention_mqa_backward_reference(q, kv, indices, scale, dv, out, lse, dout,
                                            chunk=None):
    """-> dq (B,T,H,D), dkv (B,S,D) in the compute dtype, recomputing p chunk by chunk."""
    B, T, H, D = q.shape
    S = kv.shape[1]
    cdt = _compute_dtype(q)
    chunk = _mqa_auto_chunk(H, indices.shape[-1], D, chunk)
    kv_rows = kv.reshape(B * S, D).to(cdt).contiguous()
    dq = torch.empty(B, T, H, D, dtype=cdt, device=q.device)
    dkv = torch.zeros(B * S, D, dtype=cdt, device=q.device)
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1)               # (B, T, H)
    lse_safe = torch.where(torch.isinf(lse), 0.0, lse)
    # [scale q | dout 0] and [dout 0 | scale q], allocated once; the zero columns stay zero
    n_max = B * min(chunk, T)
    a_buf = torch.zeros(n_max, 2 * H, D, dtype=cdt, device=q.device)
    b_buf = torch.zeros(n_max, 2 * H, D, dtype=cdt, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        idx, rows, bias = _mqa_chunk(kv_rows, indices, t0, t1, S)
        N, K = idx.shape[0] * idx.shape[1], idx.shape[2]
        kg = kv_rows.index_select(0, rows).view(N, K, D)         # (N, K', D)
        a, b = a_buf[:N], b_buf[:N]
        q_c = q[:, t0:t1].reshape(N, H, D)
        do_c = dout[:, t0:t1].reshape(N, H, dv)
        torch.mul(q_c, scale, out=a[:, :H])
        a[:, H:, :dv] = do_c
        b[:, H:] = a[:, :H]
        b[:, :H, :dv] = do_c
        x = torch.bmm(a, kg.mT)                                 # (N, 2H, K'): logits | dp
        logits, dp = x[:, :H], x[:, H:]
        if bias is not None:
            logits += bias
        logits.sub_(lse_safe[:, t0:t1].reshape(N, H, 1)).exp_()  # p, in place
        dp.sub_(delta[:, t0:t1].reshape(N, H, 1)).mul_(logits)  # ds, in place
        if B == 1:                                              # write in place
            torch.bmm(dp, kg, out=dq[0, t0:t1])
        else:
            dq[:, t0:t1] = torch.bmm(dp, kg).view(B, t1 - t0, H, D)
        # x is now [p | ds]: dkg = p^T dout + ds^T (scale q), one bmm against [dout 0 | scale q]
        dkv.index_add_(0, rows, torch.bmm(x.mT, b).view(N * K, D))
    return dq.mul_(scale), dkv.view(B, S, D)


class SparseAttentionMQA(torch.autograd.Function):
    """Torch-path MQA sparse attention; saves q, kv, indices, out, lse and recomputes p."""

    @staticmethod
    def forward(ctx, q, kv, indices, scale, dv, chunk):
        out, lse = sparse_attention_mqa_forward_reference(q, kv, indices, scale, dv, chunk)
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.scale, ctx.dv, ctx.chunk = scale, dv, chunk
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, indices, out, lse = ctx.saved_tensors
        dq, dkv = sparse_attention_mqa_backward_reference(
            q, kv, indices, ctx.scale, ctx.dv, out, lse, dout, ctx.chunk)
        return dq.to(q.dtype), dkv.to(kv.dtype), None, None, None, None


def sparse_attention_mqa(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                         dv: int, chunk: int | None = None) -> torch.Tensor:
    """Absorbed / MQA form: q (B,T,H,D), kv (B,S,D) shared by all heads, values = kv[..., :dv].

    -> out (B,T,H,dv). On CPU (the torch path) each query's selected rows are gathered once and
    shared by all heads (see SparseAttentionMQA); gradients from every head sum into kv. On CUDA
    it runs the MHA Triton kernels with a broadcast (stride-0) head dim, which reads kv once per
    head (no dedicated MQA Triton kernel yet).
    """
    if kv.dim() != 3 or q.dim() != 4 or kv.shape[-1] != q.shape[-1]:
        raise ValueError(f"kv must be (B, S, D={q.shape[-1] if q.dim() == 4 else '?'}), "
                         f"got shape {tuple(kv.shape)}")
    if not isinstance(dv, int) or not 0 < dv <= kv.shape[-1]:
        raise ValueError(f"dv must be an int in [1, {kv.shape[-1]}], got {dv!r}")
    B, S, D = kv.shape
    H = q.shape[2]
    k = kv[:, :, None, :].expand(B, S, H, D)                    # (B, S, H, D), stride 0 on H
    v = kv[:, :, None, :dv].expand(B, S, H, dv)                 # (B, S, H, dv)
    _check_args(q, k, v, indices, scale)
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if q.is_cuda and triton is not None:
        return SparseAttention.apply(q, k, v, indices, float(scale), chunk, True)
    return SparseAttentionMQA.apply(q, kv, indices, float(scale), dv, chunk)


def dense_reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              indices: torch.Tensor, scale: float) -> torch.Tensor:
    """Tests only: full (B, H, T, S) logits masked to the selected positions, plain autograd."""
    _check_args(q, k, v, indices, scale)
    B, T, H, _ = q.shape
    S = k.shape[1]
    sel = torch.zeros(B, T, S + 1, dtype=torch.bool, device=q.device)
    sel.scatter_(2, torch.where(indices < 0, S, indices), True)
    sel = sel[..., :S][:, None]                                 # (B, 1, T, S)
    has_any = sel.any(-1, keepdim=True)
    logits = torch.einsum("bthd,bshd->bhts", q, k) * scale      # (B, H, T, S)
    logits = logits.masked_fill(~sel, float("-inf")).masked_fill(~has_any, 0.0)
    p = torch.softmax(logits, dim=-1).masked_fill(~sel, 0.0)
    return torch.einsum("bhts,bshd->bthd", p, v)
