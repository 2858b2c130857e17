"""Hugging Face interop: our GLMModel <-> transformers' GlmMoeDsaForCausalLM checkpoint format
(config.json with model_type "glm_moe_dsa" + model.safetensors), plus plain safetensors
save/load of our own state dict. Loading never unpickles: safetensors only.

State-dict adapter. Our module names were chosen to equal transformers' below `model.`, so the
main trunk maps by prefix:
    embed_tokens.* / layers.N.* / norm.*  <->  model.embed_tokens.* / model.layers.N.* / model.norm.*
    lm_head.weight                        <->  lm_head.weight
The MTP module is stored the way GLM-5 / DeepSeek-V3 checkpoints store it, as one extra layer
L = num_hidden_layers (config num_nextn_predict_layers = 1):
    mtp.block.*  <-> model.layers.L.* (input_layernorm, self_attn.*, post_attention_layernorm, mlp.*)
    mtp.{enorm,hnorm,eh_proj}.weight, mtp.shared_head.norm.weight <-> model.layers.L.{same}
    plus copies model.layers.L.embed_tokens.weight and model.layers.L.shared_head.head.weight
    (DeepSeek-V3 layout; the MTP shares them with the trunk, so import ignores the copies).
transformers' GlmMoeDsaForCausalLM does not implement MTP: it reports layer L as unexpected
keys and ignores it.
Routed experts: transformers' modules hold them packed (mlp.experts.gate_up_proj [E,2I,D],
mlp.experts.down_proj [E,D,I]) and load that layout directly; its own save_pretrained (and the
published GLM-5 checkpoints) write one tensor per expert (mlp.experts.E.{gate,up,down}_proj.weight).
We write either (expert_layout) and read both.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_file, save_model

from model.config import ModelConfig
from model.model import GLMModel

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Our fields transformers' config does not know: kept under one key so a round trip is lossless.
EXTRA_KEY = "glmforge"
EXTRA_FIELDS = ("mtp_depth", "mtp_loss_weight", "bias_update_rate", "seq_balance_alpha",
                "dense_attention", "sliding_window", "attention_pattern", "index_topk_method")


# ---------------------------------------------------------------- config
def to_hf_config(cfg: ModelConfig) -> dict:
    if any(k != "dsa" for k in cfg.layer_kinds):
        raise ValueError("transformers' GlmMoeDsa has only DSA layers; cannot export attention_pattern "
                         f"{cfg.attention_pattern}")
    if cfg.latent_norm_eps != 1e-6:
        raise ValueError("transformers hard-codes eps=1e-6 for q_a/kv_a layernorms; latent_norm_eps must be 1e-6")
    if cfg.dense_attention:
        warnings.warn("dense_attention=True is not representable in transformers, which always applies "
                      "the indexer's top-k; the flag is kept under config.json['glmforge'] only")
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "dtype": "float32",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads,
        "n_shared_experts": cfg.n_shared_experts, "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok, "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "hidden_act": "silu",
        "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "v_head_dim": cfg.v_head_dim, "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.init_std, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "index_topk": cfg.index_topk, "index_head_dim": cfg.index_head_dim, "index_n_heads": cfg.index_n_heads,
        "first_k_dense_replace": cfg.first_k_dense, "indexer_types": ["full"] * cfg.num_layers,
        "attention_bias": False, "num_nextn_predict_layers": 1 if cfg.mtp_depth > 0 else 0,
        EXTRA_KEY: {k: getattr(cfg, k) for k in EXTRA_FIELDS},
    }


def from_hf_config(hf: dict) -> ModelConfig:
    if hf.get("model_type") != "glm_moe_dsa":
        raise ValueError(f"expected model_type 'glm_moe_dsa', got {hf.get('model_type')!r}")
    rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0), "rope_type": "default"}
    unsupported = {
        "rope_type (only 'default')": rope.get("rope_type", "default") != "default",
        "indexer_types 'shared' (cross-layer top-k reuse)": "shared" in (hf.get("indexer_types") or []),
        "n_group/topk_group > 1 (group-limited routing)": hf.get("n_group", 1) != 1 or hf.get("topk_group", 1) != 1,
        "norm_topk_prob=False": not hf.get("norm_topk_prob", True),
        "attention_bias=True": hf.get("attention_bias", False),
        "hidden_act other than silu": hf.get("hidden_act", "silu") != "silu",
        "num_key_value_heads != num_attention_heads": hf.get("num_key_value_heads", hf.get("num_attention_heads"))
        != hf.get("num_attention_heads"),
        "mlp_layer_types other than first_k_dense_replace dense layers": hf.get("mlp_layer_types") not in (
            None, ["dense"] * min(hf.get("first_k_dense_replace", 3), hf["num_hidden_layers"])
            + ["sparse"] * max(hf["num_hidden_layers"] - hf.get("first_k_dense_replace", 3), 0)),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"checkpoint uses features GLMModel does not implement: {bad}")
    extra = dict(hf.get(EXTRA_KEY) or {})
    if "mtp_depth" not in extra:
        extra["mtp_depth"] = 3 if hf.get("num_nextn_predict_layers", 0) else 0
    if extra.get("attention_pattern") is not None:
        extra["attention_pattern"] = tuple(extra["attention_pattern"])
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=hf["moe_intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], n_shared_experts=hf.get("n_shared_experts", 1),
        n_routed_experts=hf["n_routed_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
        routed_scaling_factor=hf.get("routed_scaling_factor", 2.5), kv_lora_rank=hf["kv_lora_rank"],
        q_lora_rank=hf["q_lora_rank"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], v_head_dim=hf["v_head_dim"],
        max_position_embeddings=hf.get("max_position_embeddings", 202752),
        init_std=hf.get("initializer_range", 0.02), rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=hf.get("tie_word_embeddings", False), rope_theta=rope.get("rope_theta", 10000.0),
        index_topk=hf.get("index_topk", 2048), index_head_dim=hf.get("index_head_dim", 128),
        index_n_heads=hf.get("index_n_heads", 32), first_k_dense=hf.get("first_k_dense_replace", 3),
        **extra,
    )


# ---------------------------------------------------------------- weights
def to_hf_state_dict(model: GLMModel, expert_layout: str = "packed") -> dict[str, torch.Tensor]:
    return hf_tensors(model.state_dict(), model.config, expert_layout)


def _hf_key(name: str, L: int) -> str:
    if name == "lm_head.weight":
        return name
    if name.startswith("mtp.block."):
        return f"model.layers.{L}." + name[len("mtp.block."):]
    if name.startswith("mtp."):
        return f"model.layers.{L}." + name[len("mtp."):]
    return "model." + name


def hf_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig, expert_layout: str = "packed"
               ) -> dict[str, torch.Tensor]:
    """Our state dict (GLMModel.state_dict() names) under the HF checkpoint's names."""
    if expert_layout not in ("packed", "per_expert"):
        raise ValueError(f"expert_layout must be 'packed' or 'per_expert', got {expert_layout!r}")
    L = cfg.num_layers
    out = {}
    for name, t in state.items():
        if expert_layout == "per_expert" and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out.update(hf_expert_piece(name, t, 0, cfg))
        else:
            out[_hf_key(name, L)] = t.detach().contiguous().clone()
    if cfg.mtp_depth:
        out[f"model.layers.{L}.embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        out[f"model.layers.{L}.shared_head.head.weight"] = out["lm_head.weight"].clone()
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight")
    return out


def hf_expert_piece(name: str, t: torch.Tensor, first: int, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors of packed experts (`name` ends in experts.gate_up_proj [n, 2I, D] or
    experts.down_proj [n, D, I]) that are experts first .. first + n - 1 (an expert-parallel shard)."""
    base, which = _hf_key(name, cfg.num_layers).rsplit(".", 1)
    out = {}
    for j in range(t.shape[0]):
        e = first + j
        if which == "gate_up_proj":
            gate, up = t[j].chunk(2, dim=0)
            out[f"{base}.{e}.gate_proj.weight"] = gate.contiguous()
            out[f"{base}.{e}.up_proj.weight"] = up.contiguous()
        else:
            out[f"{base}.{e}.down_proj.weight"] = t[j].contiguous()
    return out


def dense_mla_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors of `to_dense_mla_config`'s checkpoint: the trunk only (indexers and MTP
    dropped), one tensor per expert, the layout inference engines load."""
    return dense_mla_only(hf_tensors(state, cfg, "per_expert"), cfg)


def dense_mla_only(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    L = cfg.num_layers
    return {k: v for k, v in tensors.items() if ".indexer." not in k and not k.startswith(f"model.layers.{L}.")}


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors -> our state-dict names (per-expert tensors are packed; MTP copies dropped)."""
    L = cfg.num_layers
    sd = dict(sd)
    per_expert = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for k in [k for k in sd if per_expert.match(k)]:
        base, e, which = per_expert.match(k).groups()
        groups.setdefault(base, {}).setdefault(int(e), {})[which] = sd.pop(k)
    for base, experts in groups.items():
        n = len(experts)
        sd[base + "gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]])
                                                 for e in range(n)])
        sd[base + "down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(n)])
    out = {}
    mtp_prefix = f"model.layers.{L}."
    mtp_own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
    for k, t in sd.items():
        if k == "lm_head.weight":
            out[k] = t
        elif k.startswith(mtp_prefix):
            rest = k[len(mtp_prefix):]
            if rest in ("embed_tokens.weight", "shared_head.head.weight"):
                continue  # copies of the shared embedding / head
            out[("mtp." if rest.startswith(mtp_own) else "mtp.block.") + rest] = t
        elif k.startswith("model."):
            out[k[len("model."):]] = t
        else:
            raise ValueError(f"unexpected tensor {k!r} in checkpoint")
    if cfg.tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def _read_safetensors(d: Path) -> dict[str, torch.Tensor]:
    index = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    sd = {}
    for f in files:
        if not (d / f).exists():
            raise ValueError(f"missing weights file {d / f}")
        with safe_open(str(d / f), framework="pt") as fh:
            for k in fh.keys():
                sd[k] = fh.get_tensor(k)
    return sd


def save_pretrained(model: GLMModel, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
                    expert_layout: str = "packed") -> Path:
    """Write config.json + model.safetensors loadable by transformers' GlmMoeDsaForCausalLM
    (and tokenizer files copied from tokenizer_dir, if given)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = to_hf_config(model.config)
    save_file(to_hf_state_dict(model, expert_layout), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    if tokenizer_dir is not None:
        src = Path(tokenizer_dir)
        copied = [f for f in TOKENIZER_FILES if (src / f).exists()]
        if "tokenizer.json" not in copied:
            raise ValueError(f"no tokenizer.json in {src}")
        for f in copied:
            shutil.copy(src / f, out / f)
    return out


def to_dense_mla_config(cfg: ModelConfig) -> dict:
    """The same weights as DeepSeek-V3's architecture (dense MLA, no indexer, no MTP): what an
    inference engine without sparse attention serves (vLLM on CPU refuses DSA; docs/guides/vllm.md).
    Exact for the DSA model while every context fits in index_topk (the indexer keeps every key),
    and for a dense_attention model at any length."""
    with warnings.catch_warnings():       # dense_attention is representable here
        warnings.simplefilter("ignore")
        hf = to_hf_config(cfg)
    for k in [k for k in hf if k.startswith("index")] + [EXTRA_KEY]:
        hf.pop(k)
    hf.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", topk_method="noaux_tc",
              scoring_func="sigmoid", num_nextn_predict_layers=0, moe_layer_freq=1)
    return hf


def save_dense_mla(model: GLMModel, out_dir: str | Path) -> Path:
    """Write `to_dense_mla_config` + model.safetensors (trunk only: indexers and MTP dropped; one
    tensor per expert, the layout inference engines load)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(dense_mla_tensors(model.state_dict(), model.config), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(to_dense_mla_config(model.config), indent=2))
    return out


def load_pretrained(path: str | Path) -> GLMModel:
    """Any GlmMoeDsaForCausalLM checkpoint directory (ours or transformers') -> GLMModel (fp32).
    Without MTP weights in the checkpoint, the model has no MTP module (mtp_depth = 0)."""
    d = Path(path)
    if not (d / "config.json").exists():
        raise ValueError(f"{d} has no config.json")
    hf_cfg = json.loads((d / "config.json").read_text())
    cfg = from_hf_config(hf_cfg)
    sd = _read_safetensors(d)
    if cfg.mtp_depth > 0 and not any(k.startswith(f"model.layers.{cfg.num_layers}.") for k in sd):
        cfg = cfg.replace(mtp_depth=0)
    model = GLMModel(cfg)
    ours = {k: v.float() for k, v in from_hf_state_dict(sd, cfg).items()}
    missing, unexpected = model.load_state_dict(ours, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the config: missing {missing}, unexpected {unexpected}")
    return model


# ---------------------------------------------------------------- our own format
STATE_FILE = "consolidated.safetensors"   # a training stage's weights in its artifact


def artifact_weights(artifact: str | Path, stage: str = "the parent stage") -> Path:
    """The STATE_FILE of a stage artifact; a ValueError naming the stage when it has none."""
    path = Path(artifact) / STATE_FILE
    if not path.is_file():
        raise ValueError(f"{stage}'s artifact {artifact} has no {STATE_FILE} to continue from")
    return path


def state_config(path: str | Path) -> ModelConfig:
    """The ModelConfig stored in a state file, without loading the weights."""
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
    if "glmforge_config" not in meta:
        raise ValueError(f"{path} is not a glmforge state file (no glmforge_config metadata)")
    return ModelConfig.model_validate_json(meta["glmforge_config"])


def save_state(model: GLMModel, path: str | Path) -> Path:
    """Our state dict as one safetensors file, the ModelConfig in its metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, str(path), metadata={"glmforge_config": model.config.model_dump_json()})
    return path


def load_state(path: str | Path) -> GLMModel:
    model = GLMModel(state_config(path))
    load_model(model, str(path), strict=True)
    return model
