"""Curation throughput: quality scoring, MinHash signatures and LSH, beside datatrove's MinHash.

Documents/s per core (documents per CPU-second, so a busy shared machine does not skew the
comparison) on one corpus of real documents (the Python standard library's own sources, never
site-packages or dist-packages, and the repo's samples/: GSM8K, Tiny Shakespeare, MBPP, GitHub
issues), with planted near-duplicates (1% of the words of 1,000 documents replaced) to measure
recall. The corpus does not depend on what is installed; its size and sha256 are printed, so
two runs with equal digests measured the same documents. Every measurement runs in one process
on one core; datatrove runs with tasks=1, workers=1. Every result line carries the date, the
machine and the settings.

datatrove lives in its own environment (it pins xxhash<4 and pulls spaCy), never in the
project's. Once:

    python3 -m venv /tmp/bench-venv --system-site-packages    # the system Python, not .venv
    /tmp/bench-venv/bin/pip install -r bench/requirements-curation.txt

Then, from the repository root, with the project's environment:

    .venv/bin/python bench/curation.py --datatrove-python /tmp/bench-venv/bin/python

The script re-runs itself under that interpreter (`--datatrove-worker`) for the datatrove part
and compares both tools' removal sets. Without --datatrove-python the datatrove rows are skipped.
Not run by the tests.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import machine  # bench/machine.py (this script's directory is on sys.path)

REPO = Path(__file__).resolve().parents[1]


def cpu_seconds() -> float:
    """CPU time of this process and its finished children: per-core cost that does not depend
    on how busy the (shared) machine is, unlike wall-clock time."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


# ---------------------------------------------------------------------------------------------
# Corpus
def jsonl_records(path: Path) -> list[dict]:
    """Records of a JSONL file, split on "\\n" only: str.splitlines() also breaks at U+2028 and
    U+2029, which JSON allows unescaped inside strings (datatrove writes them so)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def stdlib_sources() -> list[Path]:
    """The standard library's own .py files: sysconfig's stdlib folder without the packages
    installed under it (site-packages, dist-packages), so the corpus is the same whatever is
    installed."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.rglob("*.py")
                  if not {"site-packages", "dist-packages"} & set(p.relative_to(stdlib).parts))


def load_corpus(max_docs: int, seed: int = 0) -> list[tuple[str, str]]:
    """(id, text) of real documents, at least 200 characters each, in a seeded order."""
    import sysconfig

    docs: list[tuple[str, str]] = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for p in stdlib_sources():
        t = p.read_text(encoding="utf-8", errors="replace")
        docs.append((f"stdlib/{p.relative_to(stdlib)}", t))
    samples = REPO / "samples"
    for i, r in enumerate(jsonl_records(samples / "gsm8k" / "train.jsonl")):
        docs.append((f"gsm8k/{i}", r["question"] + "\n" + r["answer"]))
    for i, par in enumerate((samples / "tinyshakespeare" / "input.txt").read_text().split("\n\n")):
        docs.append((f"shakespeare/{i}", par))
    for i, r in enumerate(jsonl_records(samples / "mbpp" / "mbpp.jsonl")):
        docs.append((f"mbpp/{i}", r["text"] + "\n" + r["code"]))
    for r in jsonl_records(samples / "github_issues" / "hf_datasets_issues_5634-6249.jsonl"):
        docs.append((f"hf-issue/{r['number']}", f"{r['title']}\n{r.get('body') or ''}"))
    docs = [(i, t) for i, t in docs if len(t) >= 200]
    random.Random(seed).shuffle(docs)
    return docs[:max_docs]


