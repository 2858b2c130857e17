"""Quality filtering with fastText classifiers (DCLM-style quality + a world-knowledge one).

Each classifier is trained from labelled real text: positive sources vs negative sources
(TextSource, see common.py). 20% of the examples (seeded) are held out to report precision and
recall at the classifier's threshold. Every document then gets P(positive) from each classifier
in metadata["quality"] = {"scores": {name: p}, "score": combined, "weight": w}.

mode "filter": keep a document when its combined score >= `threshold`; others go to removed/.
mode "upsample": keep everything and set weight by score bucket (`bucket_edges` split [0, 1]
into len(edges)+1 buckets, `bucket_weights` gives each its weight; pack repeats a document
`weight` times in expectation), as GLM-5 up-samples high-quality data instead of only cutting.

Published: classifiers/{name}.bin (fastText, `bucket` hash rows keep it small), a score
histogram PNG, and the held-out precision/recall in the metrics.
"""
from __future__ import annotations

import itertools
import multiprocessing
import random
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator, Literal, Sequence

import numpy as np
from pydantic import Field, field_validator, model_validator

from data_processing.common import (
    StepConfig,
    TextSource,
    content_digest,
    count_documents,
    iter_input_documents,
    read_text_source,
    source_files,
)
from data_processing.document import Document
from data_processing.filtering import Verdict, write_decisions
from runtime.stage import Workdir

POS, NEG = "__label__hq", "__label__lq"
SCORE_BATCH = 1000  # documents per fastText predict call


class ClassifierConfig(StepConfig):
    name: str = Field(description=(
        "the classifier's name: its score's key in metadata[\"quality\"][\"scores\"] and its file "
        "classifiers/NAME.bin"))
    positives: tuple[TextSource, ...] = Field(description="text sources of the positive (wanted) class")
    negatives: tuple[TextSource, ...] = Field(description="text sources of the negative class")
    threshold: float = Field(default=0.5, ge=0.0, le=1.0, description=(
        "P(positive) at which the held-out precision and recall are reported"))
    # fastText hyper-parameters; bucket 100k keeps a wordNgrams=2 model ~10-50 MB, not 400+.
    dim: int = Field(default=64, ge=2, description="fastText word-vector size")
    epoch: int = Field(default=15, ge=1, description="fastText training epochs")
    lr: float = Field(default=0.2, gt=0.0, description="fastText learning rate")
    word_ngrams: int = Field(default=2, ge=1, description="fastText word n-gram length (2: words and word pairs)")
    bucket: int = Field(default=100_000, ge=1000, description=(
        "fastText hash buckets for n-grams (100k keeps a wordNgrams=2 model about 10-50 MB, not 400+)"))
    max_chars: int = Field(default=4000, ge=100, description="text fed to fastText is cut here")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_\-]+", v):
            raise ValueError(f"classifier name {v!r}: use letters, digits, '_' or '-' (it names a file)")
        return v

    @field_validator("positives", "negatives")
    @classmethod
    def _non_empty(cls, v: tuple) -> tuple:
        if not v:
            raise ValueError("at least one text source is needed")
        return v


class QualityConfig(StepConfig):
    classifiers: tuple[ClassifierConfig, ...] = Field(description=(
        "the fastText classifiers every document is scored by (at least one, unique names)"))
    combine: Literal["max", "mean", "min"] = Field("mean", description=(
        "how the classifiers' scores become the document's one score"))
    mode: Literal["filter", "upsample"] = Field("upsample", description=(
        "filter: drop documents whose combined score is below threshold; upsample: keep all, weighted by "
        "score bucket"))
    threshold: float = Field(default=0.5, ge=0.0, le=1.0, description="mode filter: keep combined score >= this")
    bucket_edges: tuple[float, ...] = Field((0.25, 0.5, 0.75), description=(
        "mode upsample: increasing scores inside (0, 1) that split [0, 1] into buckets"))
    bucket_weights: tuple[float, ...] = Field((0.5, 1.0, 1.5, 2.0), description=(
        "mode upsample: one weight per bucket (len(bucket_edges) + 1); pack repeats a document this often "
        "in expectation"))
    holdout: float = Field(default=0.2, gt=0.0, lt=1.0, description=(
        "fraction of each classifier's labelled texts held out (seeded) for precision and recall"))
    seed: int = Field(0, description="seed of the held-out split, the sources' sampling and fastText's training")
    threads: int = Field(default=1, ge=1, description="fastText threads; 1 is bit-reproducible")
    shard_size: int = Field(default=10_000, ge=1, description="documents per output Parquet shard")

    @model_validator(mode="after")
    def _check(self) -> "QualityConfig":
        if not self.classifiers:
            raise ValueError("classifiers: name at least one classifier")
        names = [c.name for c in self.classifiers]
        if len(set(names)) != len(names):
            raise ValueError(f"classifiers: names must be unique, got {names}")
        if len(self.bucket_weights) != len(self.bucket_edges) + 1:
            raise ValueError(
                f"bucket_weights needs len(bucket_edges)+1 = {len(self.bucket_edges) + 1} values, got {len(self.bucket_weights)}"
            )
        if list(self.bucket_edges) != sorted(self.bucket_edges) or any(not 0 < e < 1 for e in self.bucket_edges):
            raise ValueError(f"bucket_edges must be increasing and inside (0, 1), got {self.bucket_edges}")
        if any(w < 0 for w in self.bucket_weights):
            raise ValueError("bucket_weights must be >= 0")
        return self


