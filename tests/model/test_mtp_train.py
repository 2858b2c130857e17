"""MTP: one module shared by all D steps; the loss pieces; a short training run."""

import pytest
import torch

from model.config import preset
from model.model import GLMModel, freeze_all_but_indexer, unfreeze_all


def test_mtp_is_one_module_used_for_every_step(tiny_model):
    cfg = tiny_model.config
    assert cfg.mtp_depth == 3
    assert sum(1 for n, _ in tiny_model.named_parameters() if n.endswith("eh_proj.weight")) == 1
    x = torch.randint(0, 8192, (2, 40))
    out = tiny_model.train()(x[:, :-1], labels=x[:, 1:])
    assert {"lm", "mtp", "balance", "mtp_1", "mtp_2", "mtp_3"} <= set(out.losses)
    assert torch.allclose(out.losses["mtp"], 0.3 / 3 * (out.losses["mtp_1"] + out.losses["mtp_2"] + out.losses["mtp_3"]))
    # every step sends gradient into the SAME eh_proj weight
    grads = []
    for k in (1, 2, 3):
        tiny_model.zero_grad()
        tiny_model(x[:, :-1], labels=x[:, 1:]).losses[f"mtp_{k}"].backward()
        grads.append(tiny_model.mtp.eh_proj.weight.grad.clone())
    assert all(g.abs().sum() > 0 for g in grads)
    assert not torch.allclose(grads[0], grads[2])


def test_mtp_targets_stay_inside_documents(tiny_model):
    # Packed [A | B] must give exactly the per-document MTP losses: no step-k target crosses
    # the boundary (without the doc mask, A's last positions would predict B's tokens).
    a, b = torch.randint(0, 8192, (1, 10)), torch.randint(0, 8192, (1, 10))
    la, lb = a.roll(-1, 1), b.roll(-1, 1)
    la[0, -1] = lb[0, -1] = -100                      # a document's last token predicts nothing
    with torch.no_grad():
        pa, pb = tiny_model(a, labels=la).losses, tiny_model(b, labels=lb).losses
        packed = tiny_model(torch.cat([a, b], 1), labels=torch.cat([la, lb], 1),
                            doc_ids=torch.tensor([[0] * 10 + [1] * 10])).losses
    for k in (1, 2, 3):
        n = 9 - k                                     # valid step-k targets per document
        assert torch.allclose(packed[f"mtp_{k}"], (pa[f"mtp_{k}"] * n + pb[f"mtp_{k}"] * n) / (2 * n), atol=1e-5)
    assert torch.allclose(packed["lm"], (pa["lm"] + pb["lm"]) / 2, atol=1e-5)


def test_loss_goes_down_on_a_fixed_batch():
    torch.manual_seed(0)
    model = GLMModel(preset("tiny")).train()
    x = torch.randint(0, 8192, (2, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        out = model(x[:, :-1], labels=x[:, 1:])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.losses["lm"].item())
    assert losses[-1] < 0.5 * losses[0]
    assert out.losses["mtp"].item() < 9.0 * 0.3  # below the uniform-guess loss ln(8192)*0.3 = 2.7


def test_freeze_all_but_indexer(tiny_model):
    params = freeze_all_but_indexer(tiny_model)
    trainable = {n for n, p in tiny_model.named_parameters() if p.requires_grad}
    assert trainable and all(".indexer." in n for n in trainable)
    assert len(params) == len(trainable)
    unfreeze_all(tiny_model)
    assert all(p.requires_grad for p in tiny_model.parameters())


def test_config_validation_errors():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        preset("tiny", num_experts_per_tok=99)
    with pytest.raises(ValueError, match="attention_pattern"):
        preset("tiny", attention_pattern=("full",))
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("huge")
    with pytest.raises(ValueError):
        preset("tiny", hidden_size=0)
