"""DSA indexer losses: exact values on hand-built outputs, gradient routing on a real model, and
a short warm-up on real text that must lower the KL and raise the top-k recall."""

from pathlib import Path

import pytest
import torch

from kernels.topk import deterministic_topk
from model.config import preset
from model.mla import IndexerOut
from model.model import GLMModel, GLMOutput, freeze_all_but_indexer, indexer_parameters, unfreeze_all
from training.dsa_loss import forward_kwargs, selected_mask, sparse_indexer_loss, warmup_indexer_loss

REPO = Path(__file__).resolve().parents[2]
H = 4   # heads in the hand-built outputs: attention rows sum to H, as the model's do


def causal(B: int, T: int) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)


def head_summed(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [B,H,T,S] -> sum over heads of the masked softmax [B,T,S] (rows sum to H)."""
    return logits.masked_fill(~allowed[:, None], float("-inf")).softmax(-1).sum(1)


def output(scores: torch.Tensor, probs: torch.Tensor, k: int) -> GLMOutput:
    return GLMOutput(logits=torch.zeros(1), indexer=[IndexerOut(scores, deterministic_topk(scores.detach(), k))],
                     attn_probs=[probs])


def reference_kl(p: torch.Tensor, scores: torch.Tensor) -> float:
    """Row by row, over the finite-score keys only: sum_s p log(p/q); mean over (b, t)."""
    B, T, _ = p.shape
    total = 0.0
    for b in range(B):
        for t in range(T):
            ok = torch.isfinite(scores[b, t])
            pr, q = p[b, t, ok].double(), scores[b, t, ok].double().softmax(-1)
            pr = pr / pr.sum()
            total += float(torch.where(pr > 0, pr * (pr / q).log(), 0.0).sum())
    return total / (B * T)


# ---------------------------------------------------------------- exact values
def test_warmup_kl_zero_when_indexer_reproduces_target_and_matches_reference():
    torch.manual_seed(0)
    B, T = 2, 12
    allowed = causal(B, T)
    probs = head_summed(torch.randn(B, H, T, T) * 2, allowed)
    # An indexer whose logits are log p reproduces the target exactly.
    exact = (probs / H).log().masked_fill(~allowed, float("-inf"))
    loss, m = warmup_indexer_loss(output(exact, probs, k=4))
    assert abs(loss.item()) < 1e-5

    other = torch.randn(B, T, T).masked_fill(~allowed, float("-inf"))
    loss, m = warmup_indexer_loss(output(other, probs, k=4))
    assert loss.item() > 0.05
    assert loss.item() == pytest.approx(reference_kl(probs, other), rel=1e-4)
    assert m["kl/0"] == pytest.approx(loss.item())


def test_recall_is_the_target_mass_inside_the_selected_set():
    torch.manual_seed(1)
    B, T, k = 1, 10, 3
    allowed = causal(B, T)
    probs = head_summed(torch.randn(B, H, T, T) * 3, allowed)
    p = probs / H
    # Selecting the target's own top-k maximises recall; the reverse order minimises it.
    best = output(p.log().masked_fill(~allowed, float("-inf")), probs, k)
    worst = output((-p).masked_fill(~allowed, float("-inf")), probs, k)
    _, mb = warmup_indexer_loss(best)
    _, mw = warmup_indexer_loss(worst)
    expected = p.sort(-1, descending=True).values[..., :k].sum(-1).mean().item()
    assert mb["recall"] == pytest.approx(expected, rel=1e-5)
    assert mw["recall"] < mb["recall"]
    # Rows t < k see at most k keys: they do not count in recall_sparse_rows.
    sparse_expected = p.sort(-1, descending=True).values[0, k:, :k].sum(-1).mean().item()
    assert mb["recall_sparse_rows"] == pytest.approx(sparse_expected, rel=1e-5)


def test_masked_positions_give_no_nan_in_value_or_gradient():
    torch.manual_seed(2)
    B, T = 2, 8
    allowed = causal(B, T)
    # Heads with -inf logits at some visible keys too: p is exactly 0 there.
    logits = torch.randn(B, H, T, T)
    logits[..., 0] = float("-inf")
    logits[..., 0, 0] = 0.0                                  # row 0 must keep its only key
    probs = head_summed(logits, allowed)
    assert (probs == 0).any()
    scores = torch.randn(B, T, T).masked_fill(~allowed, float("-inf")).requires_grad_(True)
    loss, m = warmup_indexer_loss(output(scores, probs, k=3))
    loss.backward()
    assert torch.isfinite(loss) and all(v == v for k, v in m.items() if not k.startswith("recall_sparse"))
    assert torch.isfinite(scores.grad).all()
    assert (scores.grad[~allowed] == 0).all()


def test_token_mask_excludes_rows_from_the_mean():
    torch.manual_seed(3)
    B, T = 1, 6
    allowed = causal(B, T)
    probs = head_summed(torch.randn(B, H, T, T), allowed)
    scores = torch.randn(B, T, T).masked_fill(~allowed, float("-inf"))
    mask = torch.tensor([[1, 1, 1, 0, 0, 0]])
    loss, _ = warmup_indexer_loss(output(scores, probs, k=2), token_mask=mask)
    assert loss.item() == pytest.approx(reference_kl(probs[:, :3], scores[:, :3, :]), rel=1e-4)
    with pytest.raises(ValueError, match="token_mask"):
        warmup_indexer_loss(output(scores, probs, k=2), token_mask=torch.ones(1, 5))


def test_sparse_kl_lives_on_the_selected_set():
    torch.manual_seed(4)
    B, T, k = 2, 12, 4
    allowed = causal(B, T)
    scores = torch.randn(B, T, T).masked_fill(~allowed, float("-inf"))
    sel = selected_mask(deterministic_topk(scores, k), T)
    logits = torch.randn(B, H, T, T)
    probs = head_summed(logits, allowed & sel)               # what a sparse forward returns
    # Logits equal to log p on S_t and anything lower off it: exactly 0, whatever is off S_t.
    exact = (probs / H).clamp_min(1e-30).log().masked_fill(~sel, -50.0).masked_fill(~allowed, float("-inf"))
    out = output(exact, probs, k)
    assert torch.equal(out.indexer[0].indices, deterministic_topk(scores, k))
    assert abs(sparse_indexer_loss(out)[0].item()) < 1e-5

    loss, _ = sparse_indexer_loss(output(scores, probs, k))
    restricted = scores.masked_fill(~sel, float("-inf"))
    assert loss.item() == pytest.approx(reference_kl(probs, restricted), rel=1e-4)
    assert loss.item() > 0.01

    dense_probs = head_summed(logits, allowed)               # a dense forward's probabilities
    with pytest.raises(ValueError, match="sparse forward"):
        sparse_indexer_loss(output(scores, dense_probs, k))


def test_selected_mask_takes_int32_and_empty_slots():
    idx = torch.tensor([[[0, 2, -1], [1, -1, -1]]])
    want = torch.tensor([[[True, False, True, False], [False, True, False, False]]])
    assert torch.equal(selected_mask(idx, 4), want)
    assert torch.equal(selected_mask(idx.int(), 4), want)


def test_needs_indexer_outputs():
    with pytest.raises(ValueError, match="return_indexer"):
        warmup_indexer_loss(GLMOutput(logits=torch.zeros(1)))
    with pytest.raises(ValueError, match="unknown DSA stage"):
        forward_kwargs("dense")


# ---------------------------------------------------------------- a real model
def tiny_cfg(**kw):
    # std 0.3: a random model whose attention is far from uniform, so there is something to learn
    return preset("tiny").replace(vocab_size=256, num_layers=2, first_k_dense=2, mtp_depth=0,
                                  index_topk=12, init_std=0.3, **kw)


def text_batches(B: int, T: int, n: int) -> list[torch.Tensor]:
    """Real text as UTF-8 bytes (vocab 256): no tokenizer training needed."""
    data = (REPO / "samples/tinyshakespeare/input.txt").read_bytes()[: B * T * n]
    return list(torch.tensor(list(data)).view(n, B, T))


def grad_names(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}


def test_warmup_gradients_reach_only_the_indexers():
    torch.manual_seed(0)
    model = GLMModel(tiny_cfg(attention_pattern=("dsa", "full")))
    x = text_batches(2, 48, 1)[0]
    trainable = freeze_all_but_indexer(model)
    out = model(x, **forward_kwargs("warmup"))
    warmup_indexer_loss(out)[0].backward()
    got = grad_names(model)
    assert got and all(".indexer." in n for n in got)
    assert {id(p) for p in trainable} == {id(p) for n, p in model.named_parameters() if n in got}

    # Even with everything trainable (sparse stage) the indexer loss stays inside the indexer,
    # and the LM loss never reaches it.
    unfreeze_all(model)
    model.zero_grad(set_to_none=True)
    out = model(x[:, :-1], labels=x[:, 1:], **forward_kwargs("sparse"))
    sparse_indexer_loss(out)[0].backward()
    got = grad_names(model)
    assert got and all(".indexer." in n for n in got)
    model.zero_grad(set_to_none=True)
    out.losses["lm"].backward()
    assert not any(".indexer." in n for n in grad_names(model))


def test_warmup_on_real_text_lowers_kl_and_raises_recall():
    torch.manual_seed(0)
    model = GLMModel(tiny_cfg())
    batches = text_batches(2, 64, 6)
    opt = torch.optim.Adam(freeze_all_but_indexer(model), lr=1e-2)
    kl, recall = [], []
    for step in range(150):
        out = model(batches[step % len(batches)], **forward_kwargs("warmup"))
        loss, m = warmup_indexer_loss(out)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        kl.append(m["kl"])
        recall.append(m["recall_sparse_rows"])
    windows = [sum(kl[i:i + 30]) / 30 for i in range(0, 150, 30)]
    assert all(a > b for a, b in zip(windows, windows[1:])), windows       # steady descent (2.2 -> 0.73)
    assert windows[-1] < 0.5 * windows[0], windows
    first, last = sum(recall[:12]) / 12, sum(recall[-12:]) / 12
    assert last > first + 0.1, (first, last)
    assert all(p.grad is None for n, p in model.named_parameters() if ".indexer." not in n)
    assert indexer_parameters(model)
