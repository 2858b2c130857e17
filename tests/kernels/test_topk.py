import torch
import pytest

from kernels.topk import deterministic_topk, topk_reference, topk_torch
from tests.kernels._interpret import require_interpreter, run_interpreted

NEG = float("-inf")


def _plateau_scores(shape, seed):
    """ReLU-like scores: about half exactly zero (both signs of zero), some -inf (masked)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).relu()
    x = torch.where(torch.rand(shape, generator=g) < 0.2, -x, x)  # makes -0.0 among the zeros
    x[torch.rand(shape, generator=g) < 0.15] = NEG
    x[..., :3] = torch.round(x[..., :3])                      # a few more exact ties
    return x


def test_reference_semantics_by_hand():
    s = torch.tensor([3.0, 1.0, 3.0, NEG, 0.0, 3.0])
    assert topk_reference(s, 2).tolist() == [0, 2]           # three-way tie: lowest positions
    assert topk_reference(s, 5).tolist() == [0, 1, 2, 4, 5]  # indices come back ascending
    assert topk_reference(s, 6).tolist() == [0, 1, 2, 4, 5, -1]  # -inf slot -> -1 at the end
    assert topk_reference(s, 8).tolist() == [0, 1, 2, 4, 5, -1, -1, -1]  # S < k: padded


@pytest.mark.parametrize("fn", [topk_reference, topk_torch, deterministic_topk])
def test_ties_and_padding_by_hand(fn):
    s = torch.tensor([[0.0, -0.0, 0.0, 2.0, 0.0], [NEG, NEG, 1.0, NEG, NEG]])
    assert fn(s, 3).tolist() == [[0, 1, 3], [2, -1, -1]]


@pytest.mark.parametrize("shape,k", [((4, 50), 7), ((2, 3, 33), 33), ((3, 20), 30), ((5, 1), 1)])
def test_torch_path_matches_reference_and_is_repeatable(shape, k):
    x = _plateau_scores(shape, seed=k)
    ref = topk_reference(x, k)
    runs = [topk_torch(x, k) for _ in range(3)]
    for r in runs:
        assert r.dtype == torch.long and r.shape == (*shape[:-1], k)
        assert torch.equal(r, ref)


def test_selection_is_a_true_topk():
    x = _plateau_scores((6, 40), seed=1)
    idx = topk_torch(x, 10)
    picked = torch.where(idx >= 0, x.gather(-1, idx.clamp(min=0)), NEG)
    expected = torch.topk(x, 10).values                       # values are well defined under ties
    assert torch.equal(picked.sort(-1, descending=True).values, expected)
    for row in idx:                                           # ascending, unique, -1 last
        n = int((row >= 0).sum())
        assert torch.all(row[:n].diff() > 0) and torch.all(row[n:] == -1)


def test_bad_k():
    with pytest.raises(ValueError, match="k"):
        topk_torch(torch.zeros(3), 0)


def _triton_check():
    require_interpreter()
    from kernels.topk import topk_triton
    # several blocks per row, S < k, k == S, k == 1; ties and -inf throughout
    for i, (shape, k, block) in enumerate([((4, 50), 7, 16), ((2, 3, 33), 33, 16),
                                           ((3, 20), 30, 8), ((3, 100), 1, 32)]):
        x = _plateau_scores(shape, seed=i)
        out = topk_triton(x, k, block=block)
        assert torch.equal(out, topk_reference(x, k)), (shape, k)
        if i == 0:
            assert torch.equal(topk_triton(x, k, block=block), out)  # and again


def test_triton_matches_reference_under_interpreter():
    run_interpreted(__name__, "_triton_check")
