"""The one record that flows through RL unchanged: rollout -> reward -> advantage -> loss.

Token ids end to end: the rollout engine fills prompt_ids / response_ids and the per-token
rollout log-probs and policy versions; rewards read the decoded text but never change the ids;
the trainer recomputes log-probs on exactly these ids (it never re-tokenises text).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from domains.task import Task


class Status(str, Enum):
    OK = "ok"                      # finished on a stop token, reward computed
    TRUNCATED = "truncated"        # hit max_new_tokens before a stop token (still trained: reward as scored)
    ABORTED = "aborted"            # generation was cancelled (never trained)
    REWARD_ERROR = "reward_error"  # the reward function failed or timed out (never trained)



@dataclass
class Sample:
    task: Task
    group: int                                   # samples of one prompt share a group id
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)   # inference engine, per response token
    versions: list[int] = field(default_factory=list)             # policy version per response token
    loss_mask: list[int] = field(default_factory=list)            # 1 = model-generated and trained
    status: Status = Status.OK
    reward: float = 0.0
    rewards: dict[str, float] = field(default_factory=dict)       # per component (hybrid rewards)
    reward_reason: str = ""
    reward_recheck: float | None = None          # independent re-check of a reward: 1 agrees, 0 not (rl.reward_audit)
    canary_cheat: float | None = None            # a canary task: 1 its contradicting tests passed (a cheat), 0 not
    advantage: float = 0.0
    train_logprobs: list[float] | None = None    # pi_train(theta_old), recomputed by the trainer
    teacher_logprobs: list[float] | None = None  # a teacher's log-probs of the response (distillation)
    text: str = ""                               # decoded response, for rewards and logs only
    # routing replay: the experts each input token (prompt + response[:-1]) was routed to at
    # rollout, [MoE layers, tokens, K] int16 (rl.rollout with record_routes)
    routes: torch.Tensor | None = None

    @property
    def trainable(self) -> bool:
        return self.status in (Status.OK, Status.TRUNCATED) and sum(self.loss_mask) > 0
