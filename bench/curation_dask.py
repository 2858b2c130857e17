"""Distributed curation throughput: exact + MinHash dedup as Prefect tasks on a Dask LocalCluster
of 1 and 2 worker processes, with 1 and more input shards per Prefect task, beside the
single-process steps, on the same corpus.

Corpus: bench/curation.py's real documents (stdlib sources, man pages when present, samples/)
with planted near-duplicates and exact copies, written as shards of --shard-size documents.
Reports documents/s (wall clock; Dask cluster start included, Prefect server start not)
and checks that each Dask run's output equals the single-process output. Prefect runs in its
ephemeral mode unless PREFECT_API_URL is set. On a shared 2-core machine the 2-worker figure
says little about scaling; run it where the workers have cores of their own.

    .venv/bin/python bench/curation_dask.py --max-docs 4000 --shards-per-task 1 5

Not run by the tests.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]


def write_corpus(directory: Path, max_docs: int, shard_size: int, planted: int) -> int:
    from curation import load_corpus

    from data_processing.document import Document, ShardWriter

    docs = [Document(str(i), t, "bench") for i, t in load_corpus(max_docs)]
    rng = random.Random(0)
    extra = []
    for k in range(planted):
        d = docs[rng.randrange(len(docs))]
        words = d.text.split()
        for _ in range(max(1, len(words) // 100)):  # 1% of the words replaced
            words[rng.randrange(len(words))] = "zap"
        extra.append(Document(f"near-{k}", " ".join(words), "planted"))
        extra.append(Document(f"copy-{k}", d.text.upper(), "planted"))
    docs += extra
    rng.shuffle(docs)
    w = ShardWriter(directory, shard_size)
    w.write_all(docs)
    w.close()
    return len(docs)


def same_output(a: Path, b: Path) -> bool:
    from data_processing.document import read_documents, shard_paths

    def rows(d):
        return [(x.id, x.text, x.metadata) for x in read_documents(d)] if shard_paths(d) else []

    return ([p.name for p in shard_paths(a)] == [p.name for p in shard_paths(b)]
            and rows(a) == rows(b) and rows(a / "removed") == rows(b / "removed"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-docs", type=int, default=4000)
    ap.add_argument("--planted", type=int, default=200)
    ap.add_argument("--shard-size", type=int, default=250)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--shards-per-task", type=int, nargs="+", default=[1, 5],
                    help="input shards per Prefect task (DaskConfig.shards_per_task); each value is a run")
    args = ap.parse_args()

    from data_processing import dedup_exact, minhash
    from data_processing.common import DaskConfig
    from tasks.dask_dedup import run_dedup
    from runtime.stage import Workdir

    from prefect import flow

    @flow
    def warm_up() -> None:
        """Start Prefect's ephemeral server before timing (a real deployment has one running)."""

    warm_up()
    tmp = Path(tempfile.mkdtemp(prefix="curation-dask-"))
    n = write_corpus(tmp / "in", args.max_docs, args.shard_size, args.planted)
    rows = []

    t = time.perf_counter()
    w1 = Workdir.at(tmp / "single-exact")
    dedup_exact.run(dedup_exact.DedupExactConfig(shard_size=args.shard_size), {"p": tmp / "in"}, w1)
    t_exact = time.perf_counter() - t
    t = time.perf_counter()
    w2 = Workdir.at(tmp / "single-mh")
    minhash.run(minhash.MinHashConfig(shard_size=args.shard_size), {"p": w1.out}, w2)
    t_mh = time.perf_counter() - t
    rows.append({"engine": "single process", "workers": 1, "shards_per_task": "-", "exact_docs_s": n / t_exact,
                 "minhash_docs_s": n / t_mh, "same_output": True})

    for per_task in args.shards_per_task:
        for k in args.workers:
            s = DaskConfig(workers=k, processes=True, shards_per_task=per_task)
            run = f"{k}w{per_task}"
            t = time.perf_counter()
            run_dedup("dedup-exact", tmp / "in", tmp / f"{run}-exact", tmp / f"scratch{run}-exact", s, args.shard_size)
            te = time.perf_counter() - t
            t = time.perf_counter()
            run_dedup("dedup-minhash", tmp / f"{run}-exact", tmp / f"{run}-mh", tmp / f"scratch{run}-mh", s,
                      args.shard_size, minhash.MinHashConfig(shard_size=args.shard_size))
            tm = time.perf_counter() - t
            same = same_output(w1.out, tmp / f"{run}-exact") and same_output(w2.out, tmp / f"{run}-mh")
            rows.append({"engine": "dask+prefect", "workers": k, "shards_per_task": per_task, "exact_docs_s": n / te,
                         "minhash_docs_s": n / tm, "same_output": same})

    print(f"\n{n} documents in {len(list((tmp / 'in').glob('part-*.parquet')))} shards\n")
    print("| engine | workers | shards per task | exact dedup docs/s | MinHash dedup docs/s | output equal |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['workers']} | {r['shards_per_task']} | {r['exact_docs_s']:.0f} | "
              f"{r['minhash_docs_s']:.0f} | {r['same_output']} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
