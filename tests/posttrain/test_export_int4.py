import json

import pytest
import torch
from safetensors.torch import load_file

from kernels.int4 import quantize_int4
from model.hf import load_pretrained
from quant.export import _pack_int32, export_all, export_int4, quantized_hf_weights
from quant.qat import QATConfig, prepare_qat
from tests.posttrain.conftest import small_model

try:
    import compressed_tensors
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationConfig
except ImportError:                 # pragma: no cover - the venv here has it (see the report)
    compressed_tensors = None
needs_ct = pytest.mark.skipif(compressed_tensors is None,
                              reason="compressed-tensors is not installed: pip install compressed-tensors")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A QAT-prepared model, its config and both exports."""
    m = small_model()
    cfg = QATConfig()
    prepare_qat(m, cfg)
    m.eval()
    paths = export_all(m, cfg, tmp_path_factory.mktemp("export"))
    return m, cfg, paths


def fake_quant_hf_weights(m) -> dict[str, torch.Tensor]:
    """HF name -> the weight the QAT model computes with (its fake-quantized value)."""
    out = {}
    L = m.config.num_layers
    for prefix, block in [(f"model.layers.{i}.", layer) for i, layer in enumerate(m.layers)] + \
                         [(f"model.layers.{L}.", m.mtp.block)]:
        for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            out[f"{prefix}self_attn.{n}"] = getattr(block.self_attn, n).weight
        mlp = block.mlp
        if hasattr(mlp, "experts"):
            gu, down = mlp.experts.gate_up_proj, mlp.experts.down_proj
            I = gu.shape[1] // 2
            for e in range(gu.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj"] = gu[e, :I]
                out[f"{prefix}mlp.experts.{e}.up_proj"] = gu[e, I:]
                out[f"{prefix}mlp.experts.{e}.down_proj"] = down[e]
            mlp = mlp.shared_experts
            prefix += "mlp.shared_experts."
        else:
            prefix += "mlp."
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[prefix + n] = getattr(mlp, n).weight
    out[f"model.layers.{L}.eh_proj"] = m.mtp.eh_proj.weight
    return {k: v.detach() for k, v in out.items()}


def test_int32_packing_is_compressed_tensors_layout():
    q = torch.randint(-8, 8, (5, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    words = _pack_int32(q)
    assert words.dtype == torch.int32 and words.shape == (5, 8)
    # value i of a word sits in bits 4i..4i+3 as q + 8 (independent of compressed-tensors)
    u = words.to(torch.int64) & 0xFFFFFFFF
    back = torch.stack([(u >> (4 * i)) & 0xF for i in range(8)], -1).view(5, 64) - 8
    assert torch.equal(back.to(torch.int8), q)
    if compressed_tensors is not None:
        assert torch.equal(words, pack_to_int32(q, 4))
    with pytest.raises(ValueError, match="multiple of 8"):
        _pack_int32(torch.zeros(2, 12, dtype=torch.int8))


def test_export_layout_and_ignore_list(exported):
    m, cfg, paths = exported
    hf = json.loads((paths["int4"] / "config.json").read_text())
    qc = hf["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", True, "group", 32)
    sd = load_file(str(paths["int4"] / "model.safetensors"))
    quantized = [k[: -len(".weight")] for k in quantized_hf_weights(m, cfg)]
    for mod in quantized:
        assert mod + ".weight" not in sd
        assert sd[mod + ".weight_packed"].dtype == torch.int32
        out_f, in_f = sd[mod + ".weight_shape"].tolist()
        assert sd[mod + ".weight_packed"].shape == (out_f, in_f // 8)
        assert sd[mod + ".weight_scale"].shape == (out_f, in_f // 32)
    # every 2-D weight left in full precision (a linear) is ignored; nothing quantized is
    linears = {k[: -len(".weight")] for k, v in sd.items() if k.endswith(".weight") and v.dim() == 2
               and not k.endswith("embed_tokens.weight")}
    assert set(qc["ignore"]) == linears and not set(qc["ignore"]) & set(quantized)
    assert {"lm_head", "model.layers.1.mlp.gate", "model.layers.0.self_attn.indexer.wq_b"} <= set(qc["ignore"])
    assert "model.layers.1.mlp.experts.0.gate_proj" in quantized and "model.layers.2.eh_proj" in quantized


def test_full_precision_export_sits_beside_and_reloads(exported):
    m, _, paths = exported
    full = load_pretrained(paths["full"])
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = {k: v for k, v in m.state_dict().items()}
    assert all(torch.equal(full.state_dict()[k], ref[k]) for k in ref)   # the latent weights
    assert "quantization_config" not in json.loads((paths["full"] / "config.json").read_text())
    assert full(ids).logits.shape == (1, 24, 512)


@needs_ct
def test_compressed_tensors_decompresses_to_the_fake_quant_weights(exported):
    m, cfg, paths = exported
    hf = json.loads((paths["int4"] / "config.json").read_text())
    qc = QuantizationConfig.model_validate(hf["quantization_config"])          # their schema accepts it
    scheme = qc.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    sd = load_file(str(paths["int4"] / "model.safetensors"))
    expected = fake_quant_hf_weights(m)
    assert set(expected) == {k[: -len(".weight")] for k in quantized_hf_weights(m, cfg)}
    for mod, w_hat in expected.items():
        dec = compressor.decompress({n: sd[f"{mod}.{n}"] for n in ("weight_packed", "weight_scale", "weight_shape")},
                                    scheme)["weight"]
        assert torch.equal(dec, w_hat), mod
    print(f"\ncompressed-tensors {compressed_tensors.__version__}: {len(expected)} modules decompress exactly")


def test_export_rejects_what_the_format_cannot_hold(tmp_path):
    m = small_model()
    with pytest.raises(ValueError, match="Linear layers only"):
        export_int4(m, QATConfig(embeddings=True), tmp_path)
    q, _ = quantize_int4(torch.randn(4, 32), 32)
    assert _pack_int32(q).shape == (4, 4)


@needs_ct
def test_transformers_loads_the_int4_export_and_matches_fake_quant_logits(exported):
    """An independent consumer: transformers' compressed-tensors quantizer reads the export
    (per-expert int4 linears into its packed experts) and reproduces the QAT model's logits."""
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    m, _, paths = exported
    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tm, info = AutoModelForCausalLM.from_pretrained(str(paths["int4"]), output_loading_info=True)
    L = m.config.num_layers
    assert not info["missing_keys"] and not info.get("mismatched_keys")
    assert all(k.startswith(f"model.layers.{L}.") for k in info["unexpected_keys"])   # MTP: not in transformers
    assert torch.equal(tm.model.layers[1].mlp.experts.gate_up_proj, m.layers[1].mlp.experts.gate_up_proj)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, ref = tm(ids).logits, m(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    print(f"\ntransformers int4 export vs fake-quant: max |logit diff| {(got - ref).abs().max().item():.2e}")
