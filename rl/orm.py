"""The outcome reward model (ORM): a policy backbone with a scalar head, trained by the
reward-model stage (posttrain.reward_model) and read by general RL's judge (rl.judges.orm_judge),
in the stage's process or on a native inference server (rl.native_server).

An artifact is backbone.safetensors (a state file), head.safetensors (the head and the
likelihood weights) and orm.json (the held-out score mean and std the judge standardises by).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from model.hf import load_state, save_state
from model.model import GLMModel

ARTIFACT_FILES = ("backbone.safetensors", "head.safetensors", "orm.json")


class RewardModel(torch.nn.Module):
    """r(x, y) = w . norm(h_last) + a . [mean, min] of log p(y_t | y_<t, x) over the reply's tokens.

    The second term gives the head the backbone's own likelihood of the reply. A last-token scalar
    head on a small backbone cannot learn to check a reply (on the tiny preset, trained on 2,000
    sampled addition pairs, it ranked the policy's right sums above its wrong ones in 0.5 of
    pairs); the backbone's likelihood of the reply's tokens already ranks them (0.88), and the
    Bradley-Terry loss learns how much to trust it."""

    def __init__(self, backbone: GLMModel, pad_id: int):
        super().__init__()
        self.backbone, self.pad_id = backbone, pad_id
        self.head = torch.nn.Linear(backbone.config.hidden_size, 1)
        self.likelihood = torch.nn.Linear(2, 1, bias=False)
        for p in (self.head.weight, self.head.bias, self.likelihood.weight):
            torch.nn.init.zeros_(p)                 # start at r = 0 everywhere: no prior preference

    def forward(self, items: list[tuple[list[int], int]]) -> torch.Tensor:
        """(ids, reply start) per conversation, as pair_text_ids returns -> one score each [B]."""
        T = max(len(ids) for ids, _ in items)
        x = torch.full((len(items), T), self.pad_id, dtype=torch.long)
        att = torch.zeros_like(x)
        reply = torch.zeros(len(items), T - 1, dtype=torch.bool)     # positions predicting a reply token
        for b, (ids, start) in enumerate(items):
            x[b, : len(ids)] = torch.tensor(ids)
            att[b, : len(ids)] = 1
            reply[b, start - 1: len(ids) - 1] = True
        out = self.backbone(x, attention_mask=att, return_hidden=True, compute_mtp=False)
        last = out.hidden[torch.arange(len(items)), torch.tensor([len(ids) - 1 for ids, _ in items])]
        lp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, x[:, 1:, None]).squeeze(-1)
        n = reply.sum(1).clamp_min(1)
        mean = (lp * reply).sum(1) / n
        low = lp.masked_fill(~reply, 0.0).min(1).values
        feats = torch.stack([mean, low], -1)
        return (self.head(self.backbone.norm(last).float()) + self.likelihood(feats)).squeeze(-1)

    @torch.no_grad()
    def score_ids(self, ids: list[tuple[list[int], int]], batch: int = 32) -> torch.Tensor:
        was = self.training
        self.eval()
        try:
            return torch.cat([self(ids[i:i + batch]) for i in range(0, len(ids), batch)])
        finally:
            self.train(was)


def save_reward_model(rm: RewardModel, out: Path, info: dict[str, Any]) -> None:
    save_state(rm.backbone, out / "backbone.safetensors")
    heads = {**{f"head.{k}": v for k, v in rm.head.state_dict().items()},
             **{f"likelihood.{k}": v for k, v in rm.likelihood.state_dict().items()}}
    save_file({k: v.detach().contiguous() for k, v in heads.items()}, str(out / "head.safetensors"))
    (out / "orm.json").write_text(json.dumps(info, indent=1))


def load_info(d: Path) -> dict[str, Any]:
    """orm.json of an artifact: max_len, the held-out score mean and std, its accuracy."""
    path = Path(d) / "orm.json"
    if not path.is_file():
        raise FileNotFoundError(f"{d}: not a reward-model artifact (no orm.json)")
    return json.loads(path.read_text())


def load_reward_model(d: Path, pad_id: int) -> tuple[RewardModel, dict[str, Any]]:
    d = Path(d)
    for f in ARTIFACT_FILES:
        if not (d / f).exists():
            raise FileNotFoundError(f"{d}: not a reward-model artifact (no {f})")
    rm = RewardModel(load_state(d / "backbone.safetensors"), pad_id)
    heads = load_file(str(d / "head.safetensors"))
    if "likelihood.weight" not in heads:
        raise ValueError(f"{d}: a reward-model artifact from before the likelihood features; rerun reward-model")
    rm.head.load_state_dict({k[5:]: v for k, v in heads.items() if k.startswith("head.")})
    rm.likelihood.load_state_dict({k[11:]: v for k, v in heads.items() if k.startswith("likelihood.")})
    rm.eval()
    return rm, json.loads((d / "orm.json").read_text())
