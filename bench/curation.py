"""Curation throughput: quality scoring, MinHash signatures and LSH, beside datatrove's MinHash.

One corpus of real documents (the Python standard library's own sources, never site-packages or
dist-packages, and the repo's samples/: GSM8K, Tiny Shakespeare, MBPP, GitHub issues), with
planted near-duplicates (1% of the words of 1,000 documents replaced) to measure recall. The
corpus does not depend on what is installed; its size and sha256 are printed, so two runs with
equal digests measured the same documents. Every result line carries the date, the machine and
the settings. Rates per core are documents per CPU-second, so a busy shared machine does not
skew them; wall-clock times are printed beside them.

Two kinds of rows:

- MinHash end to end (the headline comparison): the stage as a user runs it, on both sides.
  The corpus is written once as JSONL files (as many as --processes, default all cores, so
  datatrove can split its tasks over them); both tools read those same files and write the kept
  documents out as JSONL (and the removed ones beside them):
    glmforge:  `glmforge curate dedup-minhash -i DIR -o kept.jsonl --set workers=P`, the CLI in
               its own process (ingest into Parquet shards, signatures, LSH, kept/removed);
    datatrove: its four steps (JsonlReader -> signatures, buckets, cluster, JsonlReader ->
               filter -> JsonlWriter), LocalPipelineExecutor, in its own process.
  Each side is timed as a whole process (interpreter start, imports, reading, dedup, writing):
  wall time, and the CPU time of every process it started (this script makes itself the
  subreaper of orphaned descendants, so datatrove's forkserver pool is counted too). Once with
  1 process each (the per-core ratio, documents per CPU-second) and once with --processes on both
  sides (the wall-time ratio). glmforge's `workers` parallelises the signatures over its ingest
  shards (the CLI's shard size, 5,000 documents); ingest, LSH and writing run in one process.
  datatrove runs tasks=workers=P for signatures and filter, 14 bucket tasks on P workers and one
  cluster task. A 1-document run of each side (1 process) gives the fixed start-up cost.
  Printed: a table (side, processes, CPU s, wall s, docs/cpu-s, docs/s wall, kept, removed,
  recall, same output as with 1 process), then the lines
    `minhash end-to-end (JSONL in -> kept JSONL out), 1 process: ... ratio`   per core;
    `minhash end-to-end (JSONL in -> kept JSONL out), all P cores ...: wall ... ratio`;
    `minhash end-to-end net of start-up ...`   the 1-document runs' CPU subtracted;
    `end-to-end removal sets ...`   both tools' kept and removed counts and their agreement.
- In memory (no I/O): glmforge's signature and LSH functions on texts already in memory, one
  process, beside datatrove's four steps in that same 1-process run (the CPU time of its
  steps, which include their JSONL reading and writing: datatrove has no in-memory API). This
  is the older, lopsided comparison, kept as a second figure (`minhash in memory (no I/O): ...`);
  also the quality scorer and plain datasketch, in memory. The `speed-up over datatrove` line
  (the figure bench/all.py puts in RESULTS.md) leads with the end-to-end per-core ratio and
  gives the in-memory one beside it.

datatrove lives in its own environment (it pins xxhash<4 and pulls spaCy), never in the
project's. Once:

    python3 -m venv /tmp/bench-venv --system-site-packages    # the system Python, not .venv
    /tmp/bench-venv/bin/pip install -r bench/requirements-curation.txt

Then, from the repository root, with the project's environment:

    .venv/bin/python bench/curation.py --datatrove-python /tmp/bench-venv/bin/python

The script re-runs itself under that interpreter (`--datatrove-worker`) for the datatrove part
and compares both tools' removal sets. Without --datatrove-python the datatrove rows are skipped
(glmforge's end-to-end rows are still printed). Not run by the tests.
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
import time
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
    roots, _ = minhash.cluster(sigs, cfg)
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
# End to end: each tool in its own process, the same JSONL files in, kept documents out as JSONL
def write_jsonl(docs, folder: Path, files: int) -> list[Path]:
    """The documents as `files` JSONL files of consecutive documents (records {"id", "text"})."""
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(docs) // files)
    paths = []
    for k in range(files):
        path = folder / f"part-{k:05d}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs[k * per : (k + 1) * per])
        paths.append(path)
    return paths


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux PR_SET_CHILD_SUBREAPER):
    a process a tool leaves behind when its parent exits (datatrove's forkserver, which forks the
    pool workers) is then waited for here, and its CPU time counts in RUSAGE_CHILDREN."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def child_pids() -> set[int]:
    """This process's children (Linux /proc), running or not yet waited for."""
    me, out = os.getpid(), set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                    out.add(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def reap_orphans(ours: set[int], timeout: float = 120.0) -> bool:
    """Wait for every child of this process that is not in `ours` (the children it had before a
    measured command: the in-memory part leaves a resource tracker running): the descendants of
    the command reparented here. False if some still run after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = child_pids() - ours
        if not left:
            return True
        for pid in left:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def children_cpu() -> float:
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def run_measured(cmd: list[str], what: str) -> tuple[str, float, float]:
    """Run cmd (OMP_NUM_THREADS=1, from the repository root); (stdout, wall s, CPU s of it and of
    every process it started)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ours = child_pids()
    c0, w0 = children_cpu(), time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    wall = time.perf_counter() - w0
    if not reap_orphans(ours):
        print(f"warning: {what}: processes it started still run 2 minutes after it exited; their CPU time is not "
              "counted", file=sys.stderr)
    cpu = children_cpu() - c0
    if out.returncode != 0:  # the tool's log and traceback are on its stderr
        sys.stderr.write(out.stderr[-20_000:])
        raise SystemExit(f"{what} failed (exit {out.returncode}): {' '.join(cmd)}")
    return out.stdout, wall, cpu


def glmforge_cli() -> list[str]:
    """The `glmforge` command a user runs: the console script beside this interpreter."""
    exe = Path(sys.executable).with_name("glmforge")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "glmforge.cli"]


