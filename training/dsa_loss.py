"""DSA indexer losses: the two continue-pretraining stages that turn a dense MLA model into a
sparse (DeepSeek Sparse Attention) one. Pure functions over a GLMOutput; the loop calls them.

Shape legend: B batch, T queries, S keys, K index_topk, L DSA layers.

Stage 1, warm-up (dense attention, every weight but the indexers frozen):
    p[t, :] = L1-normalise_s( sum_h softmax_s(q_h[t] . k_h[s] * scale + causal) )   detached
    L_I     = sum_t KL( p[t, :] || softmax_s(I[t, :]) )
Stage 2, sparse adaptation (top-k attention, whole model trains): the same KL, but both
distributions live on the selected set S_t only, as Megatron adds the index mask to the
attention logits and to I before both softmaxes, so each is renormalised over S_t.

Reduction as Megatron's compute_dsa_indexer_loss: sum over s, mean over (batch, t), then here
the mean over DSA layers. Megatron then multiplies by dsa_indexer_loss_coeff: the loop's job.

What the model must be asked for: forward(..., **forward_kwargs(stage)): indexer scores and
attention probabilities, dense attention for the warm-up, top-k for the sparse stage. The model already
feeds the indexer detached inputs (model/mla.py: x.detach(), q_lat.detach()) and returns the
attention probabilities detached, so L_I trains only the indexer and the LM loss never reaches
it (the top-k indices are integers). The MTP block's indexer is not covered: the model returns
no attention probabilities for it (out.mtp_indexer has scores but nothing to match).
"""

from __future__ import annotations

import math

import torch

from model.mla import IndexerOut
from model.model import GLMModel, GLMOutput, freeze_all_but_indexer, moe_layers
from training.data import IGNORE

# Probability mass an attention row may put outside the selected set in a sparse forward:
# anything above this means the output came from a dense forward (wrong stage).
_OUTSIDE_MASS_TOL = 1e-4


def forward_kwargs(stage: str) -> dict:
    """What GLMModel.forward must be given for a stage's indexer loss ("warmup" | "sparse").

    Warm-up: dense attention (the target is the dense distribution) and no MTP (its block's
    attention probabilities are not returned, and there is no LM loss to train in this stage).
    Sparse: top-k attention; the same forward, given labels, also yields the LM loss.
    """
    if stage == "warmup":
        return {"return_indexer": True, "return_attn_probs": True, "dense_attention": True, "compute_mtp": False}
    if stage == "sparse":
        return {"return_indexer": True, "return_attn_probs": True, "dense_attention": False}
    raise ValueError(f"unknown DSA stage {stage!r}; choose 'warmup' or 'sparse'")


def _dsa_layers(out: GLMOutput) -> list[tuple[int, IndexerOut, torch.Tensor]]:
    """(layer index, indexer output, head-summed attention probs) for every DSA layer."""
    if out.indexer is None or out.attn_probs is None:
        raise ValueError("the DSA indexer loss needs forward(..., return_indexer=True, return_attn_probs=True)")
    layers = [(i, idx, probs) for i, (idx, probs) in enumerate(zip(out.indexer, out.attn_probs))
              if idx is not None]
    if not layers:
        raise ValueError("the model has no DSA layers (attention_pattern has no 'dsa' entry)")
    for i, _, probs in layers:
        if probs is None:
            raise ValueError(f"layer {i}: no attention probabilities (return_attn_probs=True)")
    return layers


def selected_mask(indices: torch.Tensor, S: int) -> torch.Tensor:
    """indices [B,T,K] (ascending, -1 = empty slot) -> bool [B,T,S], True at selected keys."""
    B, T, _ = indices.shape
    sel = torch.zeros(B, T, S + 1, dtype=torch.bool, device=indices.device)
    idx = indices.long()                                             # int32 indices are allowed too
    sel.scatter_(-1, torch.where(idx < 0, S, idx), True)            # slot S soaks up the -1s
    return sel[..., :S]


