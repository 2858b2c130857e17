"""The rollout engine and one GRPO update on a tiny random model."""
from __future__ import annotations

import pytest
import torch

from chat.template import STOP_TOKENS
from domains import arithmetic
from quant.qat import QATConfig
from rl.rollout import RolloutEngine, SamplingParams, prompt_ids
from rl.sample import Sample, Status
from rl.update import (
    UpdateParams,
    assign_advantages,
    collate,
    recompute_old_logprobs,
    response_logprobs,
    update,
)
from tests.rl.conftest import small_model


def _samples(tokenizer, n_prompts=3, group=4):
    tasks = arithmetic.tasks(n_prompts, "train", seed=0)
    return [Sample(t, g, prompt_ids(tokenizer, t)) for g, t in enumerate(tasks) for _ in range(group)]


def _engine(tokenizer, model, int4=None):
    stops = [tokenizer.token_to_id(t) for t in STOP_TOKENS]
    return RolloutEngine(model, tokenizer, stops, tokenizer.token_to_id("<|pad|>"), int4=int4, batch_size=5)


def test_rollouts_stop_on_a_stop_token_and_carry_version_and_logprobs(tokenizer):
    model = small_model(tokenizer.get_vocab_size())
    engine = _engine(tokenizer, model)
    engine.sync(model, version=7)
    samples = _samples(tokenizer)
    engine.generate(samples, SamplingParams(1.0, 1.0, 12), torch.Generator().manual_seed(0))
    stops = {tokenizer.token_to_id(t) for t in STOP_TOKENS}
    for s in samples:
        assert 1 <= len(s.response_ids) <= 12
        assert s.versions == [7] * len(s.response_ids) and s.loss_mask == [1] * len(s.response_ids)
        if s.status == Status.OK:
            assert s.response_ids[-1] in stops and not stops & set(s.response_ids[:-1])
        else:
            assert s.status == Status.TRUNCATED and len(s.response_ids) == 12 and not stops & set(s.response_ids)
    # the trainer's recomputation on the same ids matches the engine's log-probs (same weights)
    recompute_old_logprobs(model, samples, tokenizer.token_to_id("<|pad|>"), 1.0)
    for s in samples:
        assert s.train_logprobs == pytest.approx(s.rollout_logprobs, abs=1e-4)


def test_int4_rollouts_differ_from_the_trained_weights(tokenizer):
    model = small_model(tokenizer.get_vocab_size())
    engine = _engine(tokenizer, model, int4=QATConfig(group_size=16))
    samples = _samples(tokenizer)
    engine.generate(samples, SamplingParams(1.0, 1.0, 8), torch.Generator().manual_seed(0))
    recompute_old_logprobs(model, samples, tokenizer.token_to_id("<|pad|>"), 1.0)
    gap = max(abs(a - b) for s in samples for a, b in zip(s.train_logprobs, s.rollout_logprobs))
    assert gap > 1e-3


def test_collate_aligns_response_tokens_with_targets():
    from domains.task import Task

    s = Sample(Task("arithmetic", "", ""), 0, [5, 6, 7], [8, 9], rollout_logprobs=[-0.5, -0.25],
               loss_mask=[1, 1], advantage=1.5)
    b = collate([s, Sample(Task("arithmetic", "", ""), 1, [5], [4], rollout_logprobs=[-1.0], loss_mask=[1])], pad_id=0)
    assert b["input_ids"][0].tolist() == [5, 6, 7, 8] and b["targets"][0].tolist() == [6, 7, 8, 9]
    assert b["response_mask"][0].tolist() == [0, 0, 1, 1]
    assert b["rollout_logprobs"][0].tolist() == [0, 0, -0.5, -0.25]
    assert b["response_mask"][1].tolist() == [1, 0, 0, 0] and b["attention_mask"][1].tolist() == [1, 0, 0, 0]
    assert b["advantages"].tolist() == [1.5, 0.0]



def test_response_logprobs_equal_the_full_softmax_where_a_response_token_is_predicted():
    """The vocabulary softmax only at response positions (tool results inside one included): the
    same values and gradients as over every position, zeros elsewhere."""
    from domains.task import Task

    s = Sample(Task("arithmetic", "", ""), 0, [5, 6, 7], [8, 9, 3], rollout_logprobs=[-0.5, -0.1, -0.2],
               loss_mask=[1, 0, 1])
    b = collate([s, Sample(Task("arithmetic", "", ""), 1, [5], [4], rollout_logprobs=[-1.0], loss_mask=[1])], pad_id=0)
    assert b["response_region"].tolist() == [[0, 0, 1, 1, 1], [1, 0, 0, 0, 0]]
    logits = torch.randn(2, 5, 11, requires_grad=True)
    got, ent = response_logprobs(logits, b, 0.7, want_entropy=True)
    full = (logits / 0.7).log_softmax(-1)
    want = full.gather(-1, b["targets"][..., None]).squeeze(-1) * b["response_region"]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1).detach() * b["response_region"])
    g1, = torch.autograd.grad((got * b["response_mask"]).sum(), logits)
    g2, = torch.autograd.grad((want * b["response_mask"]).sum(), logits)
    torch.testing.assert_close(g1, g2)
    # the same from the [N,V] rows a model returns with logits_at
    rows, _ = response_logprobs(logits[b["response_region"] > 0], b, 0.7)
    torch.testing.assert_close(rows, want)


def test_logits_at_gives_the_full_logits_rows(tokenizer):
    model = small_model(tokenizer.get_vocab_size())
    ids = torch.randint(0, 50, (2, 7))
    at = torch.zeros(2, 7, dtype=torch.bool)
    at[0, 3:], at[1, :2] = True, True
    with torch.no_grad():
        full = model(ids).logits
        torch.testing.assert_close(model(ids, logits_at=at).logits, full[at])

def _scored(tokenizer, model, seed=0):
    engine = _engine(tokenizer, model)
    samples = _samples(tokenizer, 4, 4)
    engine.generate(samples, SamplingParams(1.0, 1.0, 6), torch.Generator().manual_seed(seed))
    for i, s in enumerate(samples):
        s.reward = float(i % 3 == 0)
    assign_advantages(samples, std_normalize=False)
    return samples


def test_one_minibatch_step_has_ratio_one_and_never_clips(tokenizer):
    model = small_model(tokenizer.get_vocab_size())
    samples = _scored(tokenizer, model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    stats = update(model, opt, samples, tokenizer.token_to_id("<|pad|>"), UpdateParams(minibatches=1),
                   torch.Generator().manual_seed(0))
    assert stats["optimizer_steps"] == 1 and stats["clip_fraction"] == 0.0
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_several_minibatch_steps_let_the_clip_act(tokenizer):
    model = small_model(tokenizer.get_vocab_size())
    samples = _scored(tokenizer, model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    stats = update(model, opt, samples, tokenizer.token_to_id("<|pad|>"), UpdateParams(minibatches=2, epochs=3),
                   torch.Generator().manual_seed(0))
    assert stats["optimizer_steps"] == 6 and stats["clip_fraction"] > 0.0


def test_zero_variance_groups_get_zero_advantage(tokenizer):
    samples = _samples(tokenizer, 2, 3)
    for s in samples:
        s.response_ids, s.loss_mask, s.rollout_logprobs = [1], [1], [0.0]
        s.reward = 1.0 if s.group == 0 else float(samples.index(s) == 3)
    flat = assign_advantages(samples, std_normalize=True)
    assert flat == 0.5
    assert [s.advantage for s in samples[:3]] == [0.0, 0.0, 0.0]
    assert samples[3].advantage > 0 > samples[4].advantage