# fastText cuts lines at 1024 tokens (MAX_LINE_SIZE) and reads the rest as an example with no
# label, which trains into "Encountered NaN": examples stay below that many words.
MAX_WORDS = 1000


def fasttext_line(text: str, max_chars: int) -> str:
    """fastText reads one example per line: newlines become spaces, the text is cut to
    max_chars characters and MAX_WORDS words."""
    return " ".join(text[:max_chars].split()[:MAX_WORDS])


def _train_fasttext(input_path: str, model_path: str, params: dict) -> str | None:
    """Train and save a supervised fastText model (runs in a child process); the error text or None."""
    import fasttext

    try:
        fasttext.train_supervised(input=input_path, **params).save_model(model_path)
        return None
    except RuntimeError as e:
        return str(e)


class QualityClassifier:
    """A trained fastText binary classifier; score(texts) -> P(positive)."""

    def __init__(self, model, cfg: ClassifierConfig):
        self.model, self.cfg = model, cfg
        self.attempts = 0

    @classmethod
    def train(cls, cfg: ClassifierConfig, pos: Sequence[str], neg: Sequence[str], workdir: Path, seed: int, threads: int = 1):
        import fasttext

        rng = random.Random(seed)
        rows = [f"{POS} {fasttext_line(t, cfg.max_chars)}" for t in pos] + [f"{NEG} {fasttext_line(t, cfg.max_chars)}" for t in neg]
        rng.shuffle(rows)
        path = Path(workdir) / f"{cfg.name}.train.txt"
        path.write_text("\n".join(rows) + "\n", encoding="utf-8")
        # fasttext-numpy2 0.10.4 intermittently raises "Encountered NaN" for the same file, seed
        # and thread=1, while the runs that finish give bit-identical models: a spurious failure,
        # not divergence. It depends on the process's memory (in a long-lived process it can fail
        # every time), so each attempt trains in a fresh process; the attempt count lands in the
        # metrics.
        params = dict(dim=cfg.dim, epoch=cfg.epoch, lr=cfg.lr, wordNgrams=cfg.word_ngrams, bucket=cfg.bucket,
                      thread=threads, seed=seed, verbose=0, minCount=1,
                      loss="ova")  # one-vs-all sigmoid: P(hq) is read directly
        model_path = Path(workdir) / f"{cfg.name}.trained.bin"
        ctx = multiprocessing.get_context("spawn")
        for attempt in range(1, 21):
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                error = pool.submit(_train_fasttext, str(path), str(model_path), params).result()
            if error is None:
                break
            if "NaN" not in error or attempt == 20:
                raise RuntimeError(f"fastText training of classifier {cfg.name!r} failed: {error}")
        clf = cls(fasttext.load_model(str(model_path)), cfg)
        clf.attempts = attempt
        return clf

    @classmethod
    def load(cls, path: Path, cfg: ClassifierConfig) -> "QualityClassifier":
        import fasttext

        return cls(fasttext.load_model(str(path)), cfg)

    def score(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.empty(0)
        labels, probs = self.model.predict([fasttext_line(t, self.cfg.max_chars) for t in texts], k=2)
        out = np.empty(len(texts))
        for i, (ls, ps) in enumerate(zip(labels, probs)):
            d = dict(zip(ls, ps))
            out[i] = float(d.get(POS, 1.0 - d.get(NEG, 1.0)))
        return np.clip(out, 0.0, 1.0)


def precision_recall(scores: np.ndarray, labels: np.ndarray, threshold: float) -> dict:
    pred = scores >= threshold
    tp = int((pred & labels).sum())
    fp = int((pred & ~labels).sum())
    fn = int((~pred & labels).sum())
    return {
        "precision": tp / (tp + fp) if tp + fp else 0.0,
        "recall": tp / (tp + fn) if tp + fn else 0.0,
        "heldout": int(len(labels)),
    }


def _split(texts: list[str], holdout: float, rng: random.Random) -> tuple[list[str], list[str]]:
    texts = list(texts)
    rng.shuffle(texts)
    k = max(1, int(round(len(texts) * holdout)))
    return texts[k:], texts[:k]


def train_classifier(cfg: ClassifierConfig, workdir: Path, seed: int, holdout: float, threads: int = 1):
    """Read sources, train on (1-holdout), evaluate on holdout. Returns (classifier, metrics)."""
    pos = [t for s in cfg.positives for t in read_text_source(s, seed)]
    neg = [t for s in cfg.negatives for t in read_text_source(s, seed + 1)]
    if len(pos) < 2 or len(neg) < 2:
        raise ValueError(f"classifier {cfg.name!r}: need >= 2 positive and negative texts, got {len(pos)} / {len(neg)}")
    rng = random.Random(seed)
    pos_tr, pos_te = _split(pos, holdout, rng)
    neg_tr, neg_te = _split(neg, holdout, rng)
    clf = QualityClassifier.train(cfg, pos_tr, neg_tr, workdir, seed, threads)
    scores = clf.score(pos_te + neg_te)
    labels = np.array([True] * len(pos_te) + [False] * len(neg_te))
    m = precision_recall(scores, labels, cfg.threshold)
    m.update(train_positives=len(pos_tr), train_negatives=len(neg_tr), fasttext_attempts=clf.attempts)
    return clf, m


def fingerprint(cfg: QualityConfig) -> str:
    """Content digest of every labelled-text file the classifiers train on (samples/, the
    standard library), in config order: part of the stage key, so edited training text
    retrains the classifiers instead of serving the cached result."""
    return content_digest(
        p for c in cfg.classifiers for src in (*c.positives, *c.negatives) for p in source_files(src)
    )


def combine_scores(scores: dict[str, np.ndarray], how: str) -> np.ndarray:
    stack = np.stack(list(scores.values()))
    return {"max": stack.max, "mean": stack.mean, "min": stack.min}[how](axis=0)


def bucket_weight(score: float, edges: Sequence[float], weights: Sequence[float]) -> float:
    return float(weights[int(np.searchsorted(np.asarray(edges), score, side="right"))])


def _histogram(path: Path, scores: dict[str, list[float]], combined: list[float], threshold: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    bins = np.linspace(0, 1, 41)
    for name, s in scores.items():
        ax.hist(s, bins=bins, alpha=0.5, label=name)
    ax.hist(combined, bins=bins, histtype="step", color="black", label="combined")
    ax.axvline(threshold, color="red", linestyle="--", label=f"threshold {threshold}")
    ax.set_xlabel("P(high quality)")
    ax.set_ylabel("documents")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: QualityConfig, inputs: dict[str, Path], workdir: Workdir) -> dict:
    (parent,) = inputs.values()
    model_dir = workdir.out / "classifiers"
    model_dir.mkdir(parents=True, exist_ok=True)
    classifiers: dict[str, QualityClassifier] = {}
    metrics: dict = {"classifiers": {}}
    for k, ccfg in enumerate(cfg.classifiers):
        workdir.progress(k, len(cfg.classifiers), "training quality classifiers")
        clf, m = train_classifier(ccfg, workdir.checkpoint, cfg.seed, cfg.holdout, cfg.threads)
        path = model_dir / f"{ccfg.name}.bin"
        clf.model.save_model(str(path))
        m["model_bytes"] = path.stat().st_size
        classifiers[ccfg.name] = clf
        metrics["classifiers"][ccfg.name] = m

    all_scores: dict[str, list[float]] = {n: [] for n in classifiers}
    all_combined: list[float] = []
    weights: list[float] = []

    def scored(docs: Iterator[Document]) -> Iterator[tuple[Document, Verdict]]:
        """Score in batches (one fastText predict call each), annotate, decide."""
        while batch := list(itertools.islice(docs, SCORE_BATCH)):
            texts = [d.text for d in batch]
            scores = {name: c.score(texts) for name, c in classifiers.items()}
            combined = combine_scores(scores, cfg.combine)
            for i, doc in enumerate(batch):
                s = float(combined[i])
                w = bucket_weight(s, cfg.bucket_edges, cfg.bucket_weights) if cfg.mode == "upsample" else 1.0
                doc.metadata["quality"] = {"scores": {k: round(float(v[i]), 6) for k, v in scores.items()}, "score": round(s, 6), "weight": w}
                for k, v in scores.items():
                    all_scores[k].append(float(v[i]))
                all_combined.append(s)
                if cfg.mode == "filter" and s < cfg.threshold:
                    yield doc, (False, f"quality_below_threshold:{s:.3f}<{cfg.threshold}")
                else:
                    weights.append(w)
                    yield doc, True

    counts = write_decisions(
        scored(iter_input_documents(parent)), workdir.out, "quality", cfg.shard_size, workdir.progress, count_documents(parent)
    )
    n = counts.documents_in
    _histogram(workdir.out / "quality_histogram.png", all_scores, all_combined, cfg.threshold)
    comb = np.asarray(all_combined)
    metrics.update(
        **counts.metrics(),
        mean_score=float(comb.mean()) if n else 0.0,
        score_quantiles={q: float(np.quantile(comb, q)) for q in (0.1, 0.5, 0.9)} if n else {},
        effective_documents=float(sum(weights)),
        histogram="quality_histogram.png",
    )
    return metrics

