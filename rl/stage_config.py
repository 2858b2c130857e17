"""The config fields the RL-side stages share, declared once.

    RLStageConfig      every stage that trains a policy on its own rollouts (rl-reasoning,
                       rl-agentic, rl-general, distill): the clip and IcePop band, the optimizer,
                       how rollouts sample and which engine they come from, the gates,
                       checkpoints and the trainer's ranks
    GroupRLConfig      the GRPO stages over prompt groups (rl-reasoning, rl-general): advantages,
                       epochs and minibatches, batch shaping (dynamic sampling, overlong replies)

A stage's config subclasses one of them, adds its own fields and redeclares a field only where its
default or meaning differs (distill's one minibatch, rl-agentic's rollout workers)."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from quant.qat import QATConfig
from rl.algorithms import AdvantageName, PolicyLossName
from rl.dynamic_sampling import DynamicSamplingConfig, OverlongConfig
from rl.gates import GateConfig
from rl.ranks import ParallelConfig
from rl.rollout import RolloutConfig
from rl.trainer import OptimConfig


class RLStageConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    optim: OptimConfig = Field(OptimConfig(), description="the trainer's AdamW and gradient clip")
    eps_low: float = Field(0.2, ge=0, lt=1, description="PPO clip below 1")
    eps_high: float = Field(0.28, ge=0, description="PPO clip above 1 (clip-higher)")
    icepop_beta: Optional[float] = Field(2.0, gt=1, description="IcePop band [1/beta, beta]; null: off")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts")
    top_p: float = Field(1.0, gt=0, le=1, description=(
        "nucleus sampling: tokens from the smallest set whose probability reaches top_p (1: off)"))
    rollout_int4: Optional[QATConfig] = Field(None, description=(
        "rollouts from a fake-INT4 copy of the weights (the QAT kinds); null: full precision"))
    rollout_batch: int = Field(256, ge=1, description="sequences per generate() call")
    rollout: RolloutConfig = Field(RolloutConfig(), description="the engine rollouts come from: native or vLLM")
    gates: GateConfig = Field(GateConfig(), description=(
        "the evaluation gates: evals before and after, and the regression each may show (rl.gates)"))
    checkpoint_every: int = Field(20, ge=1, description="steps between checkpoints (and one at the end)")
    keep_last: int = Field(2, ge=1, description="complete checkpoints kept")
    parallel: ParallelConfig = Field(ParallelConfig(), description="the trainer's ranks (rl.ranks); one: in the "
                                     "stage's process")


class GroupRLConfig(RLStageConfig):
    prompts_per_step: int = Field(32, ge=1, description="prompts per rollout batch (GLM-5: 32)")
    std_normalize: bool = Field(False, description="divide advantages by the group's std")
    advantage: AdvantageName = Field("grpo", description="advantage estimator by name (rl.algorithms.ADVANTAGES)")
    policy_loss: PolicyLossName = Field("icepop", description="policy loss by name (rl.algorithms.POLICY_LOSSES): "
                                        "icepop, ppo, double_sided_is or a registered one")
    minibatches: int = Field(2, ge=1, description="optimizer steps per rollout batch (per epoch)")
    epochs: int = Field(1, ge=1, description=(
        "passes over each rollout batch (each pass takes `minibatches` optimizer steps)"))
    max_new_tokens: int = Field(512, ge=1, description="tokens a rollout's response may have at most")
    dynamic_sampling: DynamicSamplingConfig = Field(DynamicSamplingConfig(), description=(
        "replace zero-variance groups with fresh prompts' groups, within a bound per step (rl.dynamic_sampling)"))
    overlong: OverlongConfig = Field(OverlongConfig(), description="what a response that hit max_new_tokens "
                                     "trains as: keep, filter, penalty (rl.dynamic_sampling)")
    examples: int = Field(8, ge=0, description="rollouts of the last step written to samples.jsonl")
    threads: Optional[int] = Field(None, ge=1, description="torch threads of the trainer process (None: torch's "
                                   "default; tiny matrices on a shared CPU run fastest on 1)")
