"""MoE routing: top-k on affinity + bias, gates from unbiased affinities; bias balancing."""

import torch

from model.config import preset
from model.moe import MoE, update_router_bias


def _moe():
    torch.manual_seed(0)
    moe = MoE(preset("tiny"))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
    return moe


def test_routing_uses_bias_for_choice_but_not_for_gates():
    moe = _moe()
    x = torch.randn(64, 128)
    s0, chosen0, g0 = moe.gate(x)
    # A huge bias on experts 6 and 7 forces them to be chosen for every token ...
    moe.gate.e_score_correction_bias[6:] = 10.0
    s, chosen, g = moe.gate(x)
    assert torch.equal(s, s0)
    assert torch.equal(chosen.sort(-1).values, torch.tensor([6, 7]).expand(64, 2))
    # ... yet the gates are the UNBIASED affinities of 6 and 7, normalised, times 2.5
    sel = s.gather(1, chosen)
    assert torch.allclose(g, sel / sel.sum(-1, keepdim=True) * 2.5, atol=1e-6)
    assert not torch.allclose(g, (sel + 10) / (sel + 10).sum(-1, keepdim=True) * 2.5)


def test_bias_update_moves_toward_balance():
    moe = _moe().train()
    with torch.no_grad():
        moe.gate.weight[0] += 2.0  # expert 0 is everyone's favourite
    x = torch.randn(4, 32, 128)

    def load():
        with torch.no_grad():
            _, stats = moe(x)
        return stats["load"]

    first = load()
    assert moe.load_since_update.sum() == 4 * 32 * 2 and int(first.argmax()) == 0
    # gamma 0 only measures: max load over mean load (4*32*2/8 = 32 tokens), minus 1
    assert update_router_bias(moe, 0.0)["max_violation"] == first.max().item() / 32 - 1 > 0.8
    assert moe.load_since_update.sum() == 0                 # reset after each update
    late = []
    for step in range(50):
        load()
        late.append(update_router_bias(moe, gamma=0.05)["max_violation"])
    assert moe.gate.e_score_correction_bias[0] < 0          # the overloaded expert is pushed down
    # with a fixed step the loads settle into a small cycle: every late update is within 50%
    # of the mean load, against 90% before
    assert max(late[-10:]) < 0.5
    assert load().max() - load().min() < first.max() - first.min()


def test_bias_update_is_a_signed_step_per_expert():
    # two MoE layers, hand-set loads: b_i += gamma * sign(mean - load_i), 0 where load_i == mean
    layers = torch.nn.ModuleList([_moe(), _moe()])
    a, b = layers[0], layers[1]
    a.gate.e_score_correction_bias[:] = torch.arange(8.0) / 10
    a.load_since_update[:] = torch.tensor([10., 2., 4., 4., 0., 6., 4., 2.])    # mean 4
    b.load_since_update[:] = torch.tensor([1., 1., 1., 1., 1., 1., 1., 9.])      # mean 2
    out = update_router_bias(layers, gamma=0.25)
    assert torch.equal(a.gate.e_score_correction_bias,
                       torch.arange(8.0) / 10 + 0.25 * torch.tensor([-1., 1., 0., 0., 1., -1., 0., 1.]))
    assert torch.equal(b.gate.e_score_correction_bias, torch.tensor([.25] * 7 + [-.25]))
    # mean over layers of max/mean - 1: (10/4 - 1 + 9/2 - 1) / 2
    assert out["max_violation"] == (1.5 + 3.5) / 2
    assert a.load_since_update.sum() == 0 and b.load_since_update.sum() == 0
    # a layer that saw no tokens keeps its bias and does not count in the mean
    a.load_since_update[:] = torch.tensor([3., 1., 1., 1., 1., 1., 1., 7.])      # mean 2
    before_b = b.gate.e_score_correction_bias.clone()
    assert update_router_bias(layers, gamma=0.25)["max_violation"] == 7 / 2 - 1
    assert torch.equal(b.gate.e_score_correction_bias, before_b)


def test_balance_loss_and_load_stats_in_forward(tiny_model):
    x = torch.randint(0, 8192, (2, 50))
    out = tiny_model.train()(x, labels=x)
    E = tiny_model.config.n_routed_experts
    assert len(out.expert_load) == 3 + 3        # 3 MoE layers + the MTP block at 3 steps
    assert all(load.shape == (E,) and load.sum() == 2 * 50 * 2 for load in out.expert_load)
    assert out.losses["balance"] > 0


def test_all_experts_decode_path_equals_expert_loop():
    moe = _moe()
    x = torch.randn(5, 128)
    s, chosen, g = moe.gate(x)
    loop = torch.zeros_like(x)
    for n in range(5):  # the definition, token by token
        for k in range(2):
            e = int(chosen[n, k])
            gate, up = (moe.experts.gate_up_proj[e] @ x[n]).chunk(2)
            loop[n] += g[n, k] * (moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    assert 5 * 8 <= moe.experts.dense_max
    assert torch.allclose(moe.experts(x, chosen, g), loop, atol=1e-5)            # all-experts path
    big = x.repeat(4, 1)                                                         # 20 tokens: loop path
    s2, c2, g2 = moe.gate(big)
    assert torch.allclose(moe.experts(big, c2, g2), loop.repeat(4, 1), atol=1e-5)


def test_router_bias_stays_fp32_under_bf16():
    from model.model import GLMModel
    m = GLMModel(preset("tiny")).to(torch.bfloat16).train()
    moe = m.layers[1].mlp
    assert moe.gate.weight.dtype == torch.bfloat16
    assert moe.gate.e_score_correction_bias.dtype == torch.float32 and moe.load_since_update.dtype == torch.float32
    x = torch.randint(0, 8192, (1, 40))
    m(x[:, :-1], labels=x[:, 1:]).loss.backward()
    update_router_bias(m, 1e-3)   # a 1e-3 step survives (it would round away in bf16 at |b| >= 0.5)
    b = moe.gate.e_score_correction_bias
    assert b.abs().max() > 0 and torch.all((b == 0) | torch.isclose(b.abs(), torch.tensor(1e-3)))
