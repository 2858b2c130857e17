"""Muon (with GLM-5's Muon Split) for hidden matrices, AdamW for everything else.

Muon, per matrix parameter W (A, B) with gradient G:

    buf = mu * buf + G                     Nesterov momentum, Moonlight form (mu = 0.95)
    U   = G + mu * buf
    O   = NS5(U)                           Newton-Schulz quintic, ~ the orthogonal factor of U
    W  <- W - lr * (0.2 * sqrt(max(A, B)) * O + wd * W)      Moonlight Eq. 4

NS5: X0 = U / (||U||_F + 1e-7) (transposed first when A > B), then five times
X <- a X + (b XX^T + c (XX^T)^2) X with (a, b, c) = (3.4445, -4.7750, 2.0315). Each singular
value x of X0 follows the scalar map x -> a x + b x^3 + c x^5, which does not converge to 1 but
lands in about [0.68, 1.13] for every x in [0.01, 1] after five steps. The 0.2 * sqrt(max(A, B))
factor gives the update an RMS of about 0.2, AdamW's typical update RMS, so Muon reuses AdamW's
lr and weight decay (Moonlight).

- A 3-D parameter (E, A, B), e.g. packed MoE experts, is a batch of E matrices.
- Muon Split (GLM-5): a param group with split_heads = H views a (H * r, c) matrix as (H, r, c)
  and orthogonalises each head block on its own, scaled by 0.2 * sqrt(max(r, c)), so heads can
  move at different scales. `build_optimizer` applies it to MLA's q_b_proj and kv_b_proj.
- NS runs in `ns_dtype`: bf16 on CUDA (the reference recipe; tensor cores, and the iteration is
  robust to the rounding), float32 on CPU (CPU bf16 matmuls are slow or emulated, and the tests
  check singular values tightly). The update is cast back to the parameter's dtype.

`MuonWithAdamW` is one torch.optim.Optimizer holding both families (a param group's
"algorithm" is "muon" or "adamw"), so a trainer, a checkpoint and an LR scheduler see a single
optimizer. DeepSpeed 0.19.8 takes it as `deepspeed.initialize(optimizer=...)` at ZeRO stage 0:
in fp32 the steps are bit-identical to plain torch; with bf16 on, DeepSpeed wraps it in an
unfused mixed-precision optimizer that keeps per-parameter fp32 masters, so Muon still sees
matrices. ZeRO 1 and 2 (which also need "zero_allow_untested_optimizer": true) hand the
optimizer flattened 1-D partitions, which Muon cannot orthogonalise, so `step` raises a
ValueError rather than silently degrading to SGD. (DeepSpeed's own Muon integration is tied to
its MuonWithAuxAdam class and Keller's update, without Muon Split.)
"""

import math

import torch
from torch import nn

NS_COEFFS = (3.4445, -4.7750, 2.0315)
MUON_RMS = 0.2                                                 # Moonlight Eq. 4


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 5,
                                dtype: torch.dtype | None = None) -> torch.Tensor:
    """G (..., A, B) -> approximately orthogonal (..., A, B), batched over leading dims."""
    if G.dim() < 2:
        raise ValueError(f"G must have at least 2 dims, got shape {tuple(G.shape)}")
    a, b, c = NS_COEFFS
    if dtype is None:
        dtype = torch.bfloat16 if G.is_cuda else torch.float32
    X = G.to(dtype)
    transposed = G.shape[-2] > G.shape[-1]
    if transposed:
        X = X.mT                                               # (..., B, A): fewer rows
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)        # every singular value <= 1
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    if transposed:
        X = X.mT
    return X.to(G.dtype)


