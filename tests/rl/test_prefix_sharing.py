"""A prompt shared by a group's samples is computed once, in rollouts and in the trainer, with
the same results as computing it for every sample."""
from __future__ import annotations

import pytest
import torch

from model.config import tiny
from model.generate import generate
from model.model import GLMModel
from rl.rollout import SamplingParams
from rl.sample import Sample
from rl.update import _forward_logprobs, collate, recompute_old_logprobs
from tests.rl.conftest import small_model
from tests.rl.test_rollout import _engine, _samples

PAD = 0


def _model(vocab: int = 97, window: int | None = None, topk: int = 8) -> GLMModel:
    """Every attention kind: a DSA layer that truly selects (top-k 8 of 20+ keys), a dense one, a
    sliding-window one; MoE after the first layer."""
    torch.manual_seed(0)
    return GLMModel(tiny().replace(vocab_size=vocab, num_layers=3, mtp_depth=0, hidden_size=32, num_heads=2,
                                   q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                   v_head_dim=8, index_n_heads=2, index_head_dim=8, index_topk=topk,
                                   intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
                                   num_experts_per_tok=2, sliding_window=window or 6,
                                   attention_pattern=("dsa", "full", "swa")))


def _groups(lengths: list[int], group: int, vocab: int = 97, seed: int = 0) -> list[Sample]:
    """Random prompts of the given lengths, `group` random responses each (some with an untrained
    tool-result span, as agentic episodes have)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(lengths):
        prompt = torch.randint(1, vocab, (n,), generator=g).tolist()
        for i in range(group):
            r = int(torch.randint(1, 9, (1,), generator=g))
            s = Sample(None, k, list(prompt))
            s.response_ids = torch.randint(1, vocab, (r,), generator=g).tolist()
            s.loss_mask = [0 if (i % 2 and 0 < j < 3) else 1 for j in range(r)]
            s.rollout_logprobs = [0.0] * r
            s.advantage = float(torch.randn(1, generator=g))
            out.append(s)
    return out


def _per_sample(logp: torch.Tensor, batch, samples) -> list[torch.Tensor]:
    return [logp[b, len(s.prompt_ids) - 1 - int(batch["offsets"][b]):][:len(s.response_ids)]
            for b, s in enumerate(samples)]


def test_collate_shares_only_repeated_prompts():
    samples = _groups([5, 9], group=3)
    shared = collate(samples, PAD, share_prefix=True)
    prefix = shared["prefix"]
    assert prefix["input_ids"].shape == (2, 8)                 # each prompt but its last token, once
    assert prefix["rows"].tolist() == [0, 0, 0, 1, 1, 1]
    assert prefix["attention_mask"].sum(1).tolist() == [4, 8]  # left-padded
    assert shared["offsets"].tolist() == [4] * 3 + [8] * 3
    # every row starts at its prompt's last token: the first target is the first response token
    for b, s in enumerate(samples):
        assert shared["input_ids"][b, 0] == s.prompt_ids[-1] and shared["targets"][b, 0] == s.response_ids[0]
    assert "prefix" not in collate(_groups([5, 9], group=1), PAD, share_prefix=True)   # nothing repeats


@pytest.mark.parametrize("lengths", [[22, 30, 25], [3, 28]])
def test_a_shared_prompt_gives_the_same_logprobs_and_gradients(lengths):
    model = _model()
    model.train()
    samples = _groups(lengths, group=4)
    results = []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        batch = collate(samples, PAD, share)
        assert ("prefix" in batch) == share
        logp, _ = _forward_logprobs(model, batch, 1.0)
        (logp * batch["response_mask"] * batch["advantages"][:, None]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((_per_sample(logp.detach(), batch, samples), grads))
    (plain, g_plain), (shared, g_shared) = results
    for a, b in zip(plain, shared):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    assert g_plain.keys() == g_shared.keys() and len(g_plain) > 10
    for name in g_plain:
        torch.testing.assert_close(g_shared[name], g_plain[name], atol=1e-5, rtol=1e-3, msg=name)


def test_the_trainer_records_the_same_old_logprobs_either_way():
    model = _model()
    a, b = _groups([12, 17], group=3), _groups([12, 17], group=3)
    recompute_old_logprobs(model, a, PAD, 1.0, share_prefix=False)
    recompute_old_logprobs(model, b, PAD, 1.0, share_prefix=True)
    for x, y in zip(a, b):
        assert y.train_logprobs == pytest.approx(x.train_logprobs, abs=2e-5)


def test_one_prefill_per_prompt_samples_what_a_prefill_per_sample_does():
    model = _model()
    prompts = [torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 11)]
    rows = torch.tensor([0, 0, 0, 1, 1, 1])

    def left_pad(ps):
        ids, mask = torch.zeros(len(ps), 11, dtype=torch.long), torch.zeros(len(ps), 11, dtype=torch.long)
        for i, p in enumerate(ps):
            ids[i, 11 - len(p):], mask[i, 11 - len(p):] = torch.tensor(p), 1
        return ids, mask

    ids, mask = left_pad([prompts[r] for r in rows])
    every = generate(model, ids, 10, attention_mask=mask, generator=torch.Generator().manual_seed(3))
    ids, mask = left_pad(prompts)
    once = generate(model, ids, 10, attention_mask=mask, generator=torch.Generator().manual_seed(3), rows=rows)
    assert torch.equal(once.new_tokens, every.new_tokens)
    torch.testing.assert_close(once.logprobs, every.logprobs, atol=1e-5, rtol=1e-5)


def test_grouped_rollouts_replay_their_routes_through_a_shared_prompt(tokenizer):
    model = small_model(tokenizer.get_vocab_size())
    engine = _engine(tokenizer, model)
    engine.record_routes = True
    samples = _samples(tokenizer, 2, 3)
    engine.generate(samples, SamplingParams(1.0, 1.0, 8), torch.Generator().manual_seed(0))
    for s in samples:          # the prompt's routes, computed once, given to each of its samples
        assert s.routes.shape[1] == len(s.prompt_ids) + len(s.response_ids) - 1
    assert torch.equal(samples[0].routes[:, :len(samples[0].prompt_ids)],
                       samples[1].routes[:, :len(samples[1].prompt_ids)])
    recompute_old_logprobs(model, samples, tokenizer.token_to_id("<|pad|>"), 1.0, share_prefix=True)
    for s in samples:
        assert s.train_logprobs == pytest.approx(s.rollout_logprobs, abs=1e-4)


def _turns(engine, first: list[list[int]], replies: list[list[int]], gen_seed: int, skip_cache: bool):
    """Two calls as an agent makes them: the prefixes, then each prefix + its sampled tokens + a
    tool reply (a new row too, with no history)."""
    from rl.rollout import SamplingParams

    if skip_cache:
        engine.turns.longest = lambda p: (0, None)
    params = SamplingParams(1.0, 1.0, 6)
    one = engine.complete(first, params, torch.Generator().manual_seed(gen_seed))
    nxt = [p + toks + r for p, (toks, *_), r in zip(first, one, replies)] + [[7, 8, 9]]
    return one, engine.complete(nxt, params, torch.Generator().manual_seed(gen_seed + 1))


def _count_widths(engine) -> list[int]:
    """The width of every forward the engine's model runs from now on (a prefill is wider than 1)."""
    fed: list[int] = []
    real = engine.model.forward

    def counting(ids, *a, **k):
        fed.append(ids.shape[1])
        return real(ids, *a, **k)

    engine.model.forward = counting
    return fed


