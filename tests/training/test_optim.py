import math
from dataclasses import dataclass

import torch
import pytest
from torch import nn

from training.optim import (NS_COEFFS, Muon, MuonWithAdamW, build_optimizer, muon_update,
                            route_parameters, zeropower_via_newtonschulz5)

# Five quintic steps map every normalised singular value x in [0.01, 1] into [0.6818, 1.1344]
# (scalar map x -> a x + b x^3 + c x^5, evaluated on a grid in test_band_of_the_scalar_map).
BAND = (0.68, 1.14)


def _ns_scalar(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = NS_COEFFS
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


def _matrix(A, B, smin=1.0, smax=10.0, seed=0):
    """A random (A, B) matrix with singular values spread over [smin, smax]."""
    g = torch.Generator().manual_seed(seed)
    r = min(A, B)
    U, _ = torch.linalg.qr(torch.randn(A, r, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(B, r, generator=g, dtype=torch.float64))
    s = torch.linspace(smin, smax, r, dtype=torch.float64)
    return (U * s) @ V.T


def test_band_of_the_scalar_map():
    y = _ns_scalar(torch.logspace(-2, 0, 20001, dtype=torch.float64))
    assert BAND[0] <= y.min() and y.max() <= BAND[1]
    assert _ns_scalar(torch.tensor(1e-3, dtype=torch.float64)) < BAND[0]  # too small to reach it


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (3, 16, 24)])
def test_newton_schulz_singular_values(shape):
    G = torch.stack([_matrix(*shape[-2:], seed=i) for i in range(shape[0])]) if len(shape) == 3 \
        else _matrix(*shape)
    G = G.float()
    O = zeropower_via_newtonschulz5(G, dtype=torch.float32)
    assert O.shape == G.shape and O.dtype == G.dtype
    sv = torch.linalg.svdvals(O.double())
    x0 = torch.linalg.svdvals(G.double()) / torch.linalg.matrix_norm(G.double())[..., None]
    assert x0.min() >= 0.01                                   # inputs are well conditioned
    want = _ns_scalar(x0).sort(-1, descending=True).values  # the map is not monotone
    torch.testing.assert_close(sv, want, rtol=1e-4, atol=1e-4)  # NS acts on each sv alone
    assert BAND[0] <= sv.min() and sv.max() <= BAND[1]
    # same singular vectors as G: O G^T is symmetric positive semi-definite (rows case)
    P = O.double() @ G.double().mT
    torch.testing.assert_close(P, P.mT, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("shape", [(32, 64), (64, 32)])
def test_update_rms_is_about_0_2(shape):
    p = nn.Parameter(torch.zeros(shape))
    p.grad = _matrix(*shape, seed=1).float()
    opt = Muon([p], lr=1.0, weight_decay=0.0, momentum=0.0)
    opt.step()
    rms = p.detach().pow(2).mean().sqrt()
    # ||O||_F^2 = sum sv^2 over min(A,B) values in BAND; times 0.2 sqrt(max) / sqrt(A B)
    assert 0.2 * BAND[0] <= rms <= 0.2 * BAND[1]


def test_nesterov_momentum_and_weight_decay_by_hand():
    lr, wd, mu = 0.1, 0.05, 0.95
    p0 = torch.randn(8, 12, generator=torch.Generator().manual_seed(3))
    g1, g2 = _matrix(8, 12, seed=4).float(), _matrix(8, 12, seed=5).float()
    p = nn.Parameter(p0.clone())
    opt = Muon([p], lr=lr, weight_decay=wd, momentum=mu, ns_dtype=torch.float32)
    for g in (g1, g2):
        p.grad = g.clone()
        opt.step()
    scale = 0.2 * math.sqrt(12)
    buf1 = g1
    u1 = g1 + mu * buf1
    want = p0 * (1 - lr * wd) - lr * scale * zeropower_via_newtonschulz5(u1)
    buf2 = mu * buf1 + g2
    u2 = g2 + mu * buf2
    want = want * (1 - lr * wd) - lr * scale * zeropower_via_newtonschulz5(u2)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf2)
    torch.testing.assert_close(p.detach(), want)