def muon_update(grad: torch.Tensor, buf: torch.Tensor, momentum: float = 0.95,
                nesterov: bool = True, split_heads: int = 0, ns_steps: int = 5,
                ns_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Advance the momentum buffer in place and return the scaled, orthogonalised update."""
    buf.mul_(momentum).add_(grad)
    u = grad.add(buf, alpha=momentum) if nesterov else buf
    if split_heads:
        if u.dim() != 2 or u.shape[0] % split_heads:
            raise ValueError(f"split_heads={split_heads} needs a 2-D matrix whose rows divide "
                             f"into heads, got shape {tuple(u.shape)}")
        u = u.view(split_heads, u.shape[0] // split_heads, u.shape[1])  # (H, r, c)
    o = zeropower_via_newtonschulz5(u, ns_steps, ns_dtype)
    o = o * (MUON_RMS * math.sqrt(max(u.shape[-2], u.shape[-1])))
    return o.reshape(grad.shape)


def _muon_group_step(state: dict, group: dict) -> None:
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.dim() < 2:
            raise ValueError(f"Muon got a parameter of shape {tuple(p.shape)}: it needs matrices "
                             "(a flattened ZeRO partition cannot be orthogonalised; use "
                             "DeepSpeed ZeRO stage 0)")
        st = state[p]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(p.grad)
        update = muon_update(p.grad, st["momentum_buffer"], group["momentum"], group["nesterov"],
                             group["split_heads"], group["ns_steps"], group["ns_dtype"])
        p.mul_(1 - group["lr"] * group["weight_decay"])        # decoupled weight decay
        p.add_(update, alpha=-group["lr"])


def _adamw_group_step(state: dict, group: dict) -> None:
    beta1, beta2 = group["betas"]
    for p in group["params"]:
        if p.grad is None:
            continue
        g = p.grad
        st = state[p]
        if "step" not in st:
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
        st["step"] += 1
        bias1 = 1 - beta1 ** st["step"]
        bias2 = 1 - beta2 ** st["step"]
        p.mul_(1 - group["lr"] * group["weight_decay"])
        st["exp_avg"].lerp_(g, 1 - beta1)
        st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (st["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(group["eps"])
        p.addcdiv_(st["exp_avg"], denom, value=-group["lr"] / bias1)


class Muon(torch.optim.Optimizer):
    """Muon for matrix (or batched-matrix) parameters only. Group option: split_heads (0 = off)."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, split_heads: int = 0,
                 ns_steps: int = 5, ns_dtype: torch.dtype | None = None):
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if split_heads < 0:
            raise ValueError(f"split_heads must be >= 0, got {split_heads}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        split_heads=split_heads, ns_steps=ns_steps, ns_dtype=ns_dtype)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _muon_group_step(self.state, group)
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer, two families: groups with algorithm="muon" or algorithm="adamw"."""

    def __init__(self, param_groups: list[dict], lr: float = 1e-3, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 ns_dtype: torch.dtype | None = None):
        for g in param_groups:
            if g.get("algorithm") not in ("muon", "adamw"):
                raise ValueError(f"each param group needs algorithm 'muon' or 'adamw', "
                                 f"got {g.get('algorithm')!r}")
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                        momentum=momentum, nesterov=nesterov, split_heads=0, ns_steps=ns_steps,
                        ns_dtype=ns_dtype)
        super().__init__(param_groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                _muon_group_step(self.state, group)
            else:
                _adamw_group_step(self.state, group)
        return loss


# ------------------------------------------------------------------------------------------
# parameter routing

MLA_UP_PROJECTIONS = ("self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight")


def route_parameters(model: nn.Module, muon_split: bool = True) -> dict[str, str]:
    """Name -> "muon", "muon_split" or "adamw" for every trainable parameter.

    AdamW: anything with ndim < 2 (norms, biases, router bias), nn.Embedding weights and the
    output head (names containing "lm_head", or tied to an embedding). Muon: every other
    parameter with ndim >= 2. With muon_split, the MLA up-projections q_b_proj and kv_b_proj
    are "muon_split" (orthogonalised per attention head).
    """
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
                     for p in m.parameters(recurse=False)}
    routes = {}
    for name, p in model.named_parameters():                   # tied params appear once
        if not p.requires_grad:
            continue
        if p.dim() < 2 or id(p) in embedding_ids or "lm_head" in name:
            routes[name] = "adamw"
        elif muon_split and name.endswith(MLA_UP_PROJECTIONS):
            routes[name] = "muon_split"
        else:
            routes[name] = "muon"
    return routes


def _num_heads(model: nn.Module, num_heads: int | None) -> int | None:
    config = getattr(model, "config", None)
    from_config = getattr(config, "num_attention_heads", None)
    if from_config is not None and num_heads is not None and from_config != num_heads:
        raise ValueError(f"num_heads={num_heads} disagrees with "
                         f"model.config.num_attention_heads={from_config}")
    return from_config if from_config is not None else num_heads


def build_optimizer(model: nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    muon_split: bool = True, momentum: float = 0.95,
                    num_heads: int | None = None,
                    ns_dtype: torch.dtype | None = None) -> MuonWithAdamW:
    """Muon for hidden matrices (per-head for MLA up-projections), AdamW for the rest.

    Weight decay applies to every matrix (Muon's and AdamW's embeddings / head) and not to
    ndim < 2 parameters (norm gains, biases), as in nanoGPT. The head count for Muon Split comes
    from model.config.num_attention_heads, else from `num_heads`.
    """
    routes = route_parameters(model, muon_split)
    params = dict(model.named_parameters())
    by_route = {"muon": [], "muon_split": [], "adamw_decay": [], "adamw_no_decay": []}
    for name, route in routes.items():
        p = params[name]
        if route == "adamw":
            route = "adamw_decay" if p.dim() >= 2 else "adamw_no_decay"
        by_route[route].append(p)
    groups = []
    if by_route["muon"]:
        groups.append(dict(params=by_route["muon"], algorithm="muon", split_heads=0))
    if by_route["muon_split"]:
        heads = _num_heads(model, num_heads)
        if heads is None:
            raise ValueError("muon_split needs the head count: give the model a config with "
                             "num_attention_heads or pass num_heads")
        for p in by_route["muon_split"]:
            if p.dim() != 2 or p.shape[0] % heads:
                raise ValueError(f"cannot split a parameter of shape {tuple(p.shape)} into "
                                 f"{heads} heads")
        groups.append(dict(params=by_route["muon_split"], algorithm="muon", split_heads=heads))
    if by_route["adamw_decay"]:
        groups.append(dict(params=by_route["adamw_decay"], algorithm="adamw"))
    if by_route["adamw_no_decay"]:
        groups.append(dict(params=by_route["adamw_no_decay"], algorithm="adamw", weight_decay=0.0))
    return MuonWithAdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                         momentum=momentum, ns_dtype=ns_dtype)
