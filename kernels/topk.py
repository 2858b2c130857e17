"""Deterministic top-k for DSA index selection.

torch.topk does not promise a stable order among tied scores, and in DSA ties are structural:
ReLU makes whole plateaus of keys score exactly 0.0. This module pins the selection down:

1. take the k highest scores, breaking ties by the lower position (a stable descending sort);
2. return the selected positions sorted ascending;
3. slots whose score is -inf (masked keys, e.g. the causal future) come back as -1, at the end;
4. if S < k, the output is padded with -1 up to k.

Three implementations give bit-identical indices:
- `topk_reference`: the definition, a stable sort over the whole row (O(S log S)).
- `topk_torch`: the CPU path. torch.topk only finds the k-th largest *value* (ties cannot change
  a value); every position at or above it is taken and `nonzero` reads them out in ascending
  order (one O(S) compare per row; bincount of the hits finds rows with more ties than room).
  Only in those rows are tied positions ranked by position (a cumulative sum).
- `topk_triton`: one program per row. A 32-step bisection over the order-preserving integer key
  of float32 finds the k-th largest value, then one pass writes the selected positions in
  ascending order.

`deterministic_topk` picks Triton for CUDA tensors when triton imports, `topk_torch` otherwise.
Scores are compared as float32; -0.0 and +0.0 are the same score (ReLU plateaus produce both).
NaN scores are not supported.

Shapes: R rows (all leading dims flattened), S scores per row, k selected.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the torch path is used
    triton = None


def _check_args(scores: torch.Tensor, k: int) -> None:
    if scores.dim() < 1:
        raise ValueError(f"scores must have at least one dim, got shape {tuple(scores.shape)}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")


def _pad(idx: torch.Tensor, k: int) -> torch.Tensor:
    if idx.shape[-1] == k:
        return idx
    pad = idx.new_full((*idx.shape[:-1], k - idx.shape[-1]), -1)
    return torch.cat([idx, pad], dim=-1)


def topk_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The definition: stable descending sort, then ascending positions, -1 for -inf/padding."""
    _check_args(scores, k)
    S = scores.shape[-1]
    kk = min(k, S)
    vals, idx = torch.sort(scores.float(), dim=-1, descending=True, stable=True)
    vals, idx = vals[..., :kk], idx[..., :kk]                  # (..., kk)
    key = torch.where(vals == float("-inf"), S, idx)           # invalid slots sort last
    key = torch.sort(key, dim=-1).values
    out = torch.where(key == S, -1, key)
    return _pad(out, k)


def topk_torch(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Same result as `topk_reference` in O(S) extra memory per row, without a full sort."""
    _check_args(scores, k)
    lead, S = scores.shape[:-1], scores.shape[-1]
    kk = min(k, S)
    if kk == 0:
        return scores.new_full((*lead, k), -1, dtype=torch.long)
    x = scores.reshape(-1, S).float()                          # (R, S); -0.0 == +0.0 here
    R = x.shape[0]
    thr = torch.topk(x, kk, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # k-th largest
    # everything at or above the threshold; -inf never counts (only matters when thr is -inf)
    take = x >= thr
    ninf = thr.squeeze(-1) == float("-inf")
    if bool(ninf.any()):
        take[ninf] &= x[ninf] != float("-inf")
    row, pos = take.nonzero(as_tuple=True)                     # row-major: ascending per row
    counts = torch.bincount(row, minlength=R)                  # O(selected), not O(R * S)
    short = counts > kk                                        # rows with more ties than room
    if bool(short.any()):                                      # lower positions win the ties
        xs, ts = x[short], thr[short]
        above, tied = xs > ts, xs == ts
        need = kk - above.sum(-1, keepdim=True)
        take[short] = above | (tied & (torch.cumsum(tied, dim=-1) <= need))
        row, pos = take.nonzero(as_tuple=True)
        counts = torch.bincount(row, minlength=R)
    if pos.numel() == R * kk:                                  # every row full: no -1 slots
        out = pos.view(R, kk)
    else:                                                      # fewer than kk leaves -1s
        slot = torch.arange(row.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[row]
        out = torch.full((R, kk), -1, dtype=torch.long, device=x.device)
        out[row, slot] = pos
    return _pad(out.reshape(*lead, kk), k)


if triton is not None:

    @triton.jit
    def _ordered_key(x):
        # float32 -> int32 whose signed order matches the float order (+0.0 == -0.0)
        bits = x.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return tl.where(x == 0.0, 0, key)

    @triton.jit
    def _topk_kernel(x_ptr, out_ptr, S, K, stride_x, stride_out, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        x_row = x_ptr + row * stride_x
        offs = tl.arange(0, BLOCK)
        # bisection for the k-th largest key: largest t with count(key >= t) >= K
        lo = tl.full((), -2147483648, tl.int64)
        hi = tl.full((), 2147483647, tl.int64)
        for _ in range(32):
            mid = lo + (hi - lo + 1) // 2
            cnt = tl.zeros((), tl.int64)
            for s0 in range(0, S, BLOCK):
                m = s0 + offs < S
                key = _ordered_key(tl.load(x_row + s0 + offs, mask=m, other=0.0))
                cnt += tl.sum(((key.to(tl.int64) >= mid) & m).to(tl.int64), axis=0)
            ok = cnt >= K
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        thr = lo
        # how many strictly above the threshold; ties fill the remaining slots by position
        n_above = tl.zeros((), tl.int64)
        for s0 in range(0, S, BLOCK):
            m = s0 + offs < S
            key = _ordered_key(tl.load(x_row + s0 + offs, mask=m, other=0.0)).to(tl.int64)
            n_above += tl.sum(((key > thr) & m).to(tl.int64), axis=0)
        need = K - n_above
        n_tied = tl.zeros((), tl.int64)
        n_out = tl.zeros((), tl.int64)
        for s0 in range(0, S, BLOCK):
            m = s0 + offs < S
            x = tl.load(x_row + s0 + offs, mask=m, other=float("-inf"))
            key = _ordered_key(x).to(tl.int64)
            valid = m & (x != float("-inf"))
            tied = valid & (key == thr)
            tied_rank = n_tied + tl.cumsum(tied.to(tl.int64), axis=0)  # 1-based among ties
            take = valid & ((key > thr) | (tied & (tied_rank <= need)))
            slot = n_out + tl.cumsum(take.to(tl.int64), axis=0) - 1
            tl.store(out_ptr + row * stride_out + slot, (s0 + offs).to(tl.int64), mask=take)
            n_tied += tl.sum(tied.to(tl.int64), axis=0)
            n_out += tl.sum(take.to(tl.int64), axis=0)


def topk_triton(scores: torch.Tensor, k: int, block: int = 1024) -> torch.Tensor:
    """Triton path (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    _check_args(scores, k)
    if triton is None:
        raise RuntimeError("triton is not installed")
    lead, S = scores.shape[:-1], scores.shape[-1]
    kk = min(k, S)
    x = scores.reshape(-1, S).float().contiguous()             # (R, S)
    out = torch.full((x.shape[0], kk), -1, dtype=torch.long, device=x.device)  # (R, kk)
    if x.shape[0] > 0 and S > 0:
        BLOCK = min(block, triton.next_power_of_2(S))
        _topk_kernel[(x.shape[0],)](x, out, S, kk, x.stride(0), out.stride(0), BLOCK=BLOCK)
    return _pad(out.reshape(*lead, kk), k)


def deterministic_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores (..., S) -> LongTensor (..., k): ascending selected positions, -1 at the end."""
    if scores.is_cuda and triton is not None:
        return topk_triton(scores, k)
    return topk_torch(scores, k)
