"""One policy update on a batch of scored rollouts: the trainer side of every RL stage.

    1. advantages per group (rl.algorithms: `grpo` = rl.loss.group_advantages, or a registered one)
    2. pi_train(theta_old): one no-grad forward over every sample's exact token ids; stored on
       the samples beside the rollout log-probs (IcePop compares the two). Skipped for a loss
       registered with pi_old=False (double-sided IS reads only the rollout log-probs)
    3. `epochs` passes over `minibatches` shuffled minibatches, one optimizer step each. With one
       step per batch the ratio pi_theta / pi_old is exactly 1 and the PPO clip never acts; from
       the second step on it does.
Samples that are not trainable (aborted, reward error, empty) are left out of the loss; their
group's advantage baseline is computed over the valid members only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from model.model import GLMModel
from model.moe import replaying_routes
from rl.algorithms import ADVANTAGES, POLICY_LOSSES, WITHOUT_PI_OLD
from rl.ranks import SINGLE, Ranks
from rl.sample import Sample
from rl.trainer import clip_and_step
from training import metrics


def collate(samples: list[Sample], pad_id: int, share_prefix: bool | str = False) -> dict[str, torch.Tensor]:
    """Right-padded tensors for one forward pass over prompt + response.

    input_ids [B,T]; attention_mask [B,T]; targets [B,T] (the next token at each position);
    response_mask [B,T] = 1 where targets[b,t] is a trained response token; response_region [B,T]
    = 1 where it is any response token (tool results inside a response included); rollout_logprobs,
    train_logprobs, teacher_logprobs [B,T] aligned with targets (0 elsewhere); advantages [B];
    routes (when every sample recorded its rollout's experts): per MoE layer [B,T,K], replayed by
    the forward passes here (routing replay).

    share_prefix, when some samples share a prompt (a GRPO group): "prefix" holds each distinct
    prompt but its last token once (left-padded input_ids, attention_mask, its routes, and rows
    [B]: which prefix row each sample continues), and row b starts at offsets[b] = its prompt's
    length - 1, so the trainer runs a group's prompt once instead of once per sample.
    share_prefix="always": the prompt pass even when no prompt repeats (collate_on_ranks)."""
    prefix = _shared_prefixes(samples, pad_id, share_prefix == "always") if share_prefix else None
    offsets = [len(s.prompt_ids) - 1 if prefix is not None else 0 for s in samples]
    seqs = [(s.prompt_ids + s.response_ids)[o:] for s, o in zip(samples, offsets)]
    T = max(len(x) for x in seqs) - 1
    B = len(samples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    targets = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros(B, T, dtype=torch.long)
    resp = torch.zeros(B, T)
    region = torch.zeros(B, T)
    rollout = torch.zeros(B, T)
    train = torch.zeros(B, T)
    teacher = torch.zeros(B, T)
    for b, (s, seq, o) in enumerate(zip(samples, seqs, offsets)):
        n = len(seq) - 1
        input_ids[b, :n] = torch.tensor(seq[:-1])
        targets[b, :n] = torch.tensor(seq[1:])
        attention[b, :n] = 1
        start = len(s.prompt_ids) - 1 - o        # position whose target is the first response token
        r = len(s.response_ids)
        resp[b, start:start + r] = torch.tensor(s.loss_mask, dtype=torch.float)
        region[b, start:start + r] = 1.0
        rollout[b, start:start + r] = torch.tensor(s.rollout_logprobs)
        if s.train_logprobs is not None:
            train[b, start:start + r] = torch.tensor(s.train_logprobs)
        if s.teacher_logprobs is not None:
            teacher[b, start:start + r] = torch.tensor(s.teacher_logprobs)
    batch = {"input_ids": input_ids, "attention_mask": attention, "targets": targets, "response_mask": resp,
             "response_region": region,
             "rollout_logprobs": rollout, "train_logprobs": train, "teacher_logprobs": teacher,
             "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float),
             "offsets": torch.tensor(offsets)}
    if all(s.routes is not None for s in samples):
        # routing replay: per MoE layer [B,T,K], the rollout's experts; -1 (route anew) on padding
        L, _, K = samples[0].routes.shape
        routes = torch.full((L, B, T, K), -1, dtype=torch.long)
        for b, (s, o) in enumerate(zip(samples, offsets)):
            routes[:, b, :s.routes.shape[1] - o] = s.routes[:, o:].long()
        batch["routes"] = list(routes)
    if prefix is not None:
        batch["prefix"] = prefix
    return batch


def _shared_prefixes(samples: list[Sample], pad_id: int, always: bool = False) -> dict[str, Any] | None:
    """collate's "prefix", or None when no two samples share a prompt (nothing to save; unless
    `always`) or a prompt is a single token (no prefix to share)."""
    first: dict[tuple[int, ...], int] = {}
    rows = [first.setdefault(tuple(s.prompt_ids), len(first)) for s in samples]
    if (len(first) == len(samples) and not always) or min(len(p) for p in first) < 2:
        return None
    owner: dict[int, int] = {}                              # prefix row -> its first sample
    for b, r in enumerate(rows):
        owner.setdefault(r, b)
    P = max(len(p) for p in first) - 1
    ids = torch.full((len(first), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(first), P, dtype=torch.long)
    for u, p in enumerate(first):                           # left padding: every prefix ends at column P
        ids[u, P - len(p) + 1:] = torch.tensor(p[:-1])
        mask[u, P - len(p) + 1:] = 1
    out: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "rows": torch.tensor(rows)}
    if all(s.routes is not None for s in samples):
        L, _, K = samples[0].routes.shape
        routes = torch.full((L, len(first), P, K), -1, dtype=torch.long)
        for u, b in owner.items():
            n = len(samples[b].prompt_ids) - 1
            routes[:, u, P - n:] = samples[b].routes[:, :n].long()
        out["routes"] = list(routes)
    return out


@dataclass(frozen=True)
class UpdateParams:
    eps_low: float = 0.2
    eps_high: float = 0.28
    icepop_beta: float | None = 2.0
    minibatches: int = 2
    epochs: int = 1
    temperature: float = 1.0
    std_normalize: bool = False
    grad_clip: float = 1.0
    policy_loss: str = "icepop"        # rl.algorithms.POLICY_LOSSES
    adv_clip: float | None = None      # opd: |A_t| clip in nats
    share_prefix: bool = True          # a prompt shared by samples of a minibatch: one forward (collate)


def assign_advantages(samples: list[Sample], std_normalize: bool, estimator: str = "grpo") -> float:
    """Set sample.advantage (rl.algorithms.ADVANTAGES[estimator]); returns the fraction of groups
    whose rewards all agree."""
    valid = [s for s in samples if s.trainable]
    if not valid:
        return 1.0
    rewards = torch.tensor([s.reward for s in valid])
    groups = torch.tensor([s.group for s in valid])
    for s, a in zip(valid, ADVANTAGES[estimator](rewards, groups, std_normalize).tolist()):
        s.advantage = a
    flat = sum(bool((rewards[groups == g] == rewards[groups == g][0]).all()) for g in groups.unique())
    return flat / len(groups.unique())


def response_logprobs(logits: torch.Tensor, batch: dict[str, torch.Tensor], temperature: float,
                      want_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(target) [B,T] at the positions that predict a response token (0 elsewhere), and the
    entropy there. `logits`: [B,T,V], or [N,V] at those positions only (GLMModel's logits_at).
    Prompts (a tool schema, a rubric) are most positions and never scored: the vocabulary
    projection and softmax over all of them were 80% of a tiny rl-general step."""
    where = batch["response_region"] > 0
    rows = logits[where] if logits.dim() == 3 else logits
    lp = (rows.float() / temperature).log_softmax(-1)                           # [N, V]
    logp = torch.zeros(where.shape, dtype=lp.dtype)
    logp[where] = lp.gather(-1, batch["targets"][where][:, None]).squeeze(-1)
    if not want_entropy:
        return logp, None
    with torch.no_grad():
        ent = torch.zeros(where.shape, dtype=lp.dtype)
        ent[where] = -(lp.exp() * lp).sum(-1)
    return logp, ent