def _head_block_svs(update, heads):
    return torch.linalg.svdvals(update.double().view(heads, update.shape[0] // heads, -1))


def test_muon_split_orthogonalises_each_head():
    # two heads whose gradients differ in scale by 1e3: only a per-head NS puts both in the band
    r, c = 6, 20
    grad = torch.cat([_matrix(r, c, seed=6), 1e-3 * _matrix(r, c, seed=7)]).float()  # (2r, c)
    scale_split = 0.2 * math.sqrt(max(r, c))
    for split in (2, 0):
        update = muon_update(grad, torch.zeros_like(grad), momentum=0.0, split_heads=split)
        if split:
            svs = _head_block_svs(update / scale_split, 2)
            assert BAND[0] <= svs.min() and svs.max() <= BAND[1]
        else:
            svs = _head_block_svs(update / (0.2 * math.sqrt(max(2 * r, c))), 2)
            assert svs[1].max() < BAND[0]                     # the small head is left behind


def test_packed_experts_are_a_batch_of_matrices():
    grad = torch.stack([_matrix(8, 16, seed=s) * 10 ** s for s in range(3)]).float()  # (E, A, B)
    update = muon_update(grad, torch.zeros_like(grad), momentum=0.0)
    for e in range(3):
        alone = muon_update(grad[e], torch.zeros_like(grad[e]), momentum=0.0)
        torch.testing.assert_close(update[e], alone)


def test_muon_refuses_flattened_parameters():
    p = nn.Parameter(torch.zeros(10))
    p.grad = torch.ones(10)
    with pytest.raises(ValueError, match="matrices"):
        Muon([p]).step()


def test_adamw_half_matches_torch_adamw():
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))
    a_ref, b_ref = nn.Parameter(a.detach().clone()), nn.Parameter(b.detach().clone())
    ours = MuonWithAdamW([dict(params=[a, b], algorithm="adamw")], lr=0.01, weight_decay=0.1)
    ref = torch.optim.AdamW([a_ref, b_ref], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        grads = [torch.randn(5, 3), torch.randn(7)]
        for p, g in zip((a, b, a_ref, b_ref), grads * 2):
            p.grad = g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, a_ref)
    torch.testing.assert_close(b, b_ref)


# ------------------------------------------------------------------------------------------
# routing on a toy model that uses GLM-5's parameter names

@dataclass
class _Config:
    num_attention_heads: int = 4


class _Attn(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.q_a_proj = nn.Linear(d, 8, bias=False)
        self.q_a_layernorm = nn.LayerNorm(8)
        self.q_b_proj = nn.Linear(8, heads * (4 + 2), bias=False)   # H * (qk_nope + qk_rope)
        self.kv_b_proj = nn.Linear(8, heads * (4 + 5), bias=False)  # H * (qk_nope + v_head)
        self.o_proj = nn.Linear(heads * 5, d, bias=False)


class _MoE(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gate = nn.Linear(d, 4, bias=False)
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(4))
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(4, 2 * 6, d))  # packed (E, A, B)


class _Layer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(d)
        self.self_attn = _Attn(d, heads)
        self.mlp = _MoE(d)


class _Toy(nn.Module):
    def __init__(self, d=16, heads=4, vocab=32, config=True, tied=False):
        super().__init__()
        if config:
            self.config = _Config(heads)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList([_Layer(d, heads)])
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight


def test_routing_by_name_and_shape():
    routes = route_parameters(_Toy())
    L = "model.layers.0."
    assert routes == {
        "model.embed_tokens.weight": "adamw",
        L + "input_layernorm.weight": "adamw",
        L + "self_attn.q_a_proj.weight": "muon",
        L + "self_attn.q_a_layernorm.weight": "adamw",
        L + "self_attn.q_a_layernorm.bias": "adamw",
        L + "self_attn.q_b_proj.weight": "muon_split",
        L + "self_attn.kv_b_proj.weight": "muon_split",
        L + "self_attn.o_proj.weight": "muon",
        L + "mlp.gate.weight": "muon",
        L + "mlp.gate.e_score_correction_bias": "adamw",
        L + "mlp.experts.gate_up_proj": "muon",
        "lm_head.weight": "adamw",
    }
    unsplit = route_parameters(_Toy(), muon_split=False)
    assert unsplit[L + "self_attn.q_b_proj.weight"] == "muon"
    assert set(route_parameters(_Toy(tied=True)).values()) == {"adamw", "muon", "muon_split"}
    assert "lm_head.weight" not in route_parameters(_Toy(tied=True))  # tied: listed once


def test_build_optimizer_groups_and_head_count():
    model = _Toy(heads=4)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    groups = {(g["algorithm"], g["split_heads"], g["weight_decay"]): len(g["params"])
              for g in opt.param_groups}
    assert groups == {("muon", 0, 0.1): 4, ("muon", 4, 0.1): 2, ("adamw", 0, 0.1): 2,
                      ("adamw", 0, 0.0): 4}
    # no config: the explicit head count is used; neither: a clear error
    opt = build_optimizer(_Toy(heads=2, config=False), 1e-3, 0.1, num_heads=2)
    assert {g["split_heads"] for g in opt.param_groups} == {0, 2}
    with pytest.raises(ValueError, match="num_heads"):
        build_optimizer(_Toy(config=False), 1e-3, 0.1)
    with pytest.raises(ValueError, match="disagrees"):
        build_optimizer(_Toy(heads=4), 1e-3, 0.1, num_heads=3)


def test_one_training_step_moves_every_parameter_and_state_round_trips():
    torch.manual_seed(0)
    model = _Toy()
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n]), n
    fresh = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.param_groups[1]["split_heads"] == 4
