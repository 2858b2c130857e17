"""Export the INT4 model in compressed-tensors' "pack-quantized" layout (what vLLM and SGLang
load), beside the full-precision HF export (model.hf.save_pretrained).

Per quantized linear `P` (HF name, e.g. model.layers.0.self_attn.q_a_proj):
    P.weight_packed  int32 [out, in/8]   8 int4 values per word, value i of a word in bits 4i..4i+3,
                                         each stored as q + 8 (compressed-tensors pack_to_int32)
    P.weight_scale   [out, in/group_size] the weight's dtype; W = (q) * scale, zero point 0
    P.weight_shape   int64 [2] = (out, in)
and config.json gets a `quantization_config` (quant_method "compressed-tensors", format
"pack-quantized", one config group: targets ["Linear"], weights num_bits 4 / type int /
symmetric / strategy group / group_size) whose `ignore` lists every other linear (router,
indexer, lm_head, ... whatever QATConfig left in full precision).

Our uint8 packing (kernels.int4.pack_int4: even column in the low nibble, +8 offset) read as
little-endian 32-bit words IS this layout; _pack_int32 builds the words with shifts so the
result does not depend on the host's byte order.

Packed MoE experts. GLMModel (and transformers' GlmMoeDsa modules) hold routed experts as 3-D
tensors mlp.experts.gate_up_proj [E, 2I, D] / down_proj [E, D, I]. This export writes them as
per-expert 2-D linears (mlp.experts.{e}.gate_proj / up_proj / down_proj), because (1) that is
the layout of the published GLM-5 checkpoints, (2) vLLM's and SGLang's MoE weight loaders map
per-expert names onto their fused kernels and read compressed-tensors' int4 MoE weights that way,
and (3) a 3-D tensor is not a Linear, so a "Linear" target would not cover it. The int4 values
are identical: the QAT groups run along each expert's input dim row by row, and splitting the
fused gate/up rows does not change a row's groups.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from kernels.int4 import pack_int4, quantize_int4
from model.hf import TOKENIZER_FILES, save_pretrained, to_hf_config, to_hf_state_dict
from model.model import GLMModel
from model.moe import Experts
from quant.qat import QATConfig, quantized_modules

FORMAT = "pack-quantized"


def _pack_int32(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] in [-8, 7] -> int32 [N, K/8] in compressed-tensors' pack-quantized order."""
    if q.shape[-1] % 8:
        raise ValueError(f"the input dim must be a multiple of 8 to pack int4 into int32, got {q.shape[-1]}")
    b = pack_int4(q).to(torch.int64).view(q.shape[0], -1, 4)                 # bytes of each word
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement


def hf_name(name: str, num_layers: int) -> str:
    """Our state-dict name -> the HF tensor name model.hf.to_hf_state_dict writes."""
    if name == "lm_head.weight":
        return name
    if name.startswith("mtp.block."):
        return f"model.layers.{num_layers}." + name[len("mtp.block."):]
    if name.startswith("mtp."):
        return f"model.layers.{num_layers}." + name[len("mtp."):]
    return "model." + name


def quantized_hf_weights(model: GLMModel, cfg: QATConfig) -> list[str]:
    """HF names (per-expert layout) of the weights the export stores as int4."""
    L, out = model.config.num_layers, []
    for name, m in quantized_modules(model, cfg).items():
        if isinstance(m, Experts):
            base = hf_name(name, L) + "."
            out += [f"{base}{e}.{p}.weight" for e in range(m.gate_up_proj.shape[0])
                    for p in ("gate_proj", "up_proj", "down_proj")]
        elif isinstance(m, torch.nn.Embedding):
            raise ValueError("compressed-tensors quantizes Linear layers only; export with embeddings=False")
        else:
            out.append(hf_name(f"{name}.weight", L))
    return out


def quantization_config(cfg: QATConfig, ignore: list[str]) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": cfg.group_size, "dynamic": False},
            "input_activations": None,
            "output_activations": None,
        }},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


@torch.no_grad()
def export_int4(model: GLMModel, cfg: QATConfig, out_dir: str | Path,
                tokenizer_dir: str | Path | None = None) -> Path:
    """config.json (+ quantization_config) and model.safetensors in the pack-quantized layout.
    A QAT-prepared model exports the same int4 values its fake quantization trained with."""
    if model.config.tie_word_embeddings and cfg.head:
        raise ValueError("head=True with tie_word_embeddings: the HF export has no separate lm_head to quantize")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = to_hf_config(model.config)
    tensors = to_hf_state_dict(model, expert_layout="per_expert")
    quantized = quantized_hf_weights(model, cfg)
    missing = [k for k in quantized if k not in tensors]
    assert not missing, f"hf_name disagrees with model.hf.to_hf_state_dict: {missing[:3]}"
    for key in quantized:
        w = tensors.pop(key)
        q, scales = quantize_int4(w, cfg.group_size)
        module = key[: -len(".weight")]
        tensors[module + ".weight_packed"] = _pack_int32(q)
        tensors[module + ".weight_scale"] = scales.contiguous()
        tensors[module + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
    # Every linear left in full precision must be ignored, or loaders expect int4 tensors for it.
    ignore = sorted(k[: -len(".weight")] for k, v in tensors.items()
                    if k.endswith(".weight") and v.dim() == 2 and not k.endswith("embed_tokens.weight"))
    hf_cfg["quantization_config"] = quantization_config(cfg, ignore)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    if tokenizer_dir is not None:
        src = Path(tokenizer_dir)
        if not (src / "tokenizer.json").exists():
            raise ValueError(f"no tokenizer.json in {src}")
        for f in TOKENIZER_FILES:
            if (src / f).exists():
                shutil.copy(src / f, out / f)
    return out


def export_all(model: GLMModel, cfg: QATConfig, out_dir: str | Path,
               tokenizer_dir: str | Path | None = None) -> dict[str, Path]:
    """out_dir/full: the full-precision HF checkpoint (model.hf.save_pretrained);
    out_dir/int4: the compressed-tensors INT4 checkpoint."""
    out = Path(out_dir)
    return {"full": save_pretrained(model, out / "full", tokenizer_dir),
            "int4": export_int4(model, cfg, out / "int4", tokenizer_dir)}