def collate_on_ranks(samples: list[Sample], pad_id: int, share_prefix: bool, ranks: Ranks) -> dict[str, Any]:
    """collate for this rank's share. With expert parallelism every rank must run the same
    forwards (each MoE layer exchanges tokens with the others), so the prompt pass runs on every
    rank or on none: on all when every rank's prompts can take one, repeated or not."""
    if not share_prefix or ranks.ep is None:
        return collate(samples, pad_id, share_prefix)
    able = all(len(s.prompt_ids) >= 2 for s in samples)
    every = ranks.sum([float(able)])[0] == ranks.world
    return collate(samples, pad_id, "always" if every else False)


def _forward_logprobs(model: GLMModel, batch: dict[str, Any], temperature: float, want_entropy: bool = False):
    cache = None
    if "prefix" in batch:
        # each distinct prompt once, its latent KV cache then given to every sample continuing
        # it (gradients of the copies sum back into the one prompt pass)
        prefix = batch["prefix"]
        cache = model.new_cache()
        with replaying_routes(model, prefix.get("routes")):
            model(prefix["input_ids"], attention_mask=prefix["attention_mask"], cache=cache,
                  logits_at=torch.zeros_like(prefix["attention_mask"], dtype=torch.bool))
        cache = cache.select(prefix["rows"])
    with replaying_routes(model, batch.get("routes")):
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], cache=cache,
                       logits_at=batch["response_region"] > 0).logits
    return response_logprobs(logits, batch, temperature, want_entropy)


