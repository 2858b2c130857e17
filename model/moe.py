"""Feed-forward blocks: the dense SwiGLU MLP and the DeepSeek-style MoE.

Shape legend: B batch, T tokens, N = B*T tokens flattened, D hidden, E routed experts,
K experts per token, I expert width.

MoE routing (fp32):
    s = sigmoid(x . W_gate^T)                            affinities       [N,E]
    chosen = top-K of (s + b)                            b: e_score_correction_bias, routing only
    g = s[chosen] / sum(s[chosen]) * routed_scaling_factor   gates use the UNBIASED affinities
    y = shared_expert(x) + sum_k g_k * expert_k(x)
Balancing is auxiliary-loss-free: after each optimiser step `update_router_bias` nudges b
toward equal load (b_i += gamma * sign(mean_load - load_i)); a small sequence-wise balance
loss (alpha) is the complement.

Expert parallelism (off by default; `shard_experts(model, group)` turns it on): each rank of the
group keeps E/R experts and its own tokens. The router, the shared expert and the balance loss
stay per rank (replicated weights, local tokens); each (token, slot) is sent to the rank that
owns its expert with all_to_all_single, the expert output comes back the same way and is
weighted by the gate on the token's own rank (so router gradients stay local). Loads are summed
over the group, so every rank makes the same bias update. Gradients: replicated weights are
averaged over the group like data parallelism, expert weights divided by the group size
(`sync_ep_gradients`), which equals one rank training on the concatenated batch.
`gathered_state_dict` puts the full model's state dict back together (the export). The DeepSpeed
training loop's use of all this (groups, gradient reduction, checkpoints): training.expert_parallel.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _keep_fp32(module: nn.Module, apply, fn, recurse, name: str) -> nn.Module:
    # model.to(bfloat16) must not round these buffers: steps of gamma = 1e-3 vanish in bf16,
    # and token counts above 256 stop being exact. Device moves still apply.
    saved = getattr(module, name).float().clone()
    apply(fn, recurse)
    setattr(module, name, saved.to(getattr(module, name).device))
    return module


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.k, self.scaling = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        # A buffer, not a parameter: the optimiser never touches it, update_router_bias does.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def _apply(self, fn, recurse=True):
        return _keep_fp32(self, super()._apply, fn, recurse, "e_score_correction_bias")

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N,D] -> (affinities s [N,E] fp32, chosen [N,K] long, gates [N,K] fp32).
        replay [N,K]: experts to use instead of the top-k where >= 0 (routing replay); the gates
        are still the current affinities of those experts, so the router keeps its gradient."""
        s = F.linear(x.float(), self.weight.float()).sigmoid()
        chosen = torch.topk(s + self.e_score_correction_bias, self.k, dim=-1, sorted=False).indices
        if replay is not None:
            chosen = torch.where(replay >= 0, replay.long(), chosen)
        g = s.gather(1, chosen)
        g = g / (g.sum(-1, keepdim=True) + 1e-20) * self.scaling
        return s, chosen, g


class Experts(nn.Module):
    """All routed experts as packed 3-D weights (the HF layout: gate and up fused)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """x [N,D], chosen/gates [N,K] -> [N,D]. Loops over experts that got tokens; for a
        handful of tokens (decoding) runs all experts at once instead."""
        if x.shape[0] * self.gate_up_proj.shape[0] <= self.dense_max:
            return self._all_experts(x, chosen, gates)
        y = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            tok, slot = torch.where(chosen == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.down_proj[e]) * gates[tok, slot, None]
            y.index_add_(0, tok, h.to(y.dtype))
        return y

    def apply_each(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Row i of x through expert[i] (a local index), ungated: x [M,D] -> [M,D]."""
        y = x.new_zeros(x.shape)
        for e in expert.unique().tolist():
            rows = torch.where(expert == e)[0]
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = y.index_add(0, rows, F.linear(F.silu(gate) * up, self.down_proj[e]))
        return y

    dense_max = 64  # tokens x experts up to which computing every expert beats the loop

    def _all_experts(self, x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        # Decoding sees a few tokens: run them through every expert (3 einsums, no gather, no
        # per-expert Python loop) and weight the outputs, zero for experts not chosen.
        w = torch.zeros(x.shape[0], self.gate_up_proj.shape[0], dtype=gates.dtype, device=x.device)
        w.scatter_(1, chosen, gates)                                              # [N,E]
        E, I2, D = self.gate_up_proj.shape
        gate, up = F.linear(x, self.gate_up_proj.view(E * I2, D)).view(-1, E, I2).chunk(2, dim=-1)
        a = (F.silu(gate) * up).transpose(0, 1)                                  # [E,N,I]
        h = torch.bmm(a, self.down_proj.transpose(1, 2))                         # [E,N,D]
        return (w.t().to(h.dtype)[..., None] * h).sum(0)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with its gradient (the reverse exchange). gloo implements
    all_to_all_single on CPU (uneven splits included) and NCCL on GPU, so one path serves both."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.exchange = (out_splits, in_splits, group)
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group = ctx.exchange
        g = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=group)
        return g, None, None, None


