import pydantic
import pytest
import torch

import quant.qat as qat
from kernels.int4 import int4_scales
from model.model import GLMModel
from quant.qat import (
    Int4Experts,
    Int4Linear,
    QATConfig,
    convert_int4,
    int4_bytes,
    load_int4_model,
    prepare_qat,
    ptq_int4,
    quantized_tensor_names,
    remove_qat,
    save_int4,
)
from tests.posttrain.conftest import small_model

ALL_ON = QATConfig(indexer=True, head=True, embeddings=True)


def ids_and_labels(n: int = 48, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (2, n), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def raw(model: GLMModel, name: str) -> torch.Tensor:
    mod, _, p = name.rpartition(".")
    return model.get_submodule(mod)._parameters[p]


def test_config_is_frozen_strict_and_validated():
    cfg = QATConfig()
    assert cfg.group_size == 32 and not cfg.embeddings and not cfg.head and not cfg.indexer
    with pytest.raises(pydantic.ValidationError):
        QATConfig(groupsize=32)
    with pytest.raises(pydantic.ValidationError):
        QATConfig(group_size=33)
    with pytest.raises(pydantic.ValidationError):
        cfg.group_size = 64


def test_selection_by_module_kind():
    m = small_model()
    names = quantized_tensor_names(m, QATConfig())
    assert "layers.0.self_attn.kv_b_proj.weight" in names and "layers.0.mlp.down_proj.weight" in names
    assert {"layers.1.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj",
            "layers.1.mlp.shared_experts.up_proj.weight", "mtp.eh_proj.weight",
            "mtp.block.mlp.experts.down_proj"} <= set(names)
    assert not any(".indexer." in n or "lm_head" in n or "embed" in n or n.endswith("mlp.gate.weight") for n in names)
    assert not any(".self_attn." in n for n in quantized_tensor_names(m, QATConfig(attention=False)))
    assert not any(n.startswith("mtp.") for n in quantized_tensor_names(m, QATConfig(mtp=False)))
    assert not any(".experts." in n for n in quantized_tensor_names(m, QATConfig(experts=False)))
    all_on = quantized_tensor_names(m, ALL_ON)
    assert {"lm_head.weight", "embed_tokens.weight", "layers.0.self_attn.indexer.wk.weight"} <= set(all_on)
    with pytest.raises(ValueError, match="does not divide the input dim"):
        quantized_tensor_names(m, QATConfig(group_size=48))


def test_names_unchanged_and_checkpoints_load_both_ways():
    m = small_model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    prepare_qat(m, ALL_ON)
    after = m.state_dict()
    assert list(after) == list(before) and all(torch.equal(before[k], after[k]) for k in before)
    assert {n for n, _ in m.named_parameters()} == {n for n, _ in small_model().named_parameters()}
    plain = small_model(seed=3)
    plain.load_state_dict(after, strict=True)                 # QAT checkpoint -> plain model
    m.load_state_dict(small_model(seed=4).state_dict(), strict=True)   # and back
    with pytest.raises(ValueError, match="already prepared"):
        prepare_qat(m, ALL_ON)


def test_fake_quant_error_bound_and_grid():
    m = small_model()
    cfg = ALL_ON
    names = prepare_qat(m, cfg)
    for name in names:
        mod, _, p = name.rpartition(".")
        w = raw(m, name).detach()
        w_hat = getattr(m.get_submodule(mod), p).detach()
        assert w_hat.shape == w.shape and not torch.equal(w_hat, w)
        s = int4_scales(w.reshape(-1, w.shape[-1]), cfg.group_size).repeat_interleave(cfg.group_size, -1).view(w.shape)
        assert torch.all((w_hat - w).abs() <= 0.5 * s * (1 + 1e-5)), name        # half a step at most
        q = w_hat / s
        assert torch.allclose(q, q.round(), atol=1e-4) and q.min() >= -8 - 1e-4 and q.max() <= 7 + 1e-4
    # the router and norms are never quantized
    assert torch.equal(m.layers[1].mlp.gate.weight, m.layers[1].mlp.gate._parameters["weight"])
    assert type(m.layers[1].mlp.gate).__name__ == "Router"
    assert type(m.norm).__name__ == "RMSNorm"


def test_ste_gradient_through_the_model():
    """QAT grads wrt the raw weights = grads of a model holding the quantized weights, masked
    where round(w / s) left [-8, 7] (the group maximum rounds to 8: clamped, no gradient)."""
    cfg = QATConfig()
    ids, labels = ids_and_labels()
    m = small_model()
    names = prepare_qat(m, cfg)
    m(ids, labels=labels).loss.backward()

    baked = small_model()
    prepare_qat(baked, cfg)
    remove_qat(baked, bake=True)
    baked(ids, labels=labels).loss.backward()

    n_blocked = 0
    for name in names:
        w = raw(m, name).detach()
        w2 = w.reshape(-1, w.shape[-1])
        s = int4_scales(w2, cfg.group_size).repeat_interleave(cfg.group_size, -1)
        in_range = ((torch.round(w2 / s) >= -8) & (torch.round(w2 / s) <= 7)).view(w.shape)
        n_blocked += int((~in_range).sum())
        g_qat, g_ref = raw(m, name).grad, raw(baked, name).grad
        assert g_qat is not None and g_qat.abs().sum() > 0, name
        torch.testing.assert_close(g_qat, g_ref * in_range, rtol=1e-4, atol=1e-7, msg=name)
    assert n_blocked > 0                       # the clamp mask is exercised
    for n, p in m.named_parameters():          # unquantized parameters: the same gradient too
        if n not in names and p.grad is not None:
            torch.testing.assert_close(p.grad, dict(baked.named_parameters())[n].grad, rtol=1e-4, atol=1e-7)


def test_remove_qat_restores_or_bakes():
    m = small_model()
    w0 = m.layers[0].self_attn.o_proj.weight.detach().clone()
    prepare_qat(m, QATConfig())
    fq = m.layers[0].self_attn.o_proj.weight.detach().clone()
    remove_qat(m)
    assert type(m.layers[0].self_attn.o_proj) is torch.nn.Linear
    assert torch.equal(m.layers[0].self_attn.o_proj.weight, w0)
    prepare_qat(m, QATConfig())
    remove_qat(m, bake=True)
    assert torch.equal(m.layers[0].self_attn.o_proj.weight, fq)


def test_ptq_copy_matches_fake_quant_and_leaves_the_original():
    m = small_model().eval()
    w0 = m.layers[1].mlp.experts.gate_up_proj.detach().clone()
    ptq = ptq_int4(m, QATConfig())
    assert torch.equal(m.layers[1].mlp.experts.gate_up_proj, w0)
    ids, _ = ids_and_labels()
    prepare_qat(m, QATConfig())
    with torch.no_grad():
        assert torch.equal(ptq(ids).logits, m(ids).logits)
    with pytest.raises(ValueError, match="full-precision"):
        ptq_int4(m, QATConfig())


@pytest.mark.parametrize("cfg", [QATConfig(), ALL_ON], ids=["default", "all_on"])
def test_int4_model_logits_equal_fake_quant_logits(tmp_path, monkeypatch, cfg):
    m = small_model()
    prepare_qat(m, cfg)
    m.eval()
    path = save_int4(m, cfg, tmp_path)
    m4 = load_int4_model(tmp_path)
    assert path.name == "model_int4.safetensors"
    assert isinstance(m4.layers[0].self_attn.q_a_proj, Int4Linear)
    assert isinstance(m4.layers[1].mlp.experts, Int4Experts)
    calls = []
    real = qat.int4_matmul
    monkeypatch.setattr(qat, "int4_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, _ = ids_and_labels()
    with torch.no_grad():
        ref, got = m(ids).logits, m4(ids).logits
    assert calls                                               # the INT4 path ran through int4_matmul
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    print(f"\n[{cfg.head and 'all_on' or 'default'}] max |logit diff| int4 vs fake-quant: "
          f"{(got - ref).abs().max().item():.2e}")
    # decoding over the latent cache reads kv_b_proj.weight directly (absorbed MLA)
    c_ref, c_got = m.new_cache(), m4.new_cache()
    with torch.no_grad():
        m(ids[:, :20], cache=c_ref), m4(ids[:, :20], cache=c_got)
        step_ref, step_got = m(ids[:, 20:22], cache=c_ref).logits, m4(ids[:, 20:22], cache=c_got).logits
    torch.testing.assert_close(step_got, step_ref, rtol=1e-5, atol=1e-5)


def test_int4_bytes_are_a_quarter_of_fp16_plus_scales(tmp_path):
    m = small_model()
    cfg = QATConfig()
    tensors = convert_int4(m, cfg)
    rep = int4_bytes(tensors)
    n = sum(raw(m, k).numel() for k in quantized_tensor_names(m, cfg))
    assert rep["quantized_params"] == n and rep["fp16_bytes"] == 2 * n
    assert rep["int4_ratio"] == 0.25
    # scales are stored in the weight dtype (fp32 here): 4 bytes per 32 weights
    assert rep["ratio_with_scales"] == pytest.approx(0.25 + 4 / (2 * cfg.group_size))
    print(f"\nINT4 bytes: {rep}")
    assert all(tensors[k].dtype == torch.uint8 for k in tensors if k.endswith("_packed"))
    with pytest.raises(ValueError, match="not a glmforge INT4 checkpoint"):
        from safetensors.torch import save_file
        save_file({"x": torch.zeros(1)}, str(tmp_path / "bad.safetensors"))
        load_int4_model(tmp_path / "bad.safetensors")


def test_lsq_starts_at_round_to_nearest_learns_its_scales_and_bakes_with_them():
    from quant.qat import enable_lsq, fake_quantize_lsq, lsq_parameters

    # the LSQ quantizer on hand-checked values: group of 4, scale 0.5 -> round(w / 0.5) * 0.5,
    # clamped to [-8, 7] * 0.5; the scale's gradient is LSQ's (round(v) - v inside, the clamp
    # level outside) times 1 / sqrt(4 * 7)
    w = torch.tensor([[0.3, -0.7, 5.0, -9.0]], requires_grad=True)
    s = torch.tensor([[0.5]], requires_grad=True)
    out = fake_quantize_lsq(w, s, 4)
    assert out.tolist() == [[0.5, -0.5, 3.5, -4.0]]
    out.sum().backward()
    assert w.grad.tolist() == [[1.0, 1.0, 0.0, 0.0]]
    expected = ((1 - 0.6) + (-1 + 1.4) + 7 + -8) / (4 * 7) ** 0.5
    assert s.grad.item() == pytest.approx(expected)

    torch.manual_seed(0)
    m = small_model()
    ids, labels = ids_and_labels()
    ref = ptq_int4(m, QATConfig())(ids).logits
    prepare_qat(m, QATConfig())
    scales = enable_lsq(m)
    assert scales and scales == lsq_parameters(m)
    assert torch.allclose(m(ids).logits, ref, atol=1e-5)          # init = round-to-nearest
    assert set(dict(m.named_parameters())) == set(dict(small_model().named_parameters()))
    m(ids, labels=labels).loss.backward()
    assert all(p.grad is not None for p in scales)
    with torch.no_grad():
        for p in scales:
            p.mul_(1.1)
    fq = m(ids).logits.detach()
    remove_qat(m, bake=True)
    assert not lsq_parameters(m)
    assert torch.allclose(m(ids).logits, fq, atol=1e-5)           # baked with the learned scales