@torch.no_grad()
def recompute_old_logprobs(model: GLMModel, samples: list[Sample], pad_id: int, temperature: float,
                           chunk: int = 64, ranks: Ranks = SINGLE, share_prefix: bool = True) -> float:
    """Store pi_train(theta_old) per response token on each sample; returns the mean entropy.
    On several ranks each computes its share and every sample gets every rank's values.
    share_prefix: a prompt shared by several samples is computed once (collate)."""
    was = model.training
    model.eval()
    lo, hi = ranks.bounds(len(samples))
    mine = samples[lo:hi]
    ent_sum, n = 0.0, 0.0
    values: list[list[float]] = []
    try:
        for i in range(ranks.chunks(len(samples), chunk)):
            part = mine[i * chunk:(i + 1) * chunk]
            batch = collate_on_ranks(part or samples[:1], pad_id, share_prefix, ranks)  # an empty share joins too
            logp, ent = _forward_logprobs(model, batch, temperature, want_entropy=True)
            if not part:
                continue
            m = batch["response_mask"]
            ent_sum += float((ent * m).sum())
            n += float(m.sum())
            for b, s in enumerate(part):
                start = len(s.prompt_ids) - 1 - int(batch["offsets"][b])
                values.append(logp[b, start:start + len(s.response_ids)].tolist())
    finally:
        model.train(was)
    for s, lp in zip(samples, [v for share in ranks.gather(values) for v in share]):
        s.train_logprobs = lp
    ent_sum, n = ranks.sum([ent_sum, n])
    return ent_sum / max(n, 1.0)


def mismatch(samples: list[Sample]) -> dict[str, float]:
    """The train/inference mismatch on the trained tokens: mean and max |log pi_train - log
    pi_rollout|, and the K3 estimate of KL(pi_rollout || pi_train) (rho - 1 - log rho with
    rho = pi_train / pi_rollout, on tokens sampled from pi_rollout: unbiased, never negative)."""
    diffs = [t - r for s in samples for t, r, m in zip(s.train_logprobs or [], s.rollout_logprobs, s.loss_mask) if m]
    return _mismatch_stats(torch.tensor(diffs, dtype=torch.float64), SINGLE)