class MoE(nn.Module):
    ep_group = None  # expert-parallel process group; None = every expert on this rank
    ep_rank, ep_size = 0, 1
    # routing replay (recording_routes / replaying_routes): a list each forward appends its
    # chosen experts [B,T,K] to, and the experts [B,T,K] a forward must use (-1: route as usual)
    record: list | None = None
    replay: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) \
            if cfg.n_shared_experts > 0 else None
        # Tokens routed to each expert since the last update_router_bias (training only).
        self.register_buffer("load_since_update", torch.zeros(cfg.n_routed_experts), persistent=False)

    def _apply(self, fn, recurse=True):
        return _keep_fp32(self, super()._apply, fn, recurse, "load_since_update")

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """x [B,T,D], token_mask [B,T] bool (False = padding) -> (y [B,T,D], stats).

        stats: "load" [E] tokens per expert in this batch, "balance" the sequence-wise balance
        term sum_i f_i P_i averaged over sequences (times alpha by the caller; None when
        gradients are off).
        """
        B, T, D = x.shape
        s, chosen, g = self.gate(x.reshape(-1, D), None if self.replay is None else self.replay.reshape(-1, self.k))
        if self.record is not None:
            self.record.append(chosen.detach().view(B, T, -1).to(torch.int16))
        if self.ep_group is None:
            y = self.experts(x.reshape(-1, D), chosen, g).view(B, T, D)
        else:
            y = self._experts_ep(x.reshape(-1, D), chosen, g).view(B, T, D)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        with torch.no_grad():
            routed = chosen if token_mask is None else chosen[token_mask.reshape(-1)]
            load = torch.bincount(routed.reshape(-1), minlength=self.n_experts).float()
            if self.ep_group is not None:  # the group's load: every rank updates the bias alike
                dist.all_reduce(load, group=self.ep_group)
            if self.training:
                self.load_since_update += load
        if not torch.is_grad_enabled():   # inference: the balance term is a training loss
            return y, {"load": load, "balance": None}
        # DeepSeek-V3 eq. 17-20: f_i = E/(K*T) * count_i, P_i = mean_t s_i / sum_j s_j, per sequence.
        m = torch.ones(B, T, dtype=torch.bool, device=x.device) if token_mask is None else token_mask
        hits = F.one_hot(chosen, self.n_experts).sum(1).view(B, T, -1).float() * m[..., None]  # [B,T,E]
        n_tok = m.sum(1).clamp(min=1).float()                                  # [B]
        f = hits.sum(1) * self.n_experts / (self.k * n_tok[:, None])           # [B,E]
        p = ((s / s.sum(-1, keepdim=True)).view(B, T, -1) * m[..., None]).sum(1) / n_tok[:, None]
        return y, {"load": load, "balance": (f * p).sum(-1).mean()}

    def _experts_ep(self, x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Experts over the EP group: x [N,D], chosen/gates [N,K] -> [N,D]."""
        K = chosen.shape[1]
        per_rank = self.n_experts // self.ep_size
        e = chosen.reshape(-1)
        order = torch.argsort(e // per_rank, stable=True)          # (token, slot) grouped by owner
        tok = order // K
        send_counts = torch.bincount(e // per_rank, minlength=self.ep_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        local_e = torch.empty(sum(recv), dtype=e.dtype, device=e.device)
        dist.all_to_all_single(local_e, e[order] % per_rank, recv, send, group=self.ep_group)
        xs = _AllToAll.apply(x[tok], recv, send, self.ep_group)
        back = _AllToAll.apply(self.experts.apply_each(xs, local_e), send, recv, self.ep_group)
        w = gates.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, tok, (back * w).to(x.dtype))


def trunk_moe(model: nn.Module) -> list["MoE"]:
    """The MoE layers a forward for log-probs runs, in order: not the MTP head's (generation and
    the RL forward never run it)."""
    return [m for name, m in model.named_modules() if isinstance(m, MoE) and not name.startswith("mtp.")]


@contextmanager
def recording_routes(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Within the block every trunk MoE layer appends the experts it chose, [B,T,K] int16 per
    forward, to its list (one list per layer, in order): a rollout's routes, for replay."""
    layers = trunk_moe(model)
    logs: list[list[torch.Tensor]] = [[] for _ in layers]
    for m, log in zip(layers, logs):
        m.record = log
    try:
        yield logs
    finally:
        for m in layers:
            m.record = None


