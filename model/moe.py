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
"""

from __future__ import annotations

import torch
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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N,D] -> (affinities s [N,E] fp32, chosen [N,K] long, gates [N,K] fp32)."""
        s = F.linear(x.float(), self.weight.float()).sigmoid()
        chosen = torch.topk(s + self.e_score_correction_bias, self.k, dim=-1, sorted=False).indices
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


class MoE(nn.Module):
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
        s, chosen, g = self.gate(x.reshape(-1, D))
        y = self.experts(x.reshape(-1, D), chosen, g).view(B, T, D)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        with torch.no_grad():
            routed = chosen if token_mask is None else chosen[token_mask.reshape(-1)]
            load = torch.bincount(routed.reshape(-1), minlength=self.n_experts).float()
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
