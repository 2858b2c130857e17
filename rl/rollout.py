"""The rollout engine: batched sampling over the model's KV cache, with per-token log-probs.

The engine holds its own copy of the weights, as an inference server does: `sync(policy,
version)` copies the trainer's weights in (a version number per sync, stamped on every token
it generates). With `int4` set, the copy is fake-quantized to INT4 (quant.qat, the QAT path
GLM-5 deploys), so rollouts come from a model that differs from the full-precision one being
trained: a real train/inference mismatch for IcePop to correct.

Prompts are token ids (rendered once with the chat template); responses are token ids up to and
including the first stop token. The loss mask is 1 on every generated token, the stop token
included: the model must learn to stop.
"""
from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from chat.template import Message, encode
from domains.task import Task
from model.cache import KVCache
from model.generate import generate
from model.model import GLMModel
from model.moe import recording_routes
from quant.qat import QATConfig, prepare_qat
from rl.ranks import SINGLE, Ranks
from rl.sample import Sample, Status
from rl.sampling import SamplingParams  # noqa: F401 (the engines' parameter type, importable from here)
from rl.served import ServerPoolConfig
from rl.vllm_server import VLLMConfig


def prompt_ids(tokenizer, task: Task, tools: list[dict] | None = None) -> list[int]:
    """The chat-template prompt for a task: one user turn, thinking off, ending with the
    assistant marker (and its empty think block) the model continues from."""
    messages = [Message("user", task.prompt, thinking=False)]
    return encode(tokenizer, messages, tools, thinking_mode="turn", add_generation_prompt=True).ids


class RolloutConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["native", "served", "vllm"] = Field("native", description=(
        "native: this module's engine in the stage's process (on ranks: each rank's own copy); served: a pool "
        "of inference servers (`servers`: the project's engine or vLLM) the stage starts and stops while the "
        "trainer's ranks only train (rl.served); vllm: vLLM servers reloaded from a whole-model export the "
        "stage's process writes each version (rl.vllm_engine; `make vllm-setup`)"))
    vllm: VLLMConfig = Field(VLLMConfig(), description="the vLLM servers of backend vllm")
    servers: ServerPoolConfig = Field(ServerPoolConfig(), description="the server pool of backend served")


def open_engine(cfg: RolloutConfig, policy: GLMModel, tokenizer, stop_ids: list[int], pad_id: int, root: Path, *,
                int4: QATConfig | None = None, batch_size: int = 64, record_routes: bool = False,
                ranks: Ranks = SINGLE):
    """The rollout engine a stage's `rollout:` section asks for, as a context manager that stops
    what it started (servers) however the stage ends. root: the engine's files. With
    `served` every rank of `ranks` opens it together (rank 0 starts the servers)."""
    if cfg.backend == "native":
        return RolloutEngine(policy, tokenizer, stop_ids, pad_id, int4=int4, batch_size=batch_size,
                             record_routes=record_routes)
    if record_routes:
        raise ValueError(f"routing replay needs rollout.backend=native: the {cfg.backend} servers do not report "
                         "the experts each token was routed to")
    if cfg.backend == "served":
        from rl.served import ServedEngine

        return ServedEngine(policy, tokenizer, stop_ids, pad_id, cfg.servers, root, int4=int4, ranks=ranks)
    from rl.vllm_engine import VLLMEngine

    return VLLMEngine(policy, tokenizer, stop_ids, cfg.vllm, root, int4=int4)


class TurnCache:
    """The KV cache of each row of the engine's last two calls, by the tokens it holds (its
    prefix and every sampled token but the last), so that an agent's next turn, which is those
    tokens, the last one, and the tool's reply, feeds only what is new instead of the whole
    conversation again (what vLLM's and SGLang's prefix caches do for the served engines).
    Cleared when the weights change; at most about 2 x `limit` rows are held (a server that is
    called without turns in between keeps its memory bounded)."""

    def __init__(self, limit: int = 1024):
        self.limit = limit
        self.previous: dict[tuple[int, ...], tuple[KVCache, int, torch.Tensor]] = {}
        self.current: dict[tuple[int, ...], tuple[KVCache, int, torch.Tensor]] = {}

    def clear(self) -> None:
        self.previous, self.current = {}, {}

    def next_call(self) -> None:
        self.previous, self.current = self.current, {}

    def remember(self, prefixes: list[list[int]], done: list[tuple], cache: KVCache) -> None:
        """done: _batch's (tokens, ...) per row of `cache`."""
        if len(self.current) >= self.limit:
            self.next_call()
        for b, (p, (toks, *_)) in enumerate(zip(prefixes, done)):
            held = p + toks[:-1]                      # fed to the model: the last token never was
            cols = cache.key_valid[b].nonzero().squeeze(1)[:len(held)]
            self.current[tuple(held)] = (cache, b, cols)

    def longest(self, prefix: list[int]) -> tuple[int, tuple[KVCache, int, torch.Tensor] | None]:
        """The most tokens of `prefix` (fewer than all) held by one remembered row, and that row."""
        best = (0, None)
        for table in (self.current, self.previous):
            for key, row in table.items():
                n = len(key)
                if best[0] < n < len(prefix) and tuple(prefix[:n]) == key:
                    best = (n, row)
        return best


def continued_cache(model: GLMModel, prefixes: list[list[int]], hits: list[tuple[int, tuple | None]],
                    pad_id: int) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """A batch KV cache of each row's remembered tokens (TurnCache) and the new tokens after them,
    left-padded so that every row's real tokens are contiguous (a hole would shift a sliding
    window): every row feeds the same number T of new tokens, a row with fewer new tokens
    re-feeds its last remembered ones, and a row with too few remembered tokens feeds all.
    Returns (cache, new ids [B,T], their mask)."""
    T = max(len(p) - n for p, (n, _) in zip(prefixes, hits))
    kept = [max(len(p) - T, 0) if row is not None else 0 for p, (_, row) in zip(prefixes, hits)]
    B, S = len(prefixes), max(kept)
    cache = model.new_cache()
    ref = next(row for _, row in hits if row is not None)[0]
    valid = torch.zeros(B, S, dtype=torch.bool)
    pos = torch.full((B, S), -1, dtype=torch.long)     # a row with nothing kept starts at position 0
    for layer in range(len(cache.c)):
        for name in ("c", "kr", "ik"):
            src = getattr(ref, name)[layer]
            if src is None:
                continue
            out = src.new_zeros(B, S, src.shape[-1])
            for b, ((_, row), k) in enumerate(zip(hits, kept)):
                if k:
                    rc, rb, cols = row
                    out[b, S - k:] = getattr(rc, name)[layer][rb, cols[:k]]
            getattr(cache, name)[layer] = out
    for b, ((_, row), k) in enumerate(zip(hits, kept)):
        if k:
            rc, rb, cols = row
            valid[b, S - k:] = True
            pos[b, S - k:] = rc.pos[rb, cols[:k]]
    cache.key_valid, cache.doc, cache.pos = valid, torch.zeros(B, S, dtype=torch.long), pos
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, (p, k) in enumerate(zip(prefixes, kept)):
        new = p[k:]
        ids[b, T - len(new):] = torch.tensor(new)
        mask[b, T - len(new):] = 1
    return cache, ids, mask


class RolloutEngine:
    def __init__(self, policy: GLMModel, tokenizer, stop_ids: list[int], pad_id: int,
                 int4: QATConfig | None = None, batch_size: int = 64, record_routes: bool = False):
        """record_routes: generate() stores on each sample the experts every token was routed to
        (Sample.routes), for routing replay in the trainer's forward."""
        self.tokenizer, self.stop_ids, self.pad_id = tokenizer, list(stop_ids), pad_id
        self.int4, self.batch_size, self.record_routes = int4, batch_size, record_routes
        self.model = copy.deepcopy(policy)
        for p in self.model.parameters():
            p.requires_grad_(False)
        if int4 is not None:
            prepare_qat(self.model, int4)     # state-dict names unchanged: sync stays a plain copy
        self.model.eval()
        self.version = 0
        self.turns = TurnCache(limit=4 * batch_size)

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def sync(self, policy: GLMModel, version: int) -> None:
        self.model.load_state_dict(policy.state_dict())
        self.version = version
        self.turns.clear()                   # the remembered KV is the old weights'

    def _call(self) -> None:
        self.turns.next_call()

    @torch.no_grad()
    def generate(self, samples: list[Sample], params: SamplingParams, generator: torch.Generator) -> None:
        """Fill response_ids, rollout_logprobs, versions, loss_mask, status and text in place (and
        routes, when recording)."""
        self._call()
        prefixes = [s.prompt_ids for s in samples]
        done = []
        for i in range(0, len(prefixes), self.batch_size):
            done += self._batch(prefixes[i:i + self.batch_size], params, generator, self.record_routes)
        for s, (toks, lps, stopped, routes) in zip(samples, done):
            s.status = Status.OK if stopped else Status.TRUNCATED
            s.response_ids, s.rollout_logprobs, s.routes = toks, lps, routes
            s.versions = [self.version] * len(toks)
            s.loss_mask = [1] * len(toks)
            s.text = self.tokenizer.decode(toks, skip_special_tokens=True)

    @torch.no_grad()
    def complete(self, prefixes: list[list[int]], params: SamplingParams, generator: torch.Generator,
                 keys: list[str] | None = None) -> list[tuple[list[int], list[float], bool, list[int]]]:
        """Continue each token prefix: (new ids up to and including the first stop token,
        their log-probs, whether a stop token ended it, the policy version of each), in order.
        keys: affinity keys, for engines with replicas (one engine here: unused)."""
        self._call()
        out = []
        for i in range(0, len(prefixes), self.batch_size):
            out += [(toks, lps, stopped, [self.version] * len(toks))
                    for toks, lps, stopped, _ in self._batch(prefixes[i:i + self.batch_size], params, generator)]
        return out

    @torch.no_grad()
    def next_token_logprobs(self, prefixes: list[list[int]]) -> torch.Tensor:
        """log p(next token | prefix) for each prefix [N, vocab]: one prefill, no sampling (a judge
        that reads its verdict from the first token's distribution)."""
        out = []
        for i in range(0, len(prefixes), self.batch_size):
            ids, mask = self._left_pad(prefixes[i:i + self.batch_size])
            logits = self.model(ids, attention_mask=mask).logits[:, -1].float()
            out.append(torch.log_softmax(logits, -1))
        return torch.cat(out)

    def _left_pad(self, prefixes: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        T0 = max(len(p) for p in prefixes)
        ids = torch.full((len(prefixes), T0), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prefixes):                     # left padding: every row ends at T0
            ids[b, T0 - len(p):] = torch.tensor(p)
            mask[b, T0 - len(p):] = 1
        return ids, mask

    def _batch(self, prefixes: list[list[int]], params: SamplingParams, generator: torch.Generator,
               record: bool = False) -> list[tuple[list[int], list[float], bool, torch.Tensor | None]]:
        hits = [(0, None)] * len(prefixes) if record else [self.turns.longest(p) for p in prefixes]
        greedy = params.temperature == 0
        sampling = dict(temperature=params.temperature or 1.0, top_p=params.top_p, greedy=greedy,
                        generator=generator, eos_token_id=self.stop_ids)
        if any(row is not None for _, row in hits):
            # an agent's next turn: each row's earlier tokens are in the cache, feed what is new
            cache, ids, mask = continued_cache(self.model, prefixes, hits, self.pad_id)
            gen = generate(self.model, ids, params.max_new_tokens, attention_mask=mask, cache=cache, **sampling)
        else:
            # a group's samples share their prompt: prefill each distinct prompt once
            distinct = {}
            rows = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prefixes])
            ids, mask = self._left_pad([list(p) for p in distinct])
            with recording_routes(self.model) if record else contextlib.nullcontext() as logs:
                gen = generate(self.model, ids, params.max_new_tokens, attention_mask=mask,
                               rows=rows if len(distinct) < len(prefixes) else None, **sampling)
        # per MoE layer [B, T0 + tokens fed back, K]: the prefill (one row per distinct prompt,
        # given to each of its samples), then one column per decode step
        routes = None
        if record and logs:
            routes = [torch.cat([log[0][rows] if len(distinct) < len(prefixes) else log[0]] + log[1:], 1)
                      for log in logs]
        T0 = ids.shape[1]
        stops = set(self.stop_ids)
        out = []
        for b, p in enumerate(prefixes):
            toks = gen.new_tokens[b].tolist()
            lps = gen.logprobs[b].tolist()
            end = next((k + 1 for k, t in enumerate(toks) if t in stops), None)
            n = end or len(toks)
            # the inputs of the trainer's forward: the prompt and every response token but the last
            r = torch.stack([x[b, T0 - len(p):T0 + n - 1] for x in routes]) if routes else None
            out.append((toks[:n], lps[:n], end is not None, r))
        self.turns.remember(prefixes, out, gen.cache)
        return out
