"""Loaded by the vLLM server (`--worker-extension-cls glmforge_vllm_ext.WeightUpdate`), inside
vLLM's own environment: it imports nothing of glmforge. Only this folder goes on the server's
PYTHONPATH, so the project's top-level packages cannot shadow vLLM's imports.

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
        n = 0
        for layer in self.model_runner.get_model().modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            if kernel is not None and hasattr(kernel, "fused_experts"):
                kernel.fused_experts.process_weights_after_loading(layer)
                n += 1
        return n