def _kl_rows(p: torch.Tensor, scores: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """sum_s KL terms per row: p [B,T,S] (rows sum to 1 on `support`), scores [B,T,S] -> [B,T].

    Positions off the support carry p = 0 and a -inf logit; they are zeroed BEFORE the product
    (not after), so neither the value nor the gradient ever sees 0 * -inf = NaN.
    """
    log_q = scores.masked_fill(~support, float("-inf")).log_softmax(-1)
    log_q = log_q.masked_fill(~support, 0.0)
    return (torch.xlogy(p, p) - p * log_q).sum(-1)


def _row_weights(token_mask: torch.Tensor | None, B: int, T: int, device) -> torch.Tensor:
    if token_mask is None:
        return torch.ones(B, T, device=device)
    if tuple(token_mask.shape) != (B, T):
        raise ValueError(f"token_mask must be [B={B}, T={T}], got {tuple(token_mask.shape)}")
    if not bool(token_mask.any()):
        raise ValueError("token_mask selects no query position")
    return token_mask.to(device=device, dtype=torch.float32)


def _mean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum() / w.sum()


def warmup_indexer_loss(out: GLMOutput, token_mask: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, dict[str, float]]:
    """Stage-1 loss from a dense forward: mean over DSA layers of the Megatron-reduced
    KL(p || softmax(I)). token_mask [B,T] (1 = real query; e.g. not padding) limits the mean
    over t; masked keys (causal future, other documents) are excluded by the model's masks.

    Metrics, per DSA layer i and averaged ("kl", "recall", "recall_sparse_rows"):
      kl/i                  the layer's loss;
      recall/i              attention mass inside the indexer's top-k set, sum_{s in S_t} p[t,s],
                            averaged over query rows;
      recall_sparse_rows/i  the same over rows with more than K visible keys only: rows with
                            at most K keys select everything and have recall 1 by construction.
                            NaN when no row has more than K keys.
    """
    layers = _dsa_layers(out)
    losses, metrics = [], {}
    for i, idx, probs in layers:
        B, T, S = probs.shape
        w = _row_weights(token_mask, B, T, probs.device)
        visible = torch.isfinite(idx.scores)                               # [B,T,S]
        p = probs.float() / probs.float().sum(-1, keepdim=True)            # L1 over s: sum over heads was H
        kl = _mean(_kl_rows(p, idx.scores, visible), w)
        losses.append(kl)

        with torch.no_grad():
            recall_rows = (p * selected_mask(idx.indices, S)).sum(-1)          # [B,T]
            sparse_rows = w * (visible.sum(-1) > idx.indices.shape[-1])
            metrics[f"kl/{i}"] = kl.item()
            metrics[f"recall/{i}"] = _mean(recall_rows, w).item()
            metrics[f"recall_sparse_rows/{i}"] = (
                _mean(recall_rows, sparse_rows).item() if bool(sparse_rows.any()) else float("nan"))
    loss = torch.stack(losses).mean()
    metrics["kl"] = loss.item()
    for name in ("recall", "recall_sparse_rows"):
        metrics[name] = sum(metrics[f"{name}/{i}"] for i, _, _ in layers) / len(layers)
    return loss, metrics


def sparse_indexer_loss(out: GLMOutput, token_mask: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, dict[str, float]]:
    """Stage-2 loss from a sparse forward (dense_attention=False): mean over DSA layers of
    KL(p restricted to S_t || softmax(I restricted to S_t)), Megatron-reduced.

    In a sparse forward the model's attention probabilities are already per-head softmaxes
    over S_t (the index mask is applied before each head's softmax), which is the target;
    renormalising dense probabilities after the fact would not be (each head has its own
    normaliser), so a dense forward is rejected. Metrics: "kl" and "kl/i" per DSA layer.
    """
    layers = _dsa_layers(out)
    losses, metrics = [], {}
    for i, idx, probs in layers:
        B, T, S = probs.shape
        w = _row_weights(token_mask, B, T, probs.device)
        support = selected_mask(idx.indices, S) & torch.isfinite(idx.scores)
        outside = probs.float().masked_fill(support, 0.0).sum(-1).max().item() / max(
            probs.float().sum(-1).max().item(), 1e-12)
        if outside > _OUTSIDE_MASS_TOL:
            raise ValueError(
                f"layer {i}: the attention puts {outside:.3g} of its mass outside the indexer's "
                "top-k set; sparse_indexer_loss needs a sparse forward (dense_attention=False)")
        p = probs.float() * support
        p = p / p.sum(-1, keepdim=True)
        kl = _mean(_kl_rows(p, idx.scores, support), w)
        losses.append(kl)
        metrics[f"kl/{i}"] = kl.item()
    loss = torch.stack(losses).mean()
    metrics["kl"] = loss.item()
    return loss, metrics


# ---------------------------------------------------------------- objectives (training.objectives)
def _require_dsa(model: GLMModel) -> None:
    if "dsa" not in model.config.layer_kinds:
        raise ValueError("the model has no DSA layers (attention_pattern has no 'dsa' entry): "
                         "nothing for the indexer objectives to train")


def query_rows(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    # Rows with a next-token target: drops padding (and each sequence's last position).
    return batch["labels"] != IGNORE


class IndexerWarmup:
    """KL(p || softmax(I)) on a dense forward; only the indexers train."""

    def prepare(self, model: GLMModel) -> None:
        _require_dsa(model)
        freeze_all_but_indexer(model)

    def begin_step(self, model: GLMModel, step: int) -> None:
        pass

    def loss(self, engine, batch):
        out = engine(batch["input_ids"], doc_ids=batch["doc_ids"], **forward_kwargs("warmup"))
        # The router bias is a buffer the loop updates from the loads counted in forward; the
        # trunk is frozen in this stage, so no load may be counted (the update then skips it).
        for m in moe_layers(engine.module):
            m.load_since_update.zero_()
        loss, m = warmup_indexer_loss(out, query_rows(batch))
        # recall_sparse_rows is NaN when no row sees more than index_topk keys; every row then
        # selects all its keys, recall 1, and a NaN would poison the sum over ranks.
        sparse = m["recall_sparse_rows"]
        return loss, {"loss": m["kl"], "lm": 0.0, "mtp": 0.0, "balance": 0.0, "kl": m["kl"],
                      "recall": m["recall"], "recall_sparse_rows": 1.0 if math.isnan(sparse) else sparse}


class SparseAdaptation:
    """Top-k attention; LM (+MTP, balance) for the trunk + coeff x KL on the selected set for
    the indexer (its inputs are detached by the model, the indices are integers)."""

    def __init__(self, indexer_loss_coeff: float = 1.0):
        self.coeff = indexer_loss_coeff

    def prepare(self, model: GLMModel) -> None:
        _require_dsa(model)
        if model.config.dense_attention:
            raise ValueError("sparse adaptation needs dense_attention=False (top-k attention)")

    def begin_step(self, model: GLMModel, step: int) -> None:
        pass

    def loss(self, engine, batch):
        out = engine(batch["input_ids"], labels=batch["labels"], doc_ids=batch["doc_ids"],
                     **forward_kwargs("sparse"))
        kl, m = sparse_indexer_loss(out, query_rows(batch))
        # "loss" stays lm + mtp + balance, as for every stage (and the baselines it is compared
        # with): the KL trains other parameters and is reported on its own.
        return out.loss + self.coeff * kl, {
            "loss": out.loss.item(), "lm": out.losses["lm"].item(),
            "mtp": float(out.losses["mtp"].item()) if "mtp" in out.losses else 0.0,
            "balance": out.losses["balance"].item(), "kl": m["kl"]}
