"""Speculative decoding: the shared-parameter MTP module drafts up to D tokens, the main model
verifies them in one forward.

Shape legend: n tokens already accepted (x_0..x_{n-1} in the main cache) plus the pending token
x_n; D draft tokens; V vocab; Dm hidden.

Drafting runs MTP step k (k = 1..D) at position n-1 exactly as in training: step k at position
t reads h^{k-1}_t and token x_{t+k} and attends to step-k states of earlier positions. So each
step keeps its own one-layer latent cache (same weights, D caches). Entries whose inputs are
still drafts are recomputed the next cycle; only entries with accepted inputs are kept.

Verification: greedy accepts drafts while they equal the main model's argmax; sampling uses
the standard rule (accept x~q with prob min(1, p(x)/q(x)), else resample from norm(max(0, p-q))),
so the output distribution is the main model's. Every cycle yields accepted + 1 tokens (the
bonus/correction from the main model); the mean of that is the acceptance length.
Batch size 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.cache import KVCache
from model.generate import _check, eval_mode, filter_top_p
from model.model import GLMModel


@dataclass
class SpecGeneration:
    tokens: torch.Tensor            # [1, T0+N]
    new_tokens: torch.Tensor        # [1, N]
    logprobs: torch.Tensor          # [1, N] main-model log-probs (same definition as generate)
    acceptance_lengths: list[int]   # per verify cycle: accepted drafts + 1

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


def _dist(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    return filter_top_p((logits.float() / temperature).softmax(-1), top_p)


@torch.no_grad()
def speculative_generate(model: GLMModel, input_ids: torch.Tensor, max_new_tokens: int, *,
                         num_draft: int | None = None, greedy: bool = True, temperature: float = 1.0,
                         top_p: float = 1.0, generator: torch.Generator | None = None,
                         seed: int | None = None, eos_token_id: int | None = None,
                         draft_threshold: float = 0.0) -> SpecGeneration:
    """input_ids [1,T0] -> SpecGeneration. Drafts up to num_draft (default mtp_depth) tokens
    per cycle; drafting stops early once the draft's probability for its token falls below
    draft_threshold (cheaper cycles when the MTP is unsure; the output is unchanged)."""
    _check(temperature, top_p, greedy, max_new_tokens)
    if model.mtp is None:
        raise ValueError("speculative decoding needs a model with an MTP module (mtp_depth > 0)")
    if input_ids.shape[0] != 1:
        raise ValueError(f"speculative decoding supports batch size 1, got {input_ids.shape[0]}")
    D = model.config.mtp_depth if num_draft is None else num_draft
    if not 1 <= D <= model.config.mtp_depth:
        raise ValueError(f"num_draft must be in [1, {model.config.mtp_depth}], got {num_draft}")
    if generator is None and seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    dev = input_ids.device

    def pick(logits):                               # [V] -> (token, log-prob)
        if greedy:
            tok = int(logits.argmax())
            return tok, float(logits.float().log_softmax(-1)[tok])
        tok = int(torch.multinomial(_dist(logits, temperature, top_p), 1, generator=generator))
        return tok, float((logits.float() / temperature).log_softmax(-1)[tok])

    def logprob(logits, tok):
        t = 1.0 if greedy else temperature
        return float((logits.float() / t).log_softmax(-1)[tok])

    with eval_mode(model):
        cache = model.new_cache()
        out = model(input_ids, cache=cache, return_hidden=True)
        seq = input_ids[0].tolist()
        tok, lp = pick(out.logits[0, -1])
        seq.append(tok)
        new_lps, acc_lens = [lp], []
        hid = [out.hidden]                                   # hid[k]: h^k for positions 0.. [1,*,Dm]
        mtp_caches = [KVCache(1) for _ in range(D)]
        hid += [out.hidden[:, :0] for _ in range(D)]
        while len(new_lps) < max_new_tokens and not (eos_token_id is not None and seq[-1] == eos_token_id):
            n = len(seq) - 1                                 # x_n pending, x_0..x_{n-1} cached
            drafts, qs = [], []
            for k in range(1, D + 1):
                c = mtp_caches[k - 1]
                start = c.length
                full = seq + drafts
                ids = torch.tensor([full[t + k] for t in range(start, n)], device=dev)[None]
                pos = torch.arange(start, n, device=dev)[None]
                h, logits = model.mtp_step(hid[k - 1][:, start:n], ids, c, pos)
                hid[k] = torch.cat([hid[k][:, :start], h], 1)
                if greedy:
                    q = logits[0, -1].float().softmax(-1)
                    drafts.append(int(q.argmax()))
                else:
                    q = _dist(logits[0, -1], temperature, top_p)
                    drafts.append(int(torch.multinomial(q, 1, generator=generator)))
                    qs.append(q)
                if float(q[drafts[-1]]) < draft_threshold:
                    break
            for k in range(1, D + 1):                        # keep entries whose inputs are accepted
                keep = max(n - k + 1, 0)
                mtp_caches[k - 1].truncate(keep)
                hid[k] = hid[k][:, :keep]

            ver = model(torch.tensor([[seq[n]] + drafts], device=dev), cache=cache, return_hidden=True)
            logits = ver.logits[0]                            # [D+1, V]; row i predicts x_{n+1+i}
            accepted, nxt = 0, None
            for i, d in enumerate(drafts):
                if greedy:
                    ok = int(logits[i].argmax()) == d
                else:
                    p = _dist(logits[i], temperature, top_p)
                    ok = float(torch.rand((), generator=generator, device=dev)) < min(1.0, float(p[d] / qs[i][d]))
                    if not ok:
                        resid = (p - qs[i]).clamp(min=0)
                        resid = resid / resid.sum() if resid.sum() > 0 else p
                        nxt = int(torch.multinomial(resid, 1, generator=generator))
                if not ok:
                    break
                accepted += 1
            if nxt is None:
                nxt = pick(logits[accepted])[0]
            new = drafts[:accepted] + [nxt]
            for i, t in enumerate(new):
                new_lps.append(logprob(logits[i], t))
            seq += new
            acc_lens.append(accepted + 1)
            cache.truncate(n + accepted + 1)
            hid[0] = torch.cat([hid[0], ver.hidden[:, : accepted + 1]], 1)
            if eos_token_id is not None and eos_token_id in new:
                cut = len(seq) - len(new) + new.index(eos_token_id) + 1
                new_lps = new_lps[: len(new_lps) - (len(seq) - cut)]
                seq = seq[:cut]
    T0 = input_ids.shape[1]
    seq = seq[: T0 + max_new_tokens]
    new_lps = new_lps[:max_new_tokens]
    tokens = torch.tensor(seq, device=dev)[None]
    return SpecGeneration(tokens, tokens[:, T0:], torch.tensor(new_lps)[None], acc_lens)
