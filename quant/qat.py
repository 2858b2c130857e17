"""INT4 quantization-aware training (QAT) for GLMModel, real INT4 conversion, and an INT4
inference path.

Quantization is kernels.int4's symmetric int4 with per-group scales along each weight's INPUT
dim (torchao's IntxFakeQuantizeConfig(torch.int4, group_size=32, is_symmetric=True)):
    scale = amax(|W_group|) / 7.5,  W_hat = clamp(round(W / scale), -8, 7) * scale
and a straight-through estimator in training (kernels.int4.fake_quantize_int4).

How QAT is applied without renaming anything: a quantized module's class is swapped for a
subclass in which the weight attribute (`weight`, or `gate_up_proj` / `down_proj` of the packed
experts) is a property returning fake_quantize_int4(raw parameter). The raw parameter stays in
the module's `_parameters`, so state_dict() names, load_state_dict, the optimizer's parameters
and the HF export are exactly those of the plain model, and every reader of the attribute sees
the quantized weight, including MLA's absorbed decode path that reads kv_b_proj.weight
directly. (torch's own parametrizations would rename the tensors to
`parametrizations.weight.original`.) Packed experts [E, out, in] are quantized per expert and
per output row, groups along `in`: the same groups as E separate linears.

Module kinds (QATConfig switches): experts = routed experts (packed) and shared experts;
attention = MLA projections; indexer = DSA lightning indexer (off: it ranks keys for top-k, a
small, precision-sensitive part); dense_mlp = the first_k_dense layers' MLP; mtp = everything in
the MTP module (its layers by kind, plus eh_proj); head = lm_head; embeddings = embed_tokens.
The MoE router is never quantized (it runs in fp32 by design).

INT4 tensors (convert_int4 / save_int4 / load_int4_model): a quantized tensor named X is
stored as X_packed (uint8, two int4 per byte, kernels.int4.pack_int4; shape [..., in/2]) and
X_scale ([..., in/group_size], the weight's dtype); so `q_a_proj.weight` becomes
`q_a_proj.weight_packed` + `q_a_proj.weight_scale` (compressed-tensors' names) and
`experts.gate_up_proj` becomes `experts.gate_up_proj_packed` + `_scale`.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from kernels.int4 import (
    QMAX,
    QMIN,
    dequantize_int4,
    fake_quantize_int4,
    int4_matmul,
    pack_int4,
    quantize_int4,
)
from kernels.int4 import int4_scales as kernels_int4_scales
from model.config import ModelConfig
from model.model import GLMModel
from model.moe import Experts

INT4_FILE = "model_int4.safetensors"
PACKED, SCALE = "_packed", "_scale"
KINDS = ("experts", "attention", "indexer", "dense_mlp", "mtp", "head", "embeddings")


class QATConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    group_size: int = Field(32, ge=2, description="input columns per scale (torchao int4 QAT default 32)")
    experts: bool = Field(True, description="quantize the routed experts (packed) and the shared experts")
    attention: bool = Field(True, description="quantize the MLA attention projections")
    indexer: bool = Field(False, description=(
        "quantize the DSA lightning indexer (off: it ranks keys for top-k, small and precision-sensitive)"))
    dense_mlp: bool = Field(True, description="quantize the MLP of the first_k_dense layers")
    mtp: bool = Field(True, description="quantize the MTP module (its layers by kind, plus eh_proj)")
    head: bool = Field(False, description="quantize lm_head")
    embeddings: bool = Field(False, description="quantize embed_tokens")

    @field_validator("group_size")
    @classmethod
    def _even(cls, v: int) -> int:
        if v % 2:
            raise ValueError(f"group_size must be even (two int4 values per byte), got {v}")
        return v


# ---------------------------------------------------------------- which tensors
def _kind(name: str, module: nn.Module) -> str | None:
    if isinstance(module, Experts):
        return "experts"
    if isinstance(module, nn.Embedding):
        return "embeddings"
    if not isinstance(module, nn.Linear):
        return None
    if name == "lm_head":
        return "head"
    if ".indexer." in name:
        return "indexer"
    if ".self_attn." in name:
        return "attention"
    if ".shared_experts." in name:
        return "experts"
    if ".mlp." in name:
        return "dense_mlp"
    if name == "mtp.eh_proj":
        return "mtp"
    raise ValueError(f"linear {name!r} has no QAT kind; classify it in quant.qat._kind")


def _param_names(module: nn.Module) -> tuple[str, ...]:
    return ("gate_up_proj", "down_proj") if isinstance(module, Experts) else ("weight",)


def quantized_modules(model: GLMModel, cfg: QATConfig) -> dict[str, nn.Module]:
    """{module name: module} of the modules whose weights cfg quantizes, in model order.
    Raises ValueError when group_size does not divide a selected weight's input dim."""
    out = {}
    for name, m in model.named_modules():
        kind = _kind(name, m)
        if kind is None or not getattr(cfg, kind) or (name.startswith("mtp.") and not cfg.mtp):
            continue
        for p in _param_names(m):
            w = m._parameters[p]
            if w.shape[-1] % cfg.group_size:
                raise ValueError(f"group_size={cfg.group_size} does not divide the input dim of "
                                 f"{name}.{p} {tuple(w.shape)}; switch its kind off or change group_size")
        out[name] = m
    return out


