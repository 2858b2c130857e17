"""Post-training: the chat template shared by SFT, RL rollouts and evaluation (chat_template),
INT4 quantization-aware training and the INT4 inference path (qat), and the compressed-tensors
INT4 export read by vLLM / SGLang (export_int4)."""
