"""Shared fixtures: a real packed dataset (Python standard library modules, a BPE tokenizer
trained on them, data_processing's packing) and a very small GLM model config for it."""
from __future__ import annotations

from pathlib import Path

from data_processing.document import Document
from data_processing.packing import PackConfig, pack
from data_processing.tokenizer import TOKENIZER_FILE, train_tokenizer
from tests.data_processing.conftest import stdlib_docs as shared_stdlib_docs

SEQ_LEN = 64

# A few hundred thousand parameters: each step takes milliseconds, so 2-rank runs of tens of
# steps fit in the test budget; still every piece of the architecture (MLA, DSA indexer, MoE with shared expert and router bias, one MTP step).
MODEL_OVERRIDES = dict(
    num_layers=2, first_k_dense=1, hidden_size=32, intermediate_size=64, num_heads=2, q_lora_rank=32,
    kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2,
    index_head_dim=16, index_topk=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    mtp_depth=1, max_position_embeddings=512, sliding_window=64,
)


def stdlib_docs(n: int) -> list[Document]:
    """n real stdlib modules of 3-20k characters (small enough for the tiny training runs)."""
    return shared_stdlib_docs(n, min_chars=3000, max_chars=20_000)


def build_packed(root: Path) -> dict[str, Path]:
    """{"pack": dir, "tokenize": dir}: the two parents of the pretrain stage, built from real text."""
    docs = stdlib_docs(40)
    tok = train_tokenizer([d.text for d in docs], vocab_size=512, min_frequency=2)
    (root / "tokenize").mkdir()
    tok.save(str(root / "tokenize" / TOKENIZER_FILE))
    (root / "pack").mkdir()
    pack(docs, tok, PackConfig(seq_len=SEQ_LEN, val_fraction=0.1, upsample=False, seed=0,
                               sequences_per_shard=300), root / "pack")
    (root / "pack" / TOKENIZER_FILE).write_bytes((root / "tokenize" / TOKENIZER_FILE).read_bytes())
    return {"pack": root / "pack", "tokenize": root / "tokenize"}
