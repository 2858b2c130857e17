"""INT4: fake quantization for QAT and rollouts (qat.py) and the compressed-tensors export
(export.py)."""
