"""Generation with the latent cache vs recomputation; speculative decoding vs plain greedy."""

from types import SimpleNamespace

import pytest
import torch

from model.cache import KVCache
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
    # the cycles produce the 29 tokens after the first: only the last may overshoot
    lens = spec.acceptance_lengths
    assert 1 + sum(lens[:-1]) < 30 <= 1 + sum(lens) and all(1 <= n <= 4 for n in lens)
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


# ---------------------------------------------------------------- speculative sampling, exactly
class Bigram(torch.nn.Module):
    """A stand-in for GLMModel in speculative_generate with hand-set distributions: the main
    model's next-token logits are target[last token] (a bigram chain, so the exact distribution
    of a continuation is a product of table rows); MTP step k drafts from drafts[k-1][its input
    token]. Hidden states are (position, MTP step), so the stub also checks that step k is fed
    step k-1's states at exactly the positions it is asked about."""

    def __init__(self, target: torch.Tensor, drafts: list[torch.Tensor]):
        super().__init__()
        self.target, self.drafts = target, drafts
        self.config = SimpleNamespace(mtp_depth=len(drafts))
        self.mtp = True                     # speculative_generate refuses a model without one
        self.step_of: dict[int, int] = {}

    def new_cache(self):
        self.step_of = {}                   # a new generation: its MTP caches are new too
        return KVCache(1)

    @staticmethod
    def _hidden(cache, T: int, step: int) -> torch.Tensor:
        pos = torch.arange(cache.length, cache.length + T)[None]
        cache.append_meta(torch.ones(1, T, dtype=torch.bool), torch.zeros(1, T, dtype=torch.long), pos)
        return torch.stack([pos.float(), torch.full(pos.shape, float(step))], -1)

    def forward(self, ids, cache=None, return_hidden=False):
        return SimpleNamespace(logits=self.target[ids], hidden=self._hidden(cache, ids.shape[1], 0))

    def mtp_step(self, h_prev, next_ids, cache, position_ids):
        k = self.step_of.setdefault(id(cache), len(self.step_of) + 1)   # caches are first used in step order
        h = self._hidden(cache, next_ids.shape[1], k)
        assert torch.equal(h[..., 0].long(), position_ids)
        assert torch.equal(h_prev[..., 0], h[..., 0]) and bool((h_prev[..., 1] == k - 1).all())
        return h, self.drafts[k - 1][next_ids]


def _rows(probs) -> torch.Tensor:
    """Probability rows -> logits (log p; -inf where p is 0)."""
    return torch.tensor(probs, dtype=torch.float64).log().float()


# the main model's bigram table over V = 4 (every entry >= 0.1: each 3-token continuation has
# probability >= 1e-3), and a draft that is wrong on purpose: it prefers what the target does not
TARGET = _rows([[0.1, 0.2, 0.3, 0.4], [0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.1, 0.6, 0.1, 0.2]])
WRONG = _rows([[0.7, 0.1, 0.1, 0.1], [0.05, 0.05, 0.45, 0.45], [0.97, 0.01, 0.01, 0.01], [0.4, 0.0, 0.4, 0.2]])


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit: P(X >= stat) for X ~ chi2(cells - 1)."""
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("draft,n", [("exact", 600), ("wrong", 1500)])
def test_speculative_sampling_reproduces_the_target_distribution(draft, n):
    # 3 new tokens: the first from the main model alone, then a cycle of 2 drafts + verification
    # (more cycles when drafts are rejected). Exact law: T[p, x1] T[x1, x2] T[x2, x3].
    drafts = [TARGET, TARGET] if draft == "exact" else [WRONG, WRONG.flip(0)]
    model, prompt = Bigram(TARGET, drafts), torch.tensor([[2, 0]])
    p = TARGET.double().softmax(-1)
    law = (p[0][:, None, None] * p[:, :, None] * p[None]).reshape(-1)            # [x1*16 + x2*4 + x3]
    g = torch.Generator().manual_seed(0)
    counts, lengths = torch.zeros(64, dtype=torch.float64), []
    for _ in range(n):
        out = speculative_generate(model, prompt, 3, greedy=False, generator=g)
        x1, x2, x3 = out.new_tokens[0].tolist()
        counts[16 * x1 + 4 * x2 + x3] += 1
        lengths += out.acceptance_lengths
    # Seeded, so never flaky. With the wrong draft and 1500 draws, resampling a rejection from p
    # instead of max(0, p - q), accepting every draft, or inverting p/q gives p < 1e-70.
    assert _chi2_pvalue(counts, law) > 1e-3
    if draft == "exact":                      # q = p: every draft passes, every cycle yields 3
        assert set(lengths) == {3}
    else:
        assert 1 in lengths and sum(lengths) / len(lengths) < 2


@pytest.mark.parametrize("greedy", [True, False])
def test_acceptance_length_is_depth_plus_one_when_drafts_agree_and_one_when_they_never_do(greedy):
    D = 3
    agree = speculative_generate(Bigram(TARGET, [TARGET] * D), torch.tensor([[1]]), 1 + 3 * (D + 1),
                                 greedy=greedy, seed=0)
    assert agree.acceptance_lengths == [D + 1] * 3 and agree.mean_acceptance_length == D + 1
    # the draft always proposes the one token the target gives probability 0 (and never its argmax)
    target = _rows([[0.0, 0.5, 0.3, 0.2]] * 4)
    never = _rows([[1.0, 0.0, 0.0, 0.0]] * 4)
    out = speculative_generate(Bigram(target, [never] * D), torch.tensor([[1]]), 6, greedy=greedy, seed=0)
    assert out.acceptance_lengths == [1] * 5 and out.mean_acceptance_length == 1
    assert 0 not in out.new_tokens[0].tolist()
    if greedy:                                # the target's argmax chain, one token per cycle
        assert out.new_tokens[0].tolist() == [1] * 6