def quantized_tensor_names(model: GLMModel, cfg: QATConfig) -> list[str]:
    """State-dict names of the quantized tensors."""
    return [f"{n}.{p}" for n, m in quantized_modules(model, cfg).items() for p in _param_names(m)]


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """fake_quantize_int4 over the last dim of a 2-D or packed 3-D weight (STE gradient)."""
    return fake_quantize_int4(w.reshape(-1, w.shape[-1]), group_size).view(w.shape)


@torch.no_grad()
def baked_int4_state(state: dict[str, torch.Tensor], model_config, cfg: QATConfig) -> dict[str, torch.Tensor]:
    """`state` with each tensor QAT quantizes replaced by its fake-quantized value: what an INT4
    rollout copy computes with (prepare_qat then remove_qat(bake=True) on a whole model), from a
    state dict alone (the tensor names come from a model built on the meta device)."""
    with torch.device("meta"):
        names = set(quantized_tensor_names(GLMModel(model_config), cfg))
    return {k: fake_quantize(v, cfg.group_size) if k in names else v for k, v in state.items()}


# ---------------------------------------------------------------- QAT modules
_QAT_CLASSES: dict[type, type] = {}


def fake_quantize_lsq(w: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """LSQ fake quantization (Esser et al. 2019, arXiv 1902.08153; torchao's range learning):
    w [..., in], learned scale [..., in/group_size] -> clamp(round(w / s), -8, 7) * s, where round
    has a straight-through gradient, w gets gradient 1 inside the range and 0 outside, and s gets
    LSQ's gradient (round(v) - v inside, -8 / 7 at the clamps) scaled by 1/sqrt(group_size * 7)."""
    lead = w.shape[:-1]
    wg = w.reshape(*lead, -1, group_size)
    s = scale.unsqueeze(-1)
    gs = 1.0 / math.sqrt(group_size * QMAX)
    s = s.detach() + (s * gs - (s * gs).detach())       # value exactly s, gradient scaled by gs
    v = torch.clamp(wg / s, QMIN, QMAX)
    q = v + (torch.round(v) - v).detach()
    return (q * s).reshape(w.shape)


def _fq_property(name: str) -> property:
    def get(self):
        memo = self.__dict__.get("_qat_memo")
        if memo is not None and name in memo:
            return memo[name]
        lsq = self.__dict__.get("_lsq_scales")
        if lsq is not None and name in lsq:
            w = fake_quantize_lsq(self._parameters[name], lsq[name], self._qat_group_size)
        else:
            w = fake_quantize(self._parameters[name], self._qat_group_size)
        if memo is not None:
            memo[name] = w
        return w
    return property(get, doc=f"fake-quantized {name} (raw parameter in _parameters[{name!r}])")


def _qat_class(cls: type) -> type:
    if cls not in _QAT_CLASSES:
        def forward(self, *args, **kwargs):
            # Within one forward each weight is fake-quantized once (the expert loop reads the
            # packed tensors once per expert); the memo dies with the call, so no graph is
            # reused after backward or after an optimizer step.
            self.__dict__["_qat_memo"] = {}
            try:
                return cls.forward(self, *args, **kwargs)
            finally:
                self.__dict__["_qat_memo"] = None
        names = ("gate_up_proj", "down_proj") if issubclass(cls, Experts) else ("weight",)
        attrs = {n: _fq_property(n) for n in names}
        _QAT_CLASSES[cls] = type(f"QAT{cls.__name__}", (cls,), {"forward": forward, **attrs,
                                                               "_qat_base": cls})
    return _QAT_CLASSES[cls]


def _is_qat(module: nn.Module) -> bool:
    return type(module) in _QAT_CLASSES.values()


def prepare_qat(model: GLMModel, cfg: QATConfig) -> list[str]:
    """Switch fake quantization on, in place. Returns the quantized tensors' state-dict names."""
    if any(_is_qat(m) for m in model.modules()):
        raise ValueError("model is already prepared for QAT; call remove_qat first")
    mods = quantized_modules(model, cfg)
    for m in mods.values():
        m.__class__ = _qat_class(type(m))
        m._qat_group_size = cfg.group_size
        m._qat_memo = None
    return quantized_tensor_names(model, cfg)


def enable_lsq(model: GLMModel) -> list[nn.Parameter]:
    """Learned step sizes for a QAT-prepared model: every fake-quantized tensor gets a trainable
    per-group scale, initialised to round-to-nearest's amax / 7.5, used by its fake quantization
    from now on. The scales are kept outside the module's parameters (state_dict and the
    optimizer routing are unchanged); train them with lsq_parameters(model) in an AdamW group
    without weight decay. remove_qat(bake=True) bakes with them. convert_int4 recomputes
    amax / 7.5 scales, so an LSQ model is exported by baking first and storing the learned
    scales (not implemented here: lsq_scales(model) gives them). Returns the new parameters."""
    out = []
    for m in model.modules():
        if not _is_qat(m):
            continue
        scales = {}
        for p in _param_names(m):
            w = m._parameters[p].detach()
            s = kernels_int4_scales(w.reshape(-1, w.shape[-1]), m._qat_group_size).view(*w.shape[:-1], -1)
            scales[p] = nn.Parameter(s.clone())
            out.append(scales[p])
        m.__dict__["_lsq_scales"] = scales
    if not out:
        raise ValueError("enable_lsq needs a model prepared with prepare_qat")
    return out


def lsq_parameters(model: GLMModel) -> list[nn.Parameter]:
    return [s for m in model.modules() if _is_qat(m) for s in (m.__dict__.get("_lsq_scales") or {}).values()]


@torch.no_grad()
def remove_qat(model: GLMModel, bake: bool = False) -> None:
    """Switch fake quantization off, in place. bake=True first writes the quantized values into
    the weights (with the learned scales under LSQ), so the plain model then computes what the
    INT4 model does."""
    for m in model.modules():
        if not _is_qat(m):
            continue
        if bake:
            lsq = m.__dict__.get("_lsq_scales") or {}
            for p in _param_names(m):
                w = m._parameters[p]
                w.copy_(fake_quantize_lsq(w, lsq[p], m._qat_group_size) if p in lsq
                        else fake_quantize(w, m._qat_group_size))
        m.__class__ = m._qat_base
        del m._qat_group_size, m._qat_memo
        m.__dict__.pop("_lsq_scales", None)


def ptq_int4(model: GLMModel, cfg: QATConfig) -> GLMModel:
    """Round-to-nearest post-training quantization: a copy of a full-precision model whose
    selected weights hold their int4 values (the baseline QAT is compared against)."""
    if any(_is_qat(m) for m in model.modules()):
        raise ValueError("ptq_int4 takes a full-precision model; this one is prepared for QAT")
    out = copy.deepcopy(model)
    prepare_qat(out, cfg)
    remove_qat(out, bake=True)
    return out


# ---------------------------------------------------------------- real INT4
def _check_prepared_group(model: GLMModel, cfg: QATConfig) -> dict[str, nn.Module]:
    mods = quantized_modules(model, cfg)
    for n, m in mods.items():
        if _is_qat(m) and m._qat_group_size != cfg.group_size:
            raise ValueError(f"{n} was prepared with group_size={m._qat_group_size}, cfg has {cfg.group_size}")
    return mods


@torch.no_grad()
def quantize_tensor(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., in] -> (packed uint8 [..., in/2], scales [..., in/group_size]); 3-D = per expert."""
    q, s = quantize_int4(w.reshape(-1, w.shape[-1]), group_size)
    return pack_int4(q).view(*w.shape[:-1], -1), s.view(*w.shape[:-1], -1)


@torch.no_grad()
def convert_int4(model: GLMModel, cfg: QATConfig) -> dict[str, torch.Tensor]:
    """The model's state dict with each quantized tensor X replaced by X_packed + X_scale.
    Works on a QAT-prepared model (its raw weights give the same int4 values the fake
    quantization used) and on a plain one (= round-to-nearest PTQ)."""
    mods = _check_prepared_group(model, cfg)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {}
    for n, m in mods.items():
        for p in _param_names(m):
            packed, scales = quantize_tensor(sd.pop(f"{n}.{p}"), cfg.group_size)
            out[f"{n}.{p}{PACKED}"], out[f"{n}.{p}{SCALE}"] = packed, scales
    out.update(sd)
    return out


def int4_bytes(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """Bytes of the quantized tensors in `tensors` (convert_int4 output) against fp16/bf16.
    int4_ratio is 0.25 by construction; ratio_with_scales adds the scales in their stored dtype."""
    packed = {k[: -len(PACKED)]: v for k, v in tensors.items() if k.endswith(PACKED)}
    n_params = sum(2 * v.numel() for v in packed.values())
    int4 = sum(v.numel() * v.element_size() for v in packed.values())
    scales = sum(tensors[k + SCALE].numel() * tensors[k + SCALE].element_size() for k in packed)
    fp16 = 2 * n_params
    return {"quantized_params": n_params, "fp16_bytes": fp16, "int4_bytes": int4, "scale_bytes": scales,
            "int4_ratio": int4 / fp16 if fp16 else 0.0,
            "ratio_with_scales": (int4 + scales) / fp16 if fp16 else 0.0}


def save_int4(model: GLMModel, cfg: QATConfig, out_dir: str | Path) -> Path:
    """convert_int4 -> out_dir/model_int4.safetensors (model and QAT configs in the metadata)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous().clone() for k, v in convert_int4(model, cfg).items()}  # clone: tied weights
    meta = {"glmforge_config": model.config.model_dump_json(), "qat_config": cfg.model_dump_json(),
            "format": "pt"}
    save_file(tensors, str(out / INT4_FILE), metadata=meta)
    return out / INT4_FILE


