"""Generation with the latent cache vs recomputation; speculative decoding vs plain greedy."""

import pytest
import torch

from model.config import preset
from model.generate import generate
from model.model import GLMModel
from model.speculative import speculative_generate


@pytest.fixture
def small_topk_model():
    torch.manual_seed(0)
    return GLMModel(preset("tiny", index_topk=16)).eval()   # prompts + outputs exceed top-k


def test_cache_equals_recomputation_greedy_and_sampled(small_topk_model):
    x = torch.randint(0, 8192, (2, 12))
    for kw in ({"greedy": True}, {"seed": 3, "temperature": 0.8, "top_p": 0.9}):
        a = generate(small_topk_model, x, 20, **kw)
        b = generate(small_topk_model, x, 20, use_cache=False, **kw)
        assert torch.equal(a.tokens, b.tokens)
        assert (a.logprobs - b.logprobs).abs().max() < 1e-4
    assert a.new_tokens.shape == (2, 20) and torch.equal(a.tokens[:, :12], x)


def test_logprobs_match_a_scoring_forward(small_topk_model):
    x = torch.randint(0, 8192, (1, 8))
    g = generate(small_topk_model, x, 10, seed=0, temperature=0.7)
    with torch.no_grad():
        logits = small_topk_model(g.tokens[:, :-1]).logits[:, 7:]
    ref = (logits / 0.7).log_softmax(-1).gather(-1, g.new_tokens[..., None])[..., 0]
    assert (ref - g.logprobs).abs().max() < 1e-4


def test_left_padding(small_topk_model):
    x = torch.randint(0, 8192, (2, 12))
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    a = generate(small_topk_model, x, 8, greedy=True, attention_mask=mask)
    b = generate(small_topk_model, x[:1, 5:], 8, greedy=True)
    assert torch.equal(a.new_tokens[0], b.new_tokens[0])


def test_speculative_greedy_equals_plain_greedy(small_topk_model):
    x = torch.randint(0, 8192, (1, 10))
    plain = generate(small_topk_model, x, 30, greedy=True)
    spec = speculative_generate(small_topk_model, x, 30, greedy=True)
    assert torch.equal(spec.tokens, plain.tokens)
    assert (spec.logprobs - plain.logprobs).abs().max() < 1e-4
    assert 1.0 <= spec.mean_acceptance_length <= 4.0
    early = speculative_generate(small_topk_model, x, 30, greedy=True, draft_threshold=0.5)
    assert torch.equal(early.tokens, plain.tokens)


def test_speculative_sampling_runs_and_validates():
    torch.manual_seed(0)
    m = GLMModel(preset("tiny", index_topk=16)).eval()
    x = torch.randint(0, 8192, (1, 10))
    spec = speculative_generate(m, x, 24, greedy=False, seed=0, temperature=1.0)
    assert spec.new_tokens.shape == (1, 24) and torch.isfinite(spec.logprobs).all()
    # an untrained model's draft and target are both near-uniform: p/q ~ 1, most drafts pass
    assert spec.mean_acceptance_length > 2.0
    with pytest.raises(ValueError, match="batch size 1"):
        speculative_generate(m, x.expand(2, 10), 4)