def plant(docs: list[tuple[str, str]], n: int, rate: float, seed: int = 1):
    """n near-duplicates: a `rate` share of the words of a document replaced."""
    rng = random.Random(seed)
    pool = [d for d in docs if len(d[1].split()) >= 100]
    pairs, out = [], []
    for k, (i, t) in enumerate(rng.sample(pool, n)):
        w = t.split()
        for _ in range(max(1, int(len(w) * rate))):
            w[rng.randrange(len(w))] = rng.choice(["alpha", "beta", "gamma", "delta"])
        pid = f"planted/{k}"
        out.append((pid, " ".join(w)))
        pairs.append((i, pid))
    return docs + out, pairs


def corpus_digest(docs: list[tuple[str, str]]) -> str:
    """sha256 of the benched documents (ids and texts, in order)."""
    h = hashlib.sha256()
    for i, t in docs:
        for part in (i, t):
            b = part.encode("utf-8", "surrogatepass")
            h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()


def recall(pairs, removed: set[str]) -> float:
    return sum((a in removed) != (b in removed) or (a in removed and b in removed) for a, b in pairs) / len(pairs)


def clustered(roots, ids) -> set[str]:
    """Documents in a duplicate cluster of two or more (kept member included)."""
    import numpy as np

    sizes = np.bincount(roots, minlength=len(roots))
    return {ids[k] for k in np.flatnonzero(sizes[roots] > 1)}


# ---------------------------------------------------------------------------------------------
# Ours
def bench_ours(docs, pairs) -> dict:
    import numpy as np

    sys.path.insert(0, str(REPO))
    from data_processing import minhash
    from data_processing.quality import train_classifier
    from glmforge.config import load_config

    texts = [t for _, t in docs]
    ids = [i for i, _ in docs]
    res = {}

    cfg = minhash.MinHashConfig()
    t0 = cpu_seconds()
    sigs = minhash.text_signatures(texts, cfg)
    t_sig = cpu_seconds() - t0
    t0 = cpu_seconds()
    roots, stats = minhash.cluster(sigs, cfg)
    keep = minhash.choose_kept(roots, ids, [0.0] * len(ids))
    t_lsh = cpu_seconds() - t0
    removed = {ids[k] for k in np.flatnonzero(~keep)}
    res["numpy"] = {"sig_s": t_sig, "lsh_s": t_lsh, "removed": removed, "recall": recall(pairs, removed),
                    "clustered": clustered(roots, ids)}
    # datatrove keeps every band collision; the same rule here (no Jaccard verification)
    raw = minhash.MinHashConfig(verify_threshold=None)
    roots, _ = minhash.cluster(sigs, raw)
    keep = minhash.choose_kept(roots, ids, [0.0] * len(ids))
    removed = {ids[k] for k in np.flatnonzero(~keep)}
    res["numpy_unverified"] = {"removed": removed, "recall": recall(pairs, removed), "clustered": clustered(roots, ids)}
    # and datatrove's text normalisation too (numbers -> "0"), to see what differs beyond it
    dtlike = minhash.MinHashConfig(verify_threshold=None, norm_numbers=True)
    t0 = cpu_seconds()
    sigs = minhash.text_signatures(texts, dtlike)
    roots, _ = minhash.cluster(sigs, dtlike)
    keep = minhash.choose_kept(roots, ids, [0.0] * len(ids))
    t_dtlike = cpu_seconds() - t0
    removed = {ids[k] for k in np.flatnonzero(~keep)}
    res["numpy_dtlike"] = {"removed": removed, "recall": recall(pairs, removed), "s": t_dtlike, "clustered": clustered(roots, ids)}

    # plain datasketch: MinHash.bulk + in-memory MinHashLSH (same shingles), on a subset
    sub = min(len(texts), 10_000)
    dcfg = minhash.MinHashConfig(backend="datasketch")
    t0 = cpu_seconds()
    dsig = minhash.text_signatures(texts[:sub], dcfg)
    t_sig = cpu_seconds() - t0
    t0 = cpu_seconds()
    minhash.cluster(dsig, dcfg)
    t_lsh = cpu_seconds() - t0
    res["datasketch"] = {"sig_s": t_sig * len(texts) / sub, "lsh_s": t_lsh * len(texts) / sub, "subset": sub}

    # quality scoring with the tiny preset's dclm classifier (training not timed)
    with tempfile.TemporaryDirectory() as tmp:
        clf, _ = train_classifier(load_config("tiny").quality.classifiers[0], Path(tmp), seed=0, holdout=0.2)
        t0 = cpu_seconds()
        for s in range(0, len(texts), 1000):
            clf.score(texts[s : s + 1000])
        res["quality"] = {"score_s": cpu_seconds() - t0}
    return res


