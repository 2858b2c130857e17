"""Loaded by the vLLM server (`--worker-extension-cls glmforge_vllm_ext.WeightUpdate`), inside
vLLM's own environment. Only this folder goes on the server's PYTHONPATH, so the project's
top-level packages cannot shadow vLLM's imports; the served engine's loads (rl.served_vllm) need
two of the project's modules (rl.weight_sync to read a published version, deltas included;
model.hf for the checkpoint names), imported when first used with the repository
($GLMFORGE_REPO) appended to the end of sys.path, after vLLM's own packages.

Two fixes for vLLM 0.32 on CPU, both found by comparing its log-probs with the trainer's:

1. Rotary embedding. The CPU rotary op (RotaryEmbedding.forward_cpu, in place through
   ops.rotary_embedding) rotates MLA's inputs wrongly: q_pe and k_pe are views (q[..., nope:], a
   slice of the kv_a projection) and q_pe has more heads than k_pe's one. Measured on the tiny
   pipeline's SFT model, layer 0, the same inputs: k_pe wrong at every position after the first
   until given a contiguous copy, q_pe's second head wrong even then; every position after the
   first attended wrongly (mean |delta log p| 2.7 on its rollouts; random weights hide it:
   0.0003). The built model's rotary modules are switched to forward_native (plain torch, out of
   place like every caller expects).

2. Why `glmforge_reload` exists: vLLM 0.32's in-place `reload_weights` leaves MoE layers wrong whenever their
expert kernel prepares its weights from the layer (the CPU kernel prepacks them into its grouped-
GEMM layout): UnquantizedFusedMoEMethod runs that step only on the first load, so after a reload
the kernel reads unpacked weights as packed ones. Measured on the tiny MoE model: mean
|log p_vllm - log p_trainer| 0.003 on a fresh server, 0.038 after reloading the same weights,
0.003 again with this repack; the dense-MLP model is unaffected. `reload` is reload_weights
followed by that missing step.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

_forward_cpu = RotaryEmbedding.forward_cpu


def _native_rotary(model) -> int:
    """Rebind every rotary module whose CustomOp dispatch picked forward_cpu (bound per instance at
    construction, so patching the class afterwards would change nothing) to forward_native."""
    n = 0
    for module in model.modules():
        method = getattr(module, "_forward_method", None)
        if isinstance(module, RotaryEmbedding) and getattr(method, "__func__", None) is _forward_cpu:
            module._forward_method = module.forward_native
            n += 1
    return n


class WeightUpdate:
    def glmforge_prepare(self) -> int:
        """Once after start-up: the rotary fix on the built model; returns the modules rebound."""
        return _native_rotary(self.model_runner.get_model())

    def glmforge_reload(self, weights_path: str) -> int:
        """reload_weights(weights_path), then each MoE layer's expert-kernel preparation that the
        in-place reload skips; returns the number of MoE layers prepared again."""
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        return self._glmforge_repack()

    def _glmforge_repack(self) -> int:
        n = 0
        for layer in self.model_runner.get_model().modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            if kernel is not None and hasattr(kernel, "fused_experts"):
                kernel.fused_experts.process_weights_after_loading(layer)
                n += 1
        return n

    # ---------------------------------------------------------------- the served protocol's loads
    def glmforge_load_version(self, root: str, version: str, checkpoint: str, int4: str = "") -> dict:
        """Policy version `version` as the trainer's ranks published it under `root`, into the
        served model: only the pieces this worker serves (the dense weights, the expert shards
        holding its experts), a delta applied on the pieces it holds, which it keeps for the next
        delta and for `glmforge_checksums`."""
        weight_sync, hf, model_config = _project()
        held = getattr(self, "_glmforge_held", None)
        base = None
        if held is not None:
            pieces = held[1].tensors
            base = (held[0], lambda name, shard: pieces[weight_sync.piece_id(name, shard)])
        config_json, pieces, _ = weight_sync.load_pieces(Path(root), int(version), base, self._glmforge_want())
        cfg = model_config.model_validate_json(config_json)
        checked = self._glmforge_take(hf, pieces, cfg, checkpoint, int4)
        self._glmforge_held = (int(version), pieces)
        return {"version": int(version), "checked": checked}

    def glmforge_load_file(self, path: str, checkpoint: str, int4: str = "") -> dict:
        """A fixed model (a teacher's or a judge's state file, model.hf.save_state) into the
        served model."""
        from safetensors.torch import load_file

        weight_sync, hf, _ = _project()
        state = load_file(path)
        pieces = weight_sync.Pieces(state, {k: (k, None) for k in state})
        checked = self._glmforge_take(hf, pieces, hf.state_config(path), checkpoint, int4)
        self._glmforge_held = (0, pieces)
        return {"version": 0, "checked": checked}

    def glmforge_checksums(self, root: str = "", version: str = "") -> dict:
        """Checksums of the pieces this worker loaded last (the server's owner joins its
        workers' and compares them with what the version's manifests list)."""
        weight_sync, _, _ = _project()
        held = getattr(self, "_glmforge_held", None)
        if held is None:
            return {"version": None, "checksums": {}}
        return {"version": held[0], "checksums": {k: weight_sync.checksum(t) for k, t in held[1].tensors.items()}}

    def _glmforge_want(self):
        """load_pieces' filter: the global ids of the experts this worker's MoE layers hold (vLLM's
        expert map under expert parallelism; every expert without it)."""
        weight_sync, _, _ = _project()
        local, n_experts = {}, 0
        for module in self.model_runner.get_model().modules():
            manager, name = getattr(module, "expert_map_manager", None), getattr(module, "layer_name", None)
            if manager is None or not name:
                continue
            n_experts = max(n_experts, int(getattr(module, "global_num_experts", 0)))
            emap = manager.expert_map
            ours = name[len("model."):] if name.startswith("model.") else name
            local[ours] = None if emap is None else set((emap >= 0).nonzero().flatten().tolist())
        if not n_experts or all(ids is None for ids in local.values()):
            return None
        return weight_sync.expert_selector(local, n_experts)

    def _glmforge_take(self, hf, pieces, cfg, checkpoint: str, int4: str) -> int:
        """Reload the served model from our pieces (INT4 rollouts: fake-quantized as the native
        engine's copy is), then read back every served parameter that holds a checkpoint tensor
        as it is (the same name and shape: embeddings, norms, unsharded projections) and refuse
        one that differs; returns how many were compared."""
        whole = {n: t for pid, t in pieces.tensors.items() for n, shard in [pieces.where[pid]] if shard is None}
        shards = [(n, t, shard[0] * t.shape[0]) for pid, t in pieces.tensors.items()
                  for n, shard in [pieces.where[pid]] if shard is not None]
        if int4:
            from quant.qat import QATConfig, baked_int4_state

            q = QATConfig.model_validate_json(int4)
            whole = baked_int4_state(whole, cfg, q)
            shards = [(n, baked_int4_state({n: t}, cfg, q)[n], first) for n, t, first in shards]
        tensors = hf.hf_tensors(whole, cfg, "per_expert")
        for n, t, first in shards:
            tensors.update(hf.hf_expert_piece(n, t, first, cfg))
        if checkpoint == "dense_mla":
            tensors = hf.dense_mla_only(tensors, cfg)
        self.reload_weights(weights_iterator=iter(list(tensors.items())), is_checkpoint_format=True)
        self._glmforge_repack()
        checked = 0
        for name, param in self.model_runner.get_model().named_parameters():
            want = tensors.get(name)
            if want is None or tuple(want.shape) != tuple(param.shape):
                continue
            if not torch.equal(param.detach().cpu(), want.to(param.dtype)):
                raise RuntimeError(f"after loading, the served model's {name} differs from the weights it was given")
            checked += 1
        return checked


def _project():
    """rl.weight_sync, model.hf and ModelConfig from the repository, appended after vLLM's own
    packages so that none of the project's top-level names shadows one of vLLM's imports."""
    repo = os.environ.get("GLMFORGE_REPO")
    if not repo:
        raise RuntimeError("GLMFORGE_REPO is not set: the served engine's loads read the project's weight format")
    if repo not in sys.path:
        sys.path.append(repo)
    from model import hf
    from model.config import ModelConfig
    from rl import weight_sync

    return weight_sync, hf, ModelConfig
