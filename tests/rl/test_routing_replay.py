"""Routing replay (R3): rollouts record the experts each input token went to; the trainer's
forward passes use them, with the router still trained through the gates."""
from __future__ import annotations

import pytest
import torch

from model.moe import recording_routes, replaying_routes, trunk_moe
from quant.qat import QATConfig
from rl.rollout import SamplingParams
from rl.update import collate, recompute_old_logprobs
from tests.rl.conftest import small_model
from tests.rl.test_rollout import _engine, _samples

PAD = "<|pad|>"


def _rollouts(tokenizer, model, int4=None):
    engine = _engine(tokenizer, model, int4)
    engine.record_routes = True
    samples = _samples(tokenizer, 3, 3)
    engine.generate(samples, SamplingParams(1.0, 1.0, 8), torch.Generator().manual_seed(0))
    return samples


def test_rollouts_record_one_route_per_input_token_and_replay_uses_them(tokenizer):
    model = small_model(tokenizer.get_vocab_size())
    samples = _rollouts(tokenizer, model, QATConfig(group_size=16))
    k, layers = model.config.num_experts_per_tok, len(trunk_moe(model))
    for s in samples:
        assert s.routes.shape == (layers, len(s.prompt_ids) + len(s.response_ids) - 1, k)
    batch = collate(samples, tokenizer.token_to_id(PAD))
    # a replayed forward routes every real token exactly as the rollout did
    with replaying_routes(model, batch["routes"]), recording_routes(model) as logs, torch.no_grad():
        model(batch["input_ids"], attention_mask=batch["attention_mask"])
    real = batch["attention_mask"].bool()
    for want, got in zip(batch["routes"], logs):
        assert torch.equal(got[0][real].sort(-1).values.long(), want[real].sort(-1).values)


def test_replay_on_the_rollout_weights_reproduces_the_rollout_logprobs(tokenizer):
    model = small_model(tokenizer.get_vocab_size())
    samples = _rollouts(tokenizer, model)              # full-precision rollouts: the same weights
    recompute_old_logprobs(model, samples, tokenizer.token_to_id(PAD), 1.0)
    for s in samples:
        assert s.train_logprobs == pytest.approx(s.rollout_logprobs, abs=1e-4)


def test_the_router_keeps_its_gradient_under_replay(tokenizer):
    model = small_model(tokenizer.get_vocab_size())
    samples = _rollouts(tokenizer, model, QATConfig(group_size=16))
    batch = collate(samples, tokenizer.token_to_id(PAD))
    with replaying_routes(model, batch["routes"]):
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    out.float().logsumexp(-1).mean().backward()
    routers = [m.gate.weight.grad for m in model.modules() if hasattr(m, "gate") and hasattr(m.gate, "weight")]
    assert routers and all(g is not None and g.abs().sum() > 0 for g in routers)


def test_replay_needs_routes_for_every_moe_layer(tokenizer):
    model = small_model(tokenizer.get_vocab_size())
    n = len(trunk_moe(model))
    with pytest.raises(ValueError, match=f"routes for {n + 1} MoE layers, the model has {n}"):
        with replaying_routes(model, [torch.zeros(1, 1, 2, dtype=torch.long)] * (n + 1)):
            pass