# ---------------------------------------------------------------------------------------------
# datatrove (runs under the bench interpreter)
def datatrove_worker(data_dir: str, work: str) -> None:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter, MinhashDedupSignature
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    cfg = MinhashConfig()  # 5-grams, 14 buckets x 8 hashes
    times = {}

    def timed(name, executor):
        t0 = cpu_seconds()
        executor.run()
        times[name] = cpu_seconds() - t0

    log = f"{work}/logs"
    timed("signatures", LocalPipelineExecutor(
        pipeline=[JsonlReader(data_dir), MinhashDedupSignature(output_folder=f"{work}/sigs", config=cfg)],
        tasks=1, workers=1, logging_dir=f"{log}/sigs"))
    timed("buckets", LocalPipelineExecutor(
        pipeline=[MinhashDedupBuckets(input_folder=f"{work}/sigs", output_folder=f"{work}/buckets", config=cfg)],
        tasks=cfg.num_buckets, workers=1, logging_dir=f"{log}/buckets"))
    timed("cluster", LocalPipelineExecutor(
        pipeline=[MinhashDedupCluster(input_folder=f"{work}/buckets", output_folder=f"{work}/remove_ids", config=cfg,
                                      save_cluster_id=True)],
        tasks=1, workers=1, logging_dir=f"{log}/cluster"))
    timed("filter", LocalPipelineExecutor(
        pipeline=[JsonlReader(data_dir), MinhashDedupFilter(input_folder=f"{work}/remove_ids", load_cluster_ids=True,
                  exclusion_writer=JsonlWriter(f"{work}/removed", compression=None)),
                  JsonlWriter(f"{work}/kept", compression=None)],
        tasks=1, workers=1, logging_dir=f"{log}/filter"))
    removed = [r["id"] for p in sorted(Path(f"{work}/removed").glob("*.jsonl")) for r in jsonl_records(p)]
    clustered = [  # every document datatrove put in a duplicate cluster (kept or removed)
        r["id"]
        for d in ("kept", "removed")
        for p in sorted(Path(f"{work}/{d}").glob("*.jsonl"))
        for r in jsonl_records(p)
        if r.get("metadata", {}).get("minhash_cluster_id", -1) != -1
    ]
    print(json.dumps({"times": times, "removed": removed, "clustered": clustered}))


def bench_datatrove(python: str, docs) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        with open(data / "corpus.jsonl", "w") as f:
            for i, t in docs:
                f.write(json.dumps({"id": i, "text": t}) + "\n")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [python, __file__, "--datatrove-worker", str(data), str(Path(tmp) / "work")]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode != 0:  # datatrove's log and traceback are on the worker's stderr
            sys.stderr.write(out.stderr[-20_000:])
            raise SystemExit(f"datatrove worker failed (exit {out.returncode}): {' '.join(cmd)}")
        r = json.loads(out.stdout.strip().split("\n")[-1])
    return {"times": r["times"], "removed": set(r["removed"]), "clustered": set(r["clustered"])}


