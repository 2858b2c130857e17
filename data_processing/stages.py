"""The curation stages in pipeline order, for the runner, the `curate` flow and the CLI.

    ingest -> quality -> dedup-exact -> dedup-minhash -> dedup-semantic -> decontaminate
    issue-pr (root, reads GitHub REST exports named in its config) ------^
    decontaminate -> tokenize -> pack (pack also reads decontaminate's shards)

`tiny_defaults()` gives each section's config for the tiny preset (real text from samples/
and the Python standard library).
"""
from __future__ import annotations

from glmforge.stage import StageSpec

from data_processing import decontaminate, dedup_exact, issue_pr, minhash, packing, quality, semantic, tokenizer

STAGES: list[StageSpec] = [
    StageSpec("quality", "quality", quality.QualityConfig, quality.run, parents=("ingest",)),
    StageSpec("dedup-exact", "dedup_exact", dedup_exact.DedupExactConfig, dedup_exact.run, parents=("quality",)),
    StageSpec("dedup-minhash", "dedup_minhash", minhash.MinHashConfig, minhash.run, parents=("dedup-exact",)),
    StageSpec("dedup-semantic", "dedup_semantic", semantic.SemanticConfig, semantic.run, parents=("dedup-minhash",)),
    StageSpec("issue-pr", "issue_pr", issue_pr.IssuePRConfig, issue_pr.run, parents=()),
    StageSpec(
        "decontaminate", "decontaminate", decontaminate.DecontaminateConfig, decontaminate.run,
        parents=("dedup-semantic", "issue-pr"),
    ),
    StageSpec("tokenize", "tokenize", tokenizer.TokenizeConfig, tokenizer.run, parents=("decontaminate",)),
    StageSpec("pack", "pack", packing.PackConfig, packing.run, parents=("decontaminate", "tokenize")),
]
STEPS: dict[str, StageSpec] = {s.name: s for s in STAGES}


def tiny_defaults() -> dict[str, object]:
    """Config section -> config object for the tiny preset (2 cores, well under 3 minutes)."""
    return {
        "quality": quality.tiny_defaults(),
        "dedup_exact": dedup_exact.DedupExactConfig(),
        "dedup_minhash": minhash.MinHashConfig(),
        "dedup_semantic": semantic.SemanticConfig(embedder="model2vec", clusters=16, threshold=0.95),
        "issue_pr": issue_pr.tiny_defaults(),
        "decontaminate": decontaminate.tiny_defaults(),
        "tokenize": tokenizer.TokenizeConfig(vocab_size=8192),
        "pack": packing.PackConfig(seq_len=256, val_fraction=0.05, fim_rate=0.1, code_sources=("code", "stdlib", "issue-pr")),
    }