def e2e_glmforge(data: Path, out: Path, procs: int) -> dict:
    kept_file = out / "kept.jsonl"  # kept documents; removed ones and reports under kept.jsonl.files/
    cmd = glmforge_cli() + ["curate", "dedup-minhash", "-i", str(data), "-o", str(kept_file), "--set", f"workers={procs}"]
    stdout, wall, cpu = run_measured(cmd, f"glmforge curate dedup-minhash ({procs} processes)")
    kept = [r["id"] for r in jsonl_records(kept_file)]
    shards = json.loads(stdout[stdout.index("{"):])["input"].get("shards")  # the CLI prints its result as JSON
    return {"wall": wall, "cpu": cpu, "kept": set(kept), "digest": hashlib.sha256(kept_file.read_bytes()).hexdigest(),
            "shards": shards}


def datatrove_worker(data_dir: str, work: str, procs: str) -> None:
    """datatrove's MinHash dedup as its docs run it: four LocalPipelineExecutors, JSONL in, kept
    (and removed) documents out as JSONL. Prints each step's CPU and wall seconds (CPU of this
    process and its waited-for children: exact with one worker) as JSON, nothing else: the
    outputs are read by the caller, outside the timed process."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    p = int(procs)
    cfg = MinhashConfig()  # 5-grams, 14 buckets x 8 hashes
    times, walls = {}, {}

    def timed(name, executor):
        t0, w0 = cpu_seconds(), time.perf_counter()
        executor.run()
        times[name], walls[name] = cpu_seconds() - t0, time.perf_counter() - w0

    log = f"{work}/logs"
    timed("signatures", LocalPipelineExecutor(
        pipeline=[JsonlReader(data_dir), MinhashDedupSignature(output_folder=f"{work}/sigs", config=cfg)],
        tasks=p, workers=p, logging_dir=f"{log}/sigs"))
    timed("buckets", LocalPipelineExecutor(
        pipeline=[MinhashDedupBuckets(input_folder=f"{work}/sigs", output_folder=f"{work}/buckets", config=cfg)],
        tasks=cfg.num_buckets, workers=p, logging_dir=f"{log}/buckets"))
    timed("cluster", LocalPipelineExecutor(
        pipeline=[MinhashDedupCluster(input_folder=f"{work}/buckets", output_folder=f"{work}/remove_ids", config=cfg,
                                      save_cluster_id=True)],
        tasks=1, workers=1, logging_dir=f"{log}/cluster"))
    timed("filter", LocalPipelineExecutor(
        pipeline=[JsonlReader(data_dir), MinhashDedupFilter(input_folder=f"{work}/remove_ids", load_cluster_ids=True,
                  exclusion_writer=JsonlWriter(f"{work}/removed", compression=None)),
                  JsonlWriter(f"{work}/kept", compression=None)],
        tasks=p, workers=p, logging_dir=f"{log}/filter"))
    print(json.dumps({"times": times, "walls": walls}))


def e2e_datatrove(python: str, data: Path, work: Path, procs: int) -> dict:
    cmd = [python, __file__, "--datatrove-worker", str(data), str(work), str(procs)]
    stdout, wall, cpu = run_measured(cmd, f"datatrove worker ({procs} processes)")
    r = json.loads(stdout.strip().split("\n")[-1])
    recs = {d: [r for p in sorted((work / d).glob("*.jsonl")) for r in jsonl_records(p)] for d in ("kept", "removed")}
    return {
        "wall": wall, "cpu": cpu, "times": r["times"], "walls": r["walls"],
        "kept": {r["id"] for r in recs["kept"]},
        "removed": {r["id"] for r in recs["removed"]},
        # every document datatrove put in a duplicate cluster (kept or removed)
        "clustered": {r["id"] for d in recs.values() for r in d if r.get("metadata", {}).get("minhash_cluster_id", -1) != -1},
    }


def bench_end_to_end(docs, procs: int, python: str | None) -> dict:
    """Both sides with 1 process and with `procs`, on the same JSONL files; 1-document runs for
    the start-up cost. Sides alternate, so a change in the machine's load hits both."""
    res: dict = {"glmforge": {}, "datatrove": {}}
    become_subreaper()
    with tempfile.TemporaryDirectory(prefix="bench-curation-") as tmp:
        tmp = Path(tmp)
        files = write_jsonl(docs, tmp / "data", procs)
        res["files"], res["bytes"] = len(files), sum(p.stat().st_size for p in files)
        write_jsonl(docs[:1], tmp / "one", 1)
        for p in sorted({1, procs}):
            res["glmforge"][p] = e2e_glmforge(tmp / "data", tmp / f"glmforge-{p}", p)
            if python:
                res["datatrove"][p] = e2e_datatrove(python, tmp / "data", tmp / f"datatrove-{p}", p)
        res["glmforge"]["startup"] = e2e_glmforge(tmp / "one", tmp / "glmforge-one", 1)
        if python:
            res["datatrove"]["startup"] = e2e_datatrove(python, tmp / "one", tmp / "datatrove-one", 1)
    return res