# ---------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-docs", type=int, default=50_000)
    ap.add_argument("--planted", type=int, default=1000)
    ap.add_argument("--edit-rate", type=float, default=0.01)
    ap.add_argument("--datatrove-python", default=None)
    ap.add_argument("--datatrove-worker", nargs=2, metavar=("DATA", "WORK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.datatrove_worker:
        datatrove_worker(*args.datatrove_worker)
        return

    base = load_corpus(args.max_docs)
    docs, pairs = plant(base, args.planted, args.edit_rate)
    n = len(docs)
    digest = corpus_digest(docs)
    nbytes = sum(len(t.encode()) for _, t in docs)
    print(f"corpus: {n} documents ({len(base)} real + {len(pairs)} planted near-duplicates), {nbytes:,} bytes, "
          f"sha256 {digest}; rates are documents per CPU-second, one process each")
    # every result line says when, where and with what it was measured
    stamp = (f"[{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%MZ}; {machine()}; {n} docs "
             f"(max {args.max_docs}, {args.planted} planted at {args.edit_rate}) sha256 {digest[:12]}, 5-grams 14x8]")
    ours = bench_ours(docs, pairs)
    rows = []
    np_ = ours["numpy"]
    rows.append(("glmforge quality scoring (fastText)", n / ours["quality"]["score_s"], "-"))
    rows.append(("glmforge MinHash signatures (numpy)", n / np_["sig_s"], "-"))
    rows.append(("glmforge LSH + clusters (numpy)", n / np_["lsh_s"], "-"))
    rows.append(("glmforge MinHash pipeline (sig + LSH)", n / (np_["sig_s"] + np_["lsh_s"]), f"{np_['recall']:.3f}"))
    rows.append(("  same, without Jaccard verification", n / (np_["sig_s"] + np_["lsh_s"]), f"{ours['numpy_unverified']['recall']:.3f}"))
    rows.append(("  same, unverified + numbers -> 0 (datatrove-like)", n / ours["numpy_dtlike"]["s"], f"{ours['numpy_dtlike']['recall']:.3f}"))
    ds = ours["datasketch"]
    rows.append((f"datasketch MinHash.bulk + MinHashLSH ({ds['subset']} docs)", n / (ds["sig_s"] + ds["lsh_s"]), "-"))
    dt = None
    if args.datatrove_python:
        dt = bench_datatrove(args.datatrove_python, docs)
        total = sum(dt["times"].values())
        rows.append(("datatrove signatures", n / dt["times"]["signatures"], "-"))
        rows.append(("datatrove MinHash pipeline (4 stages)", n / total, f"{recall(pairs, dt['removed']):.3f}"))
    print(f"\n{'step':<50} {'docs/s/core':>12} {'recall':>8}")
    for name, rate, rec in rows:
        print(f"{name:<50} {rate:>12,.0f} {rec:>8}  {stamp}")
    if dt is not None:
        speedup = (n / (np_["sig_s"] + np_["lsh_s"])) / (n / sum(dt["times"].values()))
        dt_recall = recall(pairs, dt["removed"])
        met = speedup >= 30 and np_["recall"] >= dt_recall
        print(f"\nspeed-up over datatrove (whole MinHash pipeline, per core): {speedup:.1f}x; recall glmforge "
              f"{np_['recall']:.3f} vs datatrove {dt_recall:.3f}; target >= 30x at equal recall: "
              f"{'met' if met else 'NOT met'}  {stamp}")
        # Removal sets differ even for identical clusters when the tools keep different members,
        # so the documents found in duplicate clusters are compared too.
        for what in ("removed", "clustered"):
            b = dt[what]
            for label, r in (("verified", np_), ("unverified", ours["numpy_unverified"]), ("datatrove-like", ours["numpy_dtlike"])):
                a = r[what]
                print(f"{what} ({label}): glmforge {len(a)}, datatrove {len(b)}, both {len(a & b)}, only glmforge {len(a - b)}, "
                      f"only datatrove {len(b - a)}, Jaccard {len(a & b) / max(1, len(a | b)):.3f}  {stamp}")
        print("datatrove stage seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in dt["times"].items()) + f"  {stamp}")


if __name__ == "__main__":  # required: datatrove's executor re-imports the script in workers
    main()