# ---------------------------------------------------------------- INT4 inference modules
class Int4Linear(nn.Module):
    """y = x @ dequant(W).T through kernels.int4.int4_matmul (Triton on CUDA, torch on CPU)."""

    def __init__(self, in_features: int, out_features: int, group_size: int, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // group_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_matmul(x, self.weight_packed, self.weight_scale, self.group_size)

    @property
    def weight(self) -> torch.Tensor:
        # For code that reads the matrix itself (MLA's absorbed decode folds kv_b_proj.weight).
        return dequantize_int4(self.weight_packed, self.weight_scale, self.group_size)


class Int4Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, group_size: int, dtype: torch.dtype):
        super().__init__()
        self.group_size = group_size
        self.register_buffer("weight_packed", torch.zeros(num_embeddings, dim // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(num_embeddings, dim // group_size, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_int4(self.weight_packed[ids.reshape(-1)], self.weight_scale[ids.reshape(-1)], self.group_size)
        return rows.view(*ids.shape, -1)

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_int4(self.weight_packed, self.weight_scale, self.group_size)


class Int4Experts(nn.Module):
    """Packed routed experts in INT4; the same expert loop as model.moe.Experts with every
    expert matmul through int4_matmul."""

    def __init__(self, E: int, I: int, D: int, group_size: int, dtype: torch.dtype):
        super().__init__()
        self.group_size = group_size
        for name, (out_f, in_f) in {"gate_up_proj": (2 * I, D), "down_proj": (D, I)}.items():
            self.register_buffer(name + PACKED, torch.zeros(E, out_f, in_f // 2, dtype=torch.uint8))
            self.register_buffer(name + SCALE, torch.zeros(E, out_f, in_f // group_size, dtype=dtype))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """x [N,D], chosen/gates [N,K] -> [N,D]."""
        g = self.group_size
        y = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            tok, slot = torch.where(chosen == e)
            gate, up = int4_matmul(x[tok], self.gate_up_proj_packed[e], self.gate_up_proj_scale[e], g).chunk(2, dim=-1)
            h = int4_matmul(F.silu(gate) * up, self.down_proj_packed[e], self.down_proj_scale[e], g)
            y.index_add_(0, tok, (h * gates[tok, slot, None]).to(y.dtype))
        return y


def _int4_module(m: nn.Module, group_size: int, dtype: torch.dtype) -> nn.Module:
    if isinstance(m, Experts):
        E, two_i, D = m.gate_up_proj.shape
        return Int4Experts(E, two_i // 2, D, group_size, dtype)
    if isinstance(m, nn.Embedding):
        return Int4Embedding(m.num_embeddings, m.embedding_dim, group_size, dtype)
    return Int4Linear(m.in_features, m.out_features, group_size, dtype)


def int4_model(model_cfg: ModelConfig, cfg: QATConfig, dtype: torch.dtype = torch.float32) -> GLMModel:
    """A GLMModel whose quantized modules are Int4 modules (empty buffers, to be loaded)."""
    model = GLMModel(model_cfg)
    if model_cfg.tie_word_embeddings and (cfg.head or cfg.embeddings):
        raise ValueError("INT4 inference with tie_word_embeddings needs head=False and embeddings=False")
    for name, m in quantized_modules(model, cfg).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, _int4_module(m, cfg.group_size, dtype))
    return model


def load_int4_model(path: str | Path) -> GLMModel:
    """save_int4's file (or its directory) -> GLMModel in eval mode whose quantized linears run
    through int4_matmul (dequantise-matmul) and whose experts/embeddings stay int4 in memory."""
    p = Path(path)
    p = p / INT4_FILE if p.is_dir() else p
    if not p.exists():
        raise ValueError(f"no INT4 checkpoint at {p}")
    with safe_open(str(p), framework="pt") as fh:
        meta = fh.metadata() or {}
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    if "glmforge_config" not in meta or "qat_config" not in meta:
        raise ValueError(f"{p} is not a glmforge INT4 checkpoint (metadata lacks the configs)")
    model_cfg = ModelConfig.model_validate_json(meta["glmforge_config"])
    cfg = QATConfig.model_validate(json.loads(meta["qat_config"]))
    scale_dtype = next((v.dtype for k, v in tensors.items() if k.endswith(SCALE)), torch.float32)
    model = int4_model(model_cfg, cfg, scale_dtype)
    model.load_state_dict(tensors, strict=True)
    return model.eval()
