"""Starting one node's ranks: torchrun (its elastic agent) vs training.spawn, on the same job.

    .venv/bin/python bench/launch.py [--nproc 2] [--repeats 3] [--json]

The job: every rank imports torch, joins a gloo process group through env:// and all-reduces one
tensor, then exits (what every training stage's ranks do before their first step). Both launchers
run it with the same rank count, the same command and OMP_NUM_THREADS=1, alternating, after one
warm-up each; the figures are the medians of --repeats of the launch's wall time and of the CPU
time of the launcher and its ranks together (resource.getrusage of the children). The ratio is
torchrun / spawn: what each launch of a stage's ranks saves.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(which: str, nproc: int, job_dir: Path) -> tuple[float, float]:
    port = free_port()
    head = {"torchrun": ["-m", "torch.distributed.run", "--nnodes=1", "--max_restarts=0"],
            "spawn": ["-m", "training.spawn"]}[which]
    cmd = [sys.executable, *head, f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={port}", "-m", "bench_launch_job"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(job_dir), str(REPO), os.environ.get("PYTHONPATH", "")])}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        job_dir = Path(tmp)
        (job_dir / "bench_launch_job.py").write_text(JOB)
        runs: dict[str, list[tuple[float, float]]] = {"torchrun": [], "spawn": []}
        for which in runs:
            launch(which, args.nproc, job_dir)             # warm-up: page cache, bytecode
        for _ in range(args.repeats):
            for which in runs:
                runs[which].append(launch(which, args.nproc, job_dir))
    med = {w: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for w, rs in runs.items()}
    out = {"nproc": args.nproc, "repeats": args.repeats,
           "wall_s": {w: round(m[0], 2) for w, m in med.items()},
           "cpu_s": {w: round(m[1], 2) for w, m in med.items()},
           "wall_ratio_torchrun_over_spawn": round(med["torchrun"][0] / med["spawn"][0], 2),
           "cpu_ratio_torchrun_over_spawn": round(med["torchrun"][1] / med["spawn"][1], 2)}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.nproc} ranks, gloo init + one all-reduce, median of {args.repeats}:")
    for w in runs:
        print(f"  {w:9s} wall {out['wall_s'][w]:5.2f} s   cpu {out['cpu_s'][w]:5.2f} s")
    print(f"  torchrun / spawn: wall {out['wall_ratio_torchrun_over_spawn']}x, "
          f"cpu {out['cpu_ratio_torchrun_over_spawn']}x")


if __name__ == "__main__":
    main()