@contextmanager
def replaying_routes(model: nn.Module, routes: list[torch.Tensor] | None) -> Iterator[None]:
    """Within the block each trunk MoE layer uses the experts `routes[i]` [B,T,K] names (-1: its
    own top-k) for a forward over [B,T] tokens. None: nothing changes."""
    layers = trunk_moe(model) if routes is not None else []
    if routes is not None and len(routes) != len(layers):
        raise ValueError(f"routes for {len(routes)} MoE layers, the model has {len(layers)}")
    for m, r in zip(layers, routes or []):
        m.replay = r
    try:
        yield
    finally:
        for m in layers:
            m.replay = None


def shard_experts(model: nn.Module, group=None) -> None:
    """Expert parallelism over `group` (default: the world): every MoE keeps the experts
    [rank*E/R, (rank+1)*E/R) and dispatches tokens to the others with all-to-all. Call after
    initialising (or loading) the full model identically on every rank."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    for m in model.modules():
        if isinstance(m, MoE):
            if m.n_experts % size:
                raise ValueError(f"n_routed_experts={m.n_experts} is not divisible by the expert-parallel size {size}")
            n = m.n_experts // size
            ex = m.experts
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(ex, name)
                setattr(ex, name, nn.Parameter(full.detach()[rank * n : (rank + 1) * n].clone(),
                                               requires_grad=full.requires_grad))
            m.ep_group, m.ep_rank, m.ep_size = group if group is not None else dist.group.WORLD, rank, size


@torch.no_grad()
def gathered_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the whole model from an expert-parallel one: each sharded MoE's expert
    tensors all-gathered over its group (in rank order: experts 0..E-1), everything else as
    this rank holds it. A collective: every rank of every EP group calls it."""
    state = dict(model.state_dict())
    for name, m in model.named_modules():
        if isinstance(m, MoE) and m.ep_group is not None:
            for pname, p in m.experts.named_parameters():
                parts = [torch.empty_like(p) for _ in range(m.ep_size)]
                dist.all_gather(parts, p.detach().contiguous(), group=m.ep_group)
                state[f"{name}.experts.{pname}" if name else f"experts.{pname}"] = torch.cat(parts)
    return state


@torch.no_grad()
def sync_ep_gradients(model: nn.Module, group=None) -> None:
    """After backward on an EP model whose ranks saw different tokens: average replicated
    weights' gradients over the group (data parallelism) and divide sharded experts' by the
    group size (they already hold the sum over every rank's tokens)."""
    size = dist.get_world_size(group)
    sharded = {id(p) for m in model.modules() if isinstance(m, MoE) and m.ep_group is not None
               for p in m.experts.parameters()}
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) not in sharded:
            dist.all_reduce(p.grad, group=group)
        p.grad.div_(size)


@torch.no_grad()
def update_router_bias(model: nn.Module, gamma: float) -> dict[str, float]:
    """Aux-loss-free balancing, once per optimiser step: b_i += gamma * sign(mean_load - load_i)
    from the loads accumulated since the previous call, then reset them. Returns the mean
    max-violation (max load / mean load - 1) over MoE layers for logging."""
    viol = []
    for m in model.modules():
        if isinstance(m, MoE):
            load = m.load_since_update
            if load.sum() > 0:
                m.gate.e_score_correction_bias += gamma * torch.sign(load.mean() - load)
                viol.append((load.max() / load.mean() - 1).item())
            load.zero_()
    return {"max_violation": sum(viol) / len(viol) if viol else 0.0}