# ---------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-docs", type=int, default=50_000)
    ap.add_argument("--planted", type=int, default=1000)
    ap.add_argument("--edit-rate", type=float, default=0.01)
    ap.add_argument("--processes", type=int, default=os.cpu_count() or 1,
                    help="processes of each side in the all-cores end-to-end run (default: all cores)")
    ap.add_argument("--datatrove-python", default=None)
    ap.add_argument("--datatrove-worker", nargs=3, metavar=("DATA", "WORK", "PROCS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.datatrove_worker:
        datatrove_worker(*args.datatrove_worker)
        return

    base = load_corpus(args.max_docs)
    docs, pairs = plant(base, args.planted, args.edit_rate)
    n = len(docs)
    ids = [i for i, _ in docs]
    digest = corpus_digest(docs)
    nbytes = sum(len(t.encode()) for _, t in docs)
    P = args.processes
    print(f"corpus: {n} documents ({len(base)} real + {len(pairs)} planted near-duplicates), {nbytes:,} bytes, "
          f"sha256 {digest}; rates per core are documents per CPU-second")
    # every result line says when, where and with what it was measured
    stamp = (f"[{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%MZ}; {machine()}; {n} docs "
             f"(max {args.max_docs}, {args.planted} planted at {args.edit_rate}) sha256 {digest[:12]}, 5-grams 14x8]")
    ours = bench_ours(docs, pairs)
    e2e = bench_end_to_end(docs, P, args.datatrove_python)
    g, d = e2e["glmforge"], e2e["datatrove"]
    dt = d.get(1)
    np_ = ours["numpy"]

    # ---- end to end
    print(f"\nMinHash stage end to end: the same {e2e['files']} JSONL file(s) in ({n} docs, {e2e['bytes']:,} bytes), kept "
          "documents written out as JSONL (removed ones beside them). Whole processes (interpreter start, imports, "
          "reading, dedup, writing); CPU = every process the side started.")
    print(f"{'side':<10} {'procs':>5} {'cpu-s':>8} {'wall-s':>8} {'docs/cpu-s':>11} {'docs/s wall':>12} {'kept':>7} "
          f"{'removed':>8} {'recall':>7}  same output as 1 process")
    for name, side in (("glmforge", g), ("datatrove", d)):
        for p in sorted(k for k in side if k != "startup"):
            r = side[p]
            removed = set(ids) - r["kept"]
            same = "-" if p == 1 else ("yes" if r["kept"] == side[1]["kept"] and r.get("digest") == side[1].get("digest")
                                       else "NO")
            print(f"{name:<10} {p:>5} {r['cpu']:>8.1f} {r['wall']:>8.1f} {n / r['cpu']:>11,.0f} {n / r['wall']:>12,.0f} "
                  f"{len(r['kept']):>7} {len(removed):>8} {recall(pairs, removed):>7.3f}  {same}")
    for name, side in (("glmforge", g), ("datatrove", d)):
        if "startup" in side:
            s = side["startup"]
            print(f"{name} start-up (the same run on a 1-document file, 1 process): {s['cpu']:.1f} cpu-s, {s['wall']:.1f} s wall")
    how = (f"glmforge: `curate dedup-minhash --set workers={P}`, signatures of its {g[1]['shards']} ingest shards "
           f"(the CLI's shard size) in {P} processes, ingest + LSH + writing in one; datatrove: "
           f"LocalPipelineExecutor tasks={P} workers={P} for signatures and filter, 14 bucket tasks on {P} workers, "
           "1 cluster task")
    e2e_ratio = None
    if dt is not None:
        e2e_ratio = dt["cpu"] / g[1]["cpu"]  # (docs per glmforge CPU-second) / (docs per datatrove CPU-second)
        print(f"\nminhash end-to-end (JSONL in -> kept JSONL out), 1 process: glmforge {n / g[1]['cpu']:,.0f} docs/cpu-s, "
              f"datatrove {n / dt['cpu']:,.0f} docs/cpu-s, ratio {e2e_ratio:.1f}x (wall {g[1]['wall']:.1f} s vs "
              f"{dt['wall']:.1f} s)  {stamp}")
        if P > 1:
            a, b = g[P], d[P]
            print(f"minhash end-to-end (JSONL in -> kept JSONL out), all {P} cores ({P} processes each): wall glmforge "
                  f"{a['wall']:.1f} s, datatrove {b['wall']:.1f} s, ratio {b['wall'] / a['wall']:.1f}x; per core "
                  f"glmforge {n / a['cpu']:,.0f} docs/cpu-s, datatrove {n / b['cpu']:,.0f}, ratio "
                  f"{b['cpu'] / a['cpu']:.1f}x; {how}  {stamp}")
        gs, ds = g["startup"]["cpu"], d["startup"]["cpu"]
        if g[1]["cpu"] > gs and dt["cpu"] > ds:
            print(f"minhash end-to-end net of start-up (each side's 1-document run subtracted), 1 process: glmforge "
                  f"{n / (g[1]['cpu'] - gs):,.0f} docs/cpu-s, datatrove {n / (dt['cpu'] - ds):,.0f} docs/cpu-s, ratio "
                  f"{(dt['cpu'] - ds) / (g[1]['cpu'] - gs):.1f}x  {stamp}")
        a, b = set(ids) - g[1]["kept"], dt["removed"]
        print(f"end-to-end removal sets, 1 process: glmforge {len(a)}, datatrove {len(b)}, both {len(a & b)}, "
              f"Jaccard {len(a & b) / max(1, len(a | b)):.3f}; kept glmforge {len(g[1]['kept'])}, datatrove "
              f"{len(dt['kept'])}; glmforge's equal to its in-memory run: {'yes' if a == np_['removed'] else 'NO'}  {stamp}")
    else:
        print(f"\nminhash end-to-end (JSONL in -> kept JSONL out), glmforge only: 1 process {n / g[1]['cpu']:,.0f} "
              f"docs/cpu-s ({g[1]['wall']:.1f} s wall)" + (f", {P} processes {g[P]['wall']:.1f} s wall" if P > 1 else "")
              + f"  {stamp}")

    # ---- in memory
    rows = []
    rows.append(("glmforge quality scoring (fastText)", n / ours["quality"]["score_s"], "-"))
    rows.append(("glmforge MinHash signatures, in memory (no I/O)", n / np_["sig_s"], "-"))
    rows.append(("glmforge LSH + clusters, in memory (no I/O)", n / np_["lsh_s"], "-"))
    rows.append(("glmforge MinHash sig + LSH, in memory (no I/O)", n / (np_["sig_s"] + np_["lsh_s"]), f"{np_['recall']:.3f}"))
    rows.append(("  same, without Jaccard verification", n / (np_["sig_s"] + np_["lsh_s"]), f"{ours['numpy_unverified']['recall']:.3f}"))
    rows.append(("  same, unverified + numbers -> 0 (datatrove-like)", n / ours["numpy_dtlike"]["s"], f"{ours['numpy_dtlike']['recall']:.3f}"))
    ds = ours["datasketch"]
    rows.append((f"datasketch MinHash.bulk + MinHashLSH ({ds['subset']} docs)", n / (ds["sig_s"] + ds["lsh_s"]), "-"))
    if dt is not None:
        total = sum(dt["times"].values())
        rows.append(("datatrove signatures", n / dt["times"]["signatures"], "-"))
        rows.append(("datatrove MinHash pipeline (4 stages)", n / total, f"{recall(pairs, dt['removed']):.3f}"))
    print("\nin memory (no I/O), one process each; quality scoring is in memory too; the datatrove rows are the CPU time "
          "of its steps in the 1-process end-to-end run, with their JSONL reading and writing (datatrove has no "
          "in-memory API)")
    print(f"{'step':<50} {'docs/s/core':>12} {'recall':>8}")
    for name, rate, rec in rows:
        print(f"{name:<50} {rate:>12,.0f} {rec:>8}  {stamp}")
    if dt is not None:
        mem_ratio = (n / (np_["sig_s"] + np_["lsh_s"])) / (n / sum(dt["times"].values()))
        dt_recall = recall(pairs, dt["removed"])
        print(f"minhash in memory (no I/O): glmforge sig + LSH {n / (np_['sig_s'] + np_['lsh_s']):,.0f} docs/cpu-s vs "
              f"datatrove's 4 steps (with their JSONL I/O) {n / sum(dt['times'].values()):,.0f} docs/cpu-s, ratio "
              f"{mem_ratio:.1f}x, 1 process  {stamp}")
        met = e2e_ratio >= 30 and np_["recall"] >= dt_recall
        print(f"\nspeed-up over datatrove (MinHash stage end to end, JSONL in -> kept JSONL out, per core, 1 process each): "
              f"{e2e_ratio:.1f}x; in memory (no I/O): {mem_ratio:.1f}x; recall glmforge {np_['recall']:.3f} vs datatrove "
              f"{dt_recall:.3f}; target >= 30x at equal recall: end to end {'met' if met else 'NOT met'}, in memory "
              f"{'met' if mem_ratio >= 30 and np_['recall'] >= dt_recall else 'NOT met'}  {stamp}")
        # Removal sets differ even for identical clusters when the tools keep different members,
        # so the documents found in duplicate clusters are compared too.
        for what in ("removed", "clustered"):
            b = dt[what]
            for label, r in (("verified", np_), ("unverified", ours["numpy_unverified"]), ("datatrove-like", ours["numpy_dtlike"])):
                a = r[what]
                print(f"{what} ({label}): glmforge {len(a)}, datatrove {len(b)}, both {len(a & b)}, only glmforge {len(a - b)}, "
                      f"only datatrove {len(b - a)}, Jaccard {len(a & b) / max(1, len(a | b)):.3f}  {stamp}")
        print("datatrove step seconds (1 process), CPU: " + ", ".join(f"{k} {v:.1f}" for k, v in dt["times"].items())
              + "; wall: " + ", ".join(f"{k} {v:.1f}" for k, v in dt["walls"].items()) + f"  {stamp}")


if __name__ == "__main__":  # required: datatrove's executor re-imports the script in workers
    main()