def _mismatch_stats(d: torch.Tensor, ranks: Ranks) -> dict[str, float]:
    """mismatch()'s figures from this rank's log-prob differences d [N] (train - rollout, trained
    tokens only), over every rank."""
    n, absum, k3 = ranks.sum([float(d.numel()), float(d.abs().sum()), float((d.exp() - 1 - d).sum())])
    if n == 0:
        return {}
    top = max(ranks.gather(float(d.abs().max()) if d.numel() else 0.0))
    return {"mismatch/abs_logp": absum / n, "mismatch/abs_logp_max": top, "mismatch/k3": k3 / n}


def mismatch_trend(records: list[dict]) -> dict[str, Any] | None:
    """A stage's mismatch over its steps (for its summary, `status --json` and the report): the
    first and last tenth's means of the per-step mean |delta log p| and K3, and the largest |delta|."""
    if not any("mismatch/k3" in r for r in records):
        return None
    return {"abs_logp": metrics.first_last(records, "mismatch/abs_logp"),
            "k3": metrics.first_last(records, "mismatch/k3"),
            "abs_logp_max": max(r["mismatch/abs_logp_max"] for r in records if "mismatch/abs_logp_max" in r)}


def update(model: GLMModel, optimizer, samples: list[Sample], pad_id: int,
           params: UpdateParams, generator: torch.Generator, ranks: Ranks = SINGLE) -> dict[str, float]:
    """Steps 2-3 of the module doc on samples whose advantages are set. Returns mean stats.
    `optimizer`: a torch optimizer over `model`, or a DeepSpeed engine over it (rl.ranks) with
    `ranks` saying where this process sits; every rank passes the same samples and generator
    state, and gets the same stats."""
    train = [s for s in samples if s.trainable]
    if not train:
        return {}
    entropy, mis = None, {}
    if params.policy_loss not in WITHOUT_PI_OLD:
        entropy = recompute_old_logprobs(model, train, pad_id, params.temperature, ranks=ranks,
                                         share_prefix=params.share_prefix)
        mis = mismatch(train)
    totals: dict[str, float] = {}
    steps = 0
    model.train()
    for epoch in range(params.epochs):
        order = torch.randperm(len(train), generator=generator).tolist()
        size = -(-len(train) // params.minibatches)
        for k in range(0, len(train), size):
            part = [train[j] for j in order[k:k + size]]
            mine, scale = ranks.share(part)
            batch = collate_on_ranks(mine, pad_id, params.share_prefix, ranks)
            logp, _ = _forward_logprobs(model, batch, params.temperature)
            loss, stats = POLICY_LOSSES[params.policy_loss](logp, batch, params)
            if not mis and epoch == 0 and k == 0:
                # without a pi_old pass: the first minibatch's forward is still at theta_old
                mis = _first_minibatch_mismatch(logp, batch, scale, ranks)
            gnorm = clip_and_step(model, optimizer, loss * scale, params.grad_clip, ranks)
            # token-weighted over the ranks, except the loss: the one-rank minibatch loss
            tokens = float(batch["response_mask"].sum()) * (scale > 0)
            keys = sorted(stats)
            reduced = ranks.sum([stats[key] * tokens for key in keys] + [tokens, float(loss.detach()) * scale])
            merged = {key: v / max(reduced[-2], 1.0) for key, v in zip(keys, reduced)}
            merged.update(loss=reduced[-1] / ranks.world, grad_norm=gnorm)
            for key, v in merged.items():
                totals[key] = totals.get(key, 0.0) + v
            steps += 1
    out = {k: v / max(steps, 1) for k, v in totals.items()}
    if entropy is not None:
        out["entropy"] = entropy
    out.update(mis)
    out["optimizer_steps"] = steps
    return out


def _first_minibatch_mismatch(logp: torch.Tensor, batch: dict[str, torch.Tensor], scale: float,
                              ranks: Ranks) -> dict[str, float]:
    """mismatch() over the first minibatch, from its (pre-step) forward, over the ranks."""
    m = (batch["response_mask"] > 0) & (scale > 0)
    return _mismatch_stats((logp.detach() - batch["rollout_logprobs"]).double()[m], ranks)
