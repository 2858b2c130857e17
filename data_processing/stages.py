"""The curation stages in pipeline order, for the runner, the `curate` flow and the CLI.

    ingest -> quality -> dedup-exact -> dedup-minhash -> dedup-semantic -> decontaminate
    issue-pr (root, reads GitHub REST exports named in its config) ------^
    decontaminate -> tokenize -> pack (pack also reads decontaminate's shards)

quality, issue-pr and decontaminate also read raw files that are no artifact (labelled text,
GitHub exports, eval sets): their `fingerprint` (a content digest of those files) joins the
stage key. Curation stages take their seeds from their own sections (seeded=False): run.seed
is not in their keys. The presets' settings live in configs/*.yaml only.
"""
from __future__ import annotations

from glmforge.stage import StageSpec

from data_processing import decontaminate, dedup_exact, issue_pr, minhash, packing, quality, semantic, tokenizer

STAGES: list[StageSpec] = [
    StageSpec("quality", "quality", quality.QualityConfig, quality.run, parents=("ingest",),
              fingerprint=quality.fingerprint, seeded=False),
    StageSpec("dedup-exact", "dedup_exact", dedup_exact.DedupExactConfig, dedup_exact.run, parents=("quality",),
              seeded=False),
    StageSpec("dedup-minhash", "dedup_minhash", minhash.MinHashConfig, minhash.run, parents=("dedup-exact",),
              seeded=False),
    StageSpec("dedup-semantic", "dedup_semantic", semantic.SemanticConfig, semantic.run, parents=("dedup-minhash",),
              seeded=False),
    StageSpec("issue-pr", "issue_pr", issue_pr.IssuePRConfig, issue_pr.run, parents=(),
              fingerprint=issue_pr.fingerprint, seeded=False),
    StageSpec("decontaminate", "decontaminate", decontaminate.DecontaminateConfig, decontaminate.run,
              parents=("dedup-semantic", "issue-pr"), fingerprint=decontaminate.fingerprint, seeded=False),
    StageSpec("tokenize", "tokenize", tokenizer.TokenizeConfig, tokenizer.run, parents=("decontaminate",),
              seeded=False),
    StageSpec("pack", "pack", packing.PackConfig, packing.run, parents=("decontaminate", "tokenize"), seeded=False),
]
STEPS: dict[str, StageSpec] = {s.name: s for s in STAGES}

