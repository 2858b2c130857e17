"""Kernels for DSA and INT4, one per file. Each has a plain-torch reference (the CPU path and
the source of truth) and a Triton kernel used for CUDA tensors when triton imports:

    topk.py              deterministic_topk(scores, k)
    indexer.py           indexer_scores(q, k, w, causal_offset), indexer_topk(...)
    sparse_attention.py  sparse_attention(q, k, v, indices, scale), sparse_attention_mqa(...)
    int4.py              quantize_int4 / pack_int4 / unpack_int4 / dequantize_int4,
                         fake_quantize_int4 (QAT), int4_matmul(x, packed, scales, group_size)

tests/kernels runs every Triton kernel under the Triton interpreter against its reference.
"""