def test_an_agents_next_turn_feeds_only_what_is_new_and_samples_the_same():
    from rl.rollout import RolloutEngine

    model = _model(window=6)
    g = torch.Generator().manual_seed(5)
    first = [torch.randint(6, 97, (n,), generator=g).tolist() for n in (9, 14, 4)]
    replies = [[11, 12, 13], [21], [31, 32, 33, 34, 35, 36, 37]]
    runs = []
    for skip in (True, False):
        engine = RolloutEngine(model, None, [5], PAD, batch_size=8)
        fed = _count_widths(engine)
        runs.append((_turns(engine, first, replies, 3, skip), fed))
    (plain, fed_plain), (cached, fed_cached) = runs
    for a, b in zip(plain[0] + plain[1], cached[0] + cached[1]):
        assert a[0] == b[0] and a[2] == b[2]                                  # same tokens, same stops
        assert a[1] == pytest.approx(b[1], abs=1e-4)
    # the second call's prefill (the forwards wider than one token are the two prefills): the whole
    # conversation without the cache; with it, the new tokens only (the longest: a 7-token reply
    # after its turn's last sampled token)
    second = [len(p) + len(t) + len(r) for p, (t, *_), r in zip(first, plain[0], replies)]
    assert [w for w in fed_plain if w > 1] == [14, max(second)]
    assert [w for w in fed_cached if w > 1] == [14, 8]


def test_a_turn_whose_context_was_rewritten_is_prefilled_whole_and_samples_the_same():
    """Context management (keep-recent-k) forks a trajectory: the next turn's context drops
    tokens the previous call held, so no remembered row is a prefix of it. The turn cache must
    then feed the whole rewritten context, and sample what an engine without the cache does; a
    row whose history was kept still continues its cache."""
    from rl.rollout import RolloutEngine, SamplingParams

    model = _model(window=6)
    g = torch.Generator().manual_seed(9)
    first = [torch.randint(6, 97, (n,), generator=g).tolist() for n in (12, 10)]
    params = SamplingParams(1.0, 1.0, 6)
    runs = []
    for skip in (True, False):
        engine = RolloutEngine(model, None, [5], PAD, batch_size=8)
        if skip:
            engine.turns.longest = lambda p: (0, None)
        fed = _count_widths(engine)
        one = engine.complete(first, params, torch.Generator().manual_seed(1))
        # row 0 keeps its whole history; row 1's context is rewritten: its first 4 tokens dropped
        nxt = [first[0] + one[0][0] + [41, 42], first[1][4:] + one[1][0] + [51, 52]]
        two = engine.complete(nxt, params, torch.Generator().manual_seed(2))
        runs.append((one, two, fed))
    (p1, p2, fed_plain), (c1, c2, fed_cached) = runs
    for a, b in zip(p1 + p2, c1 + c2):
        assert a[0] == b[0] and a[2] == b[2]
        assert a[1] == pytest.approx(b[1], abs=1e-4)
    rewritten = len(first[1]) - 4 + len(p1[1][0]) + 2
    assert [w for w in fed_cached if w > 1][-1] == rewritten       # the rewritten row, fed whole
    assert [w for w in fed_plain if w > 1][-1] == max(rewritten, len(first[0]) + len(p1[0][0]) + 2)
