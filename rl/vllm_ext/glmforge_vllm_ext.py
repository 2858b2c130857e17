"""Loaded by the vLLM server (`--worker-extension-cls glmforge_vllm_ext.WeightUpdate`), inside
vLLM's own environment: it imports nothing of glmforge. Only this folder goes on the server's
PYTHONPATH, so the project's top-level packages cannot shadow vLLM's imports.

Why it exists: vLLM 0.32's in-place `reload_weights` leaves MoE layers wrong whenever their
expert kernel prepares its weights from the layer (the CPU kernel prepacks them into its grouped-
GEMM layout): UnquantizedFusedMoEMethod runs that step only on the first load, so after a reload
the kernel reads unpacked weights as packed ones. Measured on the tiny MoE model: mean
|log p_vllm - log p_trainer| 0.003 on a fresh server, 0.038 after reloading the same weights,
0.003 again with this repack; the dense-MLP model is unaffected. `reload` is reload_weights
followed by that missing step.
"""
from __future__ import annotations


class WeightUpdate:
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
