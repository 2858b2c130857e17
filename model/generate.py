"""Autoregressive generation over the latent KV cache, returning the sampled tokens and their
log-probabilities (RL needs both).

Shape legend: B batch, T0 prompt length, N new tokens, V vocab.

Log-probs are log_softmax(logits / temperature) at the chosen token (temperature 1 for greedy),
before top-p truncation: that is what a trainer recomputes from the same logits.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import torch

from model.cache import KVCache
from model.model import GLMModel


@dataclass
class Generation:
    tokens: torch.Tensor       # [B, T0+N] prompt followed by the new tokens
    new_tokens: torch.Tensor   # [B, N]
    logprobs: torch.Tensor     # [B, N] fp32 log-prob of each new token (0 after EOS)
    cache: KVCache | None = None   # the KV cache at the end (every token fed), with use_cache


@contextmanager
def eval_mode(model: torch.nn.Module):
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def filter_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [B,V] -> renormalised probs keeping the smallest set with mass >= top_p."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p          # always keeps the top token
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return kept / kept.sum(-1, keepdim=True)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, greedy: bool,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B,V] -> (token [B], logprob [B])."""
    logits = logits.float()
    if greedy:
        tok = logits.argmax(-1)
        logp = logits.log_softmax(-1)
    else:
        logp = (logits / temperature).log_softmax(-1)
        tok = torch.multinomial(filter_top_p(logp.exp(), top_p), 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def _check(temperature: float, top_p: float, greedy: bool, max_new_tokens: int) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not greedy and temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling (use greedy=True), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@torch.no_grad()
def generate(model: GLMModel, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_p: float = 1.0, greedy: bool = False, generator: torch.Generator | None = None,
             seed: int | None = None, attention_mask: torch.Tensor | None = None,
             eos_token_id: int | Sequence[int] | None = None, use_cache: bool = True,
             rows: torch.Tensor | None = None, cache: KVCache | None = None) -> Generation:
    """input_ids [B,T0] (left-padded if attention_mask marks padding) -> Generation.

    rows [B'] (with the cache): prefill each prompt once, then continue row b of the output from
    prompt rows[b] (GRPO samples a group's responses from one prompt: one prefill, not G).
    cache: a KV cache already holding each row's earlier tokens (an agent's previous turns):
    input_ids continue it.

    eos_token_id: one stop id or several (a chat template's end-of-turn set); a row stops at the
    first of them, which is kept, and is padded with it afterwards (log-prob 0).
    use_cache=False recomputes the whole sequence every step (the reference for the cache)."""
    _check(temperature, top_p, greedy, max_new_tokens)
    if rows is not None and not use_cache:
        raise ValueError("rows (a shared prefill) needs the KV cache")
    if generator is None and seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    B = input_ids.shape[0] if rows is None else rows.shape[0]
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.dtype)
    ids, toks, lps = input_ids, [], []
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    stops = None if eos_token_id is None else torch.tensor(
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=input_ids.device)
    fill = torch.full((B,), -1, dtype=torch.long, device=input_ids.device)   # the stop id each row ended on
    if cache is None:
        cache = model.new_cache() if use_cache else None
    with eval_mode(model):
        logits = model(ids, attention_mask=mask, cache=cache).logits[:, -1]
        if rows is not None:
            cache = cache.select(rows)
            logits, ids, mask = logits[rows], ids[rows], mask[rows]
        for step in range(max_new_tokens):
            tok, lp = sample_next(logits, temperature, top_p, greedy, generator)
            if stops is not None:
                tok = torch.where(done, fill, tok)
                lp = torch.where(done, 0.0, lp)
                hit = ~done & torch.isin(tok, stops)
                fill = torch.where(hit, tok, fill)
                done |= hit
            toks.append(tok)
            lps.append(lp)
            ids = torch.cat([ids, tok[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(tok[:, None])], 1)
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            if use_cache:
                logits = model(tok[:, None], cache=cache).logits[:, -1]
            else:
                logits = model(ids, attention_mask=mask).logits[:, -1]
    new = torch.stack(toks, 1) if toks else input_ids.new_zeros(B, 0)
    logprobs = torch.stack(lps, 1) if lps else torch.zeros(B, 0)
    return Generation(ids, new, logprobs, cache)
