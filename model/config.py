"""ModelConfig: every shape and knob of the GLM-5 architecture, frozen and validated.

The three presets derive from one another (glm5 -> small -> tiny) so a change to the
architecture's defaults travels to all of them. glm5 carries the published shapes, taken
from the defaults of transformers' GlmMoeDsaConfig (the reference implementation).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AttentionKind = Literal["full", "dsa", "swa"]


class ModelConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # ---- trunk ----
    vocab_size: int = Field(154880, gt=0)
    hidden_size: int = Field(6144, gt=0)
    num_layers: int = Field(78, gt=0)
    first_k_dense: int = Field(3, ge=0, description="leading layers with a dense MLP instead of MoE")
    intermediate_size: int = Field(12288, gt=0, description="width of the dense MLP layers")
    rms_norm_eps: float = Field(1e-5, gt=0)
    # The q/kv latent norms use a fixed eps of 1e-6 in transformers (not rms_norm_eps).
    latent_norm_eps: float = Field(1e-6, gt=0)
    tie_word_embeddings: bool = False

    # ---- MLA ----
    num_heads: int = Field(64, gt=0)
    q_lora_rank: int = Field(2048, gt=0)
    kv_lora_rank: int = Field(512, gt=0)
    qk_nope_head_dim: int = Field(192, gt=0)
    qk_rope_head_dim: int = Field(64, gt=0)
    v_head_dim: int = Field(256, gt=0)
    rope_theta: float = Field(10000.0, gt=0, description="context extension raises it")
    max_position_embeddings: int = Field(202752, gt=0)

    # ---- attention pattern / DSA ----
    # One entry per layer: "dsa" (MLA + lightning indexer top-k), "full" (dense MLA, no
    # indexer) or "swa" (dense MLA restricted to a sliding window, no indexer). None = all "dsa".
    attention_pattern: tuple[AttentionKind, ...] | None = None
    sliding_window: int = Field(4096, gt=0)
    # dense_attention=True keeps the indexers (they can still be trained, as in the DSA
    # warm-up) but the main attention of "dsa" layers ignores their selection: indexer off.
    dense_attention: bool = False
    index_n_heads: int = Field(32, gt=0)
    index_head_dim: int = Field(128, gt=0)
    index_topk: int = Field(2048, gt=0)
    # "deterministic": ties -> lower position (kernels.topk; bit-identical train/inference).
    # "torch": torch.topk as transformers does; order among exactly tied scores unspecified. Use it
    # only to reproduce transformers' selections (ReLU makes exact 0.0 ties common).
    index_topk_method: Literal["deterministic", "torch"] = "deterministic"

    # ---- MoE ----
    n_routed_experts: int = Field(256, gt=0)
    n_shared_experts: int = Field(1, ge=0)
    num_experts_per_tok: int = Field(8, gt=0)
    moe_intermediate_size: int = Field(2048, gt=0)
    routed_scaling_factor: float = Field(2.5, gt=0)
    bias_update_rate: float = Field(0.001, ge=0, description="gamma of aux-loss-free balancing")
    seq_balance_alpha: float = Field(1e-4, ge=0, description="sequence-wise balance loss weight")

    # ---- MTP ----
    mtp_depth: int = Field(3, ge=0, description="D: steps of the ONE shared MTP module (0 = no MTP)")
    mtp_loss_weight: float = Field(0.3, ge=0, description="lambda; loss = lambda/D * sum_k CE_k")

    # ---- init ----
    init_std: float = Field(0.02, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.first_k_dense > self.num_layers:
            raise ValueError(f"first_k_dense={self.first_k_dense} exceeds num_layers={self.num_layers}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} > n_routed_experts={self.n_routed_experts}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for RoPE pairs, got {self.qk_rope_head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim={self.index_head_dim} must be >= qk_rope_head_dim={self.qk_rope_head_dim}: "
                "the indexer rotates its first qk_rope_head_dim dims"
            )
        if self.attention_pattern is not None and len(self.attention_pattern) != self.num_layers:
            raise ValueError(
                f"attention_pattern has {len(self.attention_pattern)} entries, expected num_layers={self.num_layers}"
            )
        return self

    # ---- derived ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def layer_kinds(self) -> tuple[AttentionKind, ...]:
        return self.attention_pattern or ("dsa",) * self.num_layers

    def is_moe(self, layer_idx: int) -> bool:
        # The MTP block (layer_idx == num_layers) is an MoE block, like DeepSeek-V3's layer 61.
        return layer_idx >= self.first_k_dense

    def kind(self, layer_idx: int) -> AttentionKind:
        # The MTP block attends like a DSA layer.
        return "dsa" if layer_idx >= self.num_layers else self.layer_kinds[layer_idx]

    def replace(self, **changes) -> "ModelConfig":
        """A validated copy with some fields changed (model_copy skips validation)."""
        return ModelConfig(**{**self.model_dump(), **changes})


# ---------------------------------------------------------------- presets
def glm5() -> ModelConfig:
    """The published GLM-5 shapes (= transformers GlmMoeDsaConfig defaults): 744B total / 40B active."""
    return ModelConfig()


def small() -> ModelConfig:
    """~100M-class model for single-GPU experiments; same architecture, scaled down."""
    return glm5().replace(
        vocab_size=32768, hidden_size=512, num_layers=12, first_k_dense=1, intermediate_size=1536,
        num_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, index_n_heads=8, index_head_dim=64, index_topk=512,
        n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
        max_position_embeddings=8192, sliding_window=1024,
    )


def tiny() -> ModelConfig:
    """A few million parameters: trains in minutes on 2 CPU cores; index_topk=64 so 256+ token
    sequences are genuinely sparse."""
    return small().replace(
        vocab_size=8192, hidden_size=128, num_layers=4, first_k_dense=1, intermediate_size=384,
        num_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=64,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
        max_position_embeddings=2048, sliding_window=128,
    )


PRESETS = {"tiny": tiny, "small": small, "glm5": glm5}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg
