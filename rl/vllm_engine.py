"""Rollouts served by vLLM: rl.rollout.RolloutEngine's interface (sync / generate / complete) over
one or more vLLM servers (rl.vllm_server) instead of the project's own generate().

Token in, token out: every sequence goes to vLLM's /inference/v1/generate as token ids and comes
back as token ids, the log-prob of each sampled token (of the distribution sampled from, after
temperature: `--logprobs-mode processed_logprobs`, what the trainer recomputes), and the spans of
weight versions that produced them, as the server labels its own weights. Nothing is decoded and
re-encoded on the way; the text is decoded here for rewards only.

A weight update (`sync(policy, version)`): the policy is written as a checkpoint vLLM loads
(`checkpoint`: dense MLA, which vLLM serves on CPU and GPU, or glm_moe_dsa, the DSA model vLLM
serves on GPUs only), then each server is paused (`pause_mode`: in-flight requests finish, are
aborted, or freeze until the resume), reloads that directory (vLLM's `reload_weights` plus the
MoE kernel preparation it skips: rl/vllm_ext), drops its prefix cache, takes the new version
label, and resumes. A fake-INT4 rollout copy (`rollout_int4`) is
written with the INT4 values baked in. Older exports are deleted.

Replicas: a prompt group's requests go to one server by a consistent hash of its key (session
affinity, so a group's shared prompt, or an episode's turns, meet one prefix cache); adding a
replica moves only its share of keys.

A request that fails because its server died restarts that server on the current weights and
version (`restarts` times per stage), then is sent again. Sampling seeds come from the stage's
generator, one per sequence, so a resumed stage sends the same requests; vLLM's batched kernels
are not bit-reproducible across batch compositions, so a resumed run matches an uninterrupted one
in distribution rather than bit for bit.
"""
from __future__ import annotations

import copy
import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from model.config import ModelConfig
from model.hf import save_dense_mla, save_pretrained
from model.model import GLMModel
from quant.qat import QATConfig, prepare_qat, remove_qat
from rl.orchestrator import HashRing
from rl.sampling import SamplingParams
from rl.sample import Sample, Status
from rl.vllm_server import (CONTROL_TIMEOUT_S, NETWORK_ERRORS, SERVED_NAME, EngineFailed, VLLMConfig, VLLMServer,
                             VLLMServerSettings)

log = logging.getLogger("glmforge")

# vLLM's CPU MLA kernel takes one latent width: kv_lora_rank 512 + qk_rope_head_dim 64 (GLM-5's)
CPU_MLA_LATENT = 576
# vLLM's CPU MoE kernel pads the expert width to a multiple of this; its weight reload then fails
# (it copies the unpadded checkpoint tensors into the padded storage), so only unpadded widths work
CPU_MOE_ALIGN = 32


def servable_copy(policy: GLMModel, int4: QATConfig | None) -> GLMModel:
    """The weights a server should compute with: a QAT model's or an INT4 rollout copy's
    quantized values baked in (what the native engine's fake-quantized copy computes)."""
    model = copy.deepcopy(policy)
    if int4 is not None and not any(hasattr(m, "_qat_group_size") for m in model.modules()):
        prepare_qat(model, int4)
    with torch.no_grad():
        remove_qat(model, bake=True)
    return model


def check_servable(c: ModelConfig, cfg: VLLMServerSettings, on_gpu: bool) -> None:
    """Refuse, before any server starts, what vLLM would only refuse at the first request."""
    if cfg.checkpoint == "dense_mla" and not on_gpu and c.kv_lora_rank + c.qk_rope_head_dim != CPU_MLA_LATENT:
        raise ValueError(
            f"vLLM on CPU serves MLA only with kv_lora_rank + qk_rope_head_dim = {CPU_MLA_LATENT} (512 + 64); "
            f"this model has {c.kv_lora_rank} + {c.qk_rope_head_dim} (docs/guides/vllm.md). Use rollout.backend=native, "
            "or train a model with those latent sizes")
    if not on_gpu and c.n_routed_experts and c.moe_intermediate_size % CPU_MOE_ALIGN:
        raise ValueError(
            f"vLLM on CPU pads moe_intermediate_size to a multiple of {CPU_MOE_ALIGN} and then cannot reload weights "
            f"(a shape error at the first update); this model has {c.moe_intermediate_size}: train with a multiple "
            f"of {CPU_MOE_ALIGN}, or use rollout.backend=native")
    if cfg.checkpoint == "glm_moe_dsa" and not on_gpu:
        raise ValueError("rollout.vllm.checkpoint=glm_moe_dsa needs vLLM's sparse-attention backend, which vLLM "
                         "has on GPUs only; on CPU use checkpoint=dense_mla")


def serving_config(cfg: VLLMServerSettings, on_gpu: bool) -> VLLMServerSettings:
    """float32 on CPU pins vLLM's reference MLA backend: on CPUs with AMX vLLM picks AMX_MLA, which
    refuses float32 weights (the same config failed on one machine and ran on another)."""
    if not on_gpu and cfg.dtype == "float32" and cfg.attention_backend is None:
        return cfg.model_copy(update={"attention_backend": "CPU_MLA"})
    return cfg


class VLLMEngine:
    def __init__(self, policy: GLMModel, tokenizer, stop_ids: list[int], cfg: VLLMConfig, root: Path,
                 int4: QATConfig | None = None, on_gpu: bool | None = None):
        on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
        check_servable(policy.config, cfg, on_gpu)
        cfg = serving_config(cfg, on_gpu)
        if cfg.checkpoint == "dense_mla" and not policy.config.dense_attention:
            log.warning("vLLM serves this DSA model with dense attention: exact while prompt + response fit in "
                        "index_topk=%d tokens; beyond, the mismatch metric shows the difference",
                        policy.config.index_topk)
        self.tokenizer, self.stop_ids, self.cfg, self.int4 = tokenizer, list(stop_ids), cfg, int4
        self.root = Path(root)
        self.version = 0
        self.restarts = 0
        self.update_seconds = 0.0
        self.parity_gap = 0.0
        self._lock = threading.Lock()
        self.weights_dir, served = self._export(policy, 0)
        urls = cfg.urls or [None] * cfg.replicas
        self._route([VLLMServer(cfg, self.weights_dir, self.root / f"server-{i}.log", url)
                     for i, url in enumerate(urls)])
        try:
            for s in self.servers:              # here, not in the pool: the stage's logging is per thread
                s.launch()
            with ThreadPoolExecutor(len(self.servers)) as pool:
                list(pool.map(lambda s: s.wait_healthy(), self.servers))
            for s in self.servers:
                self._prepare(s)
                self._label(s, 0)
            self.check_parity(served)
        except BaseException:
            self.close()
            raise

    @classmethod
    def connect(cls, urls: list[str], cfg: VLLMConfig, tokenizer, stop_ids: list[int]) -> "VLLMEngine":
        """A client of servers another process owns and updates (rl-agentic's rollout workers): it
        generates; versions come from the servers' spans; sync is the owner's."""
        engine = cls.__new__(cls)
        engine.tokenizer, engine.stop_ids, engine.cfg, engine.int4 = tokenizer, list(stop_ids), cfg, None
        engine.version, engine.restarts, engine.update_seconds, engine.parity_gap = 0, 0, 0.0, 0.0
        engine._lock = threading.Lock()
        engine._route([VLLMServer(cfg, Path("."), Path("/dev/null"), url) for url in urls])
        return engine

    def _route(self, servers: list[VLLMServer]) -> None:
        """Requests go to `servers` by a consistent hash of their affinity key."""
        self.servers, self.ring = servers, HashRing()
        for i in range(len(servers)):
            self.ring.add(str(i))

    # ------------------------------------------------------------ life
    def close(self) -> None:
        for s in self.servers if hasattr(self, "servers") else []:
            if s.owned:
                s.stop()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def metrics(self) -> dict[str, float]:
        return {"vllm/weight_update_s": self.update_seconds, "vllm/restarts": self.restarts,
                "vllm/parity_gap": self.parity_gap}

    # ------------------------------------------------------------ weights
    def _export(self, policy: GLMModel, version: int) -> tuple[Path, GLMModel]:
        final = self.root / "weights" / f"v{version:06d}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model = servable_copy(policy, self.int4)
        if self.cfg.checkpoint == "dense_mla":
            save_dense_mla(model, tmp)
        else:
            save_pretrained(model, tmp, expert_layout="per_expert")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return final, model

    def _label(self, server: VLLMServer, version: int) -> None:
        server.call("/update_weight_version", {"new_version": str(version)}, timeout=CONTROL_TIMEOUT_S)

    def _prepare(self, server: VLLMServer) -> None:
        """The worker extension's fixes on a freshly started server (rl/vllm_ext)."""
        server.call("/collective_rpc", {"method": "glmforge_prepare"}, timeout=CONTROL_TIMEOUT_S)

    def sync(self, policy: GLMModel, version: int) -> None:
        """Serve `policy` as `version` on every server (pause, reload, relabel, resume)."""
        t0 = time.perf_counter()
        new, served = self._export(policy, version)
        for s in self.servers:
            self._ensure(s)
            s.call(f"/pause?mode={self.cfg.pause_mode}", timeout=CONTROL_TIMEOUT_S)
            try:
                s.call("/collective_rpc", {"method": "glmforge_reload", "kwargs": {"weights_path": str(new)}},
                       timeout=CONTROL_TIMEOUT_S)
                s.call("/reset_prefix_cache", timeout=CONTROL_TIMEOUT_S)
                self._label(s, version)
            finally:
                s.call("/resume", timeout=CONTROL_TIMEOUT_S)
            s.model_dir = new                       # a restart serves the current weights
        old, self.weights_dir, self.version = self.weights_dir, new, version
        if old != new:
            shutil.rmtree(old, ignore_errors=True)
        self.check_parity(served)
        self.update_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------ sampling
    def generate(self, samples: list[Sample], params: SamplingParams, generator: torch.Generator) -> None:
        """Fill response_ids, rollout_logprobs, versions, loss_mask, status and text in place; a
        group's samples go to one server."""
        outs = self._run([s.prompt_ids for s in samples], [f"group/{s.group}" for s in samples], params, generator)
        for s, (toks, lps, stopped, versions) in zip(samples, outs):
            s.status = Status.OK if stopped else Status.TRUNCATED
            s.response_ids, s.rollout_logprobs, s.versions = toks, lps, versions
            s.loss_mask = [1] * len(toks)
            s.text = self.tokenizer.decode(toks, skip_special_tokens=True)

    def complete(self, prefixes: list[list[int]], params: SamplingParams, generator: torch.Generator,
                 keys: list[str] | None = None) -> list[tuple[list[int], list[float], bool, list[int]]]:
        """Continue each token prefix: (new ids up to and including the first stop token, their
        log-probs, whether a stop token ended it, the weight version of each as the server labels
        it). keys: affinity keys (an episode's id)."""
        keys = keys or [f"seq/{i}" for i in range(len(prefixes))]
        return self._run(prefixes, keys, params, generator)

    def _run(self, prompts: list[list[int]], keys: list[str], params: SamplingParams, generator: torch.Generator
             ) -> list[tuple[list[int], list[float], bool, list[int]]]:
        greedy = params.temperature == 0
        # one seed per sequence, drawn in order: the same requests after a resume
        seeds = [0] * len(prompts) if greedy else torch.randint(0, 2**31 - 1, (len(prompts),),
                                                                generator=generator).tolist()
        jobs = list(zip(prompts, keys, seeds))
        with ThreadPoolExecutor(min(self.cfg.concurrency, max(len(jobs), 1))) as pool:
            return list(pool.map(lambda j: self._one(*j, params), jobs))

    def _one(self, prompt: list[int], key: str, seed: int, params: SamplingParams
             ) -> tuple[list[int], list[float], bool, list[int]]:
        room = self.cfg.max_model_len - len(prompt)
        if room < 1:
            raise EngineFailed(f"a prompt of {len(prompt)} tokens leaves no room under rollout.vllm.max_model_len="
                               f"{self.cfg.max_model_len}")
        sp = {"max_tokens": min(params.max_new_tokens, room), "seed": seed, "logprobs": 0,
              "stop_token_ids": self.stop_ids, "ignore_eos": True, "detokenize": False, "skip_special_tokens": False}
        sp.update({"temperature": 0.0} if params.temperature == 0 else
                  {"temperature": params.temperature, "top_p": params.top_p})
        body = {"token_ids": prompt, "model": SERVED_NAME, "sampling_params": sp}
        server = self.servers[int(self.ring.owner(key))]
        for attempt in range(2):
            try:
                out = server.call("/inference/v1/generate", body)
                break
            except NETWORK_ERRORS as e:   # a server that is gone; its HTTP errors come back as EngineFailed
                if attempt:
                    raise
                self._ensure(server, reason=repr(e))
        choice = out["choices"][0]
        toks = list(choice["token_ids"])
        lps = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
        if len(lps) != len(toks):
            raise EngineFailed(f"vLLM returned {len(toks)} tokens but {len(lps)} log-probs")
        versions = [0] * len(toks)
        for span in choice.get("weight_versions") or [{"version": str(self.version), "start": 0, "end": len(toks)}]:
            versions[span["start"]:span["end"]] = [int(span["version"])] * (span["end"] - span["start"])
        stopped = bool(toks) and toks[-1] in self.stop_ids and choice.get("finish_reason") == "stop"
        return toks, lps, stopped, versions

    def _ensure(self, server: VLLMServer, reason: str = "") -> None:
        """A dead server comes back on the current weights and version, up to `restarts` times."""
        with self._lock:
            if server.alive():
                return
            if not server.owned:
                raise EngineFailed(f"vLLM server {server.url} is not answering ({reason}) and is not ours to restart")
            if self.restarts >= self.cfg.restarts:
                raise EngineFailed(f"vLLM server died again after {self.restarts} restarts ({reason}); "
                                   f"last lines of {server.log_path}:\n{server.tail()}")
            log.warning("vLLM server %s is dead (%s): restarting on version %d", server.url, reason, self.version)
            self.restarts += 1
            server.stop()
            server.model_dir = self.weights_dir
            server.start()
            self._prepare(server)
            self._label(server, self.version)

    # ------------------------------------------------------------ parity
    def check_parity(self, served: GLMModel) -> None:
        """Every server's log-probs of a fixed probe sequence against `served`'s own forward (the
        weights it was given): an engine that computes something else stops the stage here, before
        RL trains on its samples. The gap is kept in `metrics()`."""
        if self.cfg.max_parity_gap is None:
            return
        vocab = served.config.vocab_size
        g = torch.Generator().manual_seed(1234)
        probe = torch.randint(0, vocab, (min(48, self.cfg.max_model_len - 1),), generator=g).tolist()
        with torch.no_grad():
            logp = served(torch.tensor([probe])).logits[0].float().log_softmax(-1)
        ours = [float(logp[i, probe[i + 1]]) for i in range(len(probe) - 1)]
        worst = 0.0
        for server in self.servers:
            theirs = self.server_logprobs([(probe[:1], probe[1:])], server=server)[0]
            gap = sum(abs(a - b) for a, b in zip(theirs, ours)) / len(ours)
            worst = max(worst, gap)
            if gap > self.cfg.max_parity_gap:
                raise EngineFailed(
                    f"vLLM server {server.url} computes other log-probs than the trainer on the same weights: mean "
                    f"|delta log p| {gap:.3f} over a {len(probe)}-token probe (max_parity_gap "
                    f"{self.cfg.max_parity_gap}); first positions: {[round(a - b, 3) for a, b in zip(theirs, ours)][:8]}")
        self.parity_gap = worst

    def server_logprobs(self, sequences: list[tuple[list[int], list[int]]], server: VLLMServer | None = None
                        ) -> list[list[float]]:
        """vLLM's log-probs of given responses (prompt, response) at temperature 1, from a prefill
        (prompt_logprobs): the engine's side of a parity check on fixed tokens."""
        out = []
        for prompt, response in sequences:
            to = server or self.servers[int(self.ring.owner(f"parity/{len(out)}"))]
            res = to.call("/inference/v1/generate", {
                "token_ids": prompt + response, "model": SERVED_NAME,
                "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0, "detokenize": False}})
            rows = res["prompt_logprobs"][len(prompt):]
            out.append([row[str(t)]["logprob"] for row, t in zip(rows, response)])   # JSON keys: strings
        return out
