"""Rollout workers in their own processes, reached over TCP: routing, weights, heartbeats.

    pool = WorkerPool(n, config, weights_dir); pool.start()
    pool.publish(model, version)        # the version in buckets, then ("weights", v, dir) to all
    pool.submit(group, task, n)         # routed by a consistent hash of the group id
    pool.poll(timeout) -> [(group, samples)]   finished groups, in arrival order
    pool.close()

Routing: a consistent-hash ring over the live workers (64 virtual nodes each) maps a group id
to one worker, so every turn of that group's episodes runs where its KV cache lives; when a
worker leaves, only its groups move. A worker is dead when its socket closes or it misses
heartbeats for `dead_after_s`: it is deregistered (and killed), a replacement is started, and its
in-flight groups are submitted again to their new owners. A group's rollouts are seeded by
(seed, group, turn) (rl.agent.seed_for), so a re-routed group regenerates the same way.

Weights: the trainer publishes each version in buckets under weights_dir (rl.weight_sync: per-
bucket sha256, a manifest written last) and tells every worker; a worker verifies the whole
version before it takes it, and applies it between requests or between turns. Old versions are
deleted once no longer the newest two.
"""
from __future__ import annotations

import bisect
import hashlib
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any

from domains.task import Task
from model.model import GLMModel
from rl import weight_sync
from rl.sample import Sample
from rl.wire import sample_from_dict, task_to_dict

log = logging.getLogger("glmforge")
REPO = Path(__file__).resolve().parents[1]


def _h(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


class HashRing:
    """Consistent hashing: owner(key) is the first virtual node clockwise from hash(key)."""

    def __init__(self, replicas: int = 64):
        self.replicas, self._points, self._owners = replicas, [], []

    def add(self, node: str) -> None:
        for r in range(self.replicas):
            p = _h(f"{node}#{r}")
            i = bisect.bisect(self._points, p)
            self._points.insert(i, p)
            self._owners.insert(i, node)

    def remove(self, node: str) -> None:
        keep = [(p, o) for p, o in zip(self._points, self._owners) if o != node]
        self._points, self._owners = [p for p, _ in keep], [o for _, o in keep]

    def owner(self, key: str) -> str:
        if not self._points:
            raise RuntimeError("no live rollout workers")
        i = bisect.bisect(self._points, _h(key)) % len(self._points)
        return self._owners[i]


@dataclass
class _Worker:
    id: str
    proc: subprocess.Popen
    conn: Connection
    last_seen: float
    inflight: dict[int, tuple[Task, int]] = field(default_factory=dict)


class WorkerPool:
    def __init__(self, n: int, config: dict[str, Any], weights_dir: Path, heartbeat_s: float = 1.0,
                 dead_after_s: float = 30.0, start_timeout_s: float = 120.0,
                 bucket_bytes: int = weight_sync.DEFAULT_BUCKET_BYTES):
        if n < 1:
            raise ValueError(f"need at least one rollout worker, got {n}")
        self.n, self.weights_dir = n, Path(weights_dir)
        self.config = {**config, "heartbeat_s": heartbeat_s}
        self.dead_after_s, self.start_timeout_s = dead_after_s, start_timeout_s
        self.bucket_bytes = bucket_bytes
        self.workers: dict[str, _Worker] = {}
        self.ring = HashRing()
        self.restarts = self.rerouted = 0
        self._serial = 0
        self._weights: tuple[int, str] | None = None
        self._authkey = secrets.token_bytes(32)
        self._listener: Listener | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._authkey)
        for _ in range(self.n):
            self._spawn()

    def _spawn(self) -> _Worker:
        wid = f"w{self._serial}"
        self._serial += 1
        host, port = self._listener.address
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PREFECT_API_KEY"))}
        env["GLMFORGE_RL_AUTHKEY"] = self._authkey.hex()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        proc = subprocess.Popen([sys.executable, "-m", "rl.rollout_worker", f"{host}:{port}", wid], env=env,
                                start_new_session=True)
        accepted: list[Connection] = []
        waiter = threading.Thread(target=lambda: accepted.append(self._listener.accept()), daemon=True)
        waiter.start()
        waiter.join(self.start_timeout_s)
        if not accepted:
            os.killpg(proc.pid, 9)
            raise RuntimeError(f"rollout worker {wid} did not connect within {self.start_timeout_s}s "
                               f"(exit code {proc.poll()})")
        conn = accepted[0]
        hello = conn.recv()
        if hello[:2] != ("hello", wid):
            raise RuntimeError(f"unexpected first message from a rollout worker: {hello!r}")
        conn.send(("config", self.config))
        if self._weights is not None:
            conn.send(("weights", *self._weights))
        w = _Worker(wid, proc, conn, time.monotonic())
        self.workers[wid] = w
        self.ring.add(wid)
        return w

    def close(self, timeout: float = 10.0) -> None:
        for w in list(self.workers.values()):
            try:
                w.conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for w in list(self.workers.values()):
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(w.proc.pid, 9)
                w.proc.wait()
            w.conn.close()
        self.workers.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def __enter__(self) -> "WorkerPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ weights and requests
    def publish(self, model: GLMModel, version: int) -> weight_sync.Published:
        """Version `version` of the policy in buckets (rl.weight_sync), then announce it."""
        done = weight_sync.publish(self.weights_dir, version, model.state_dict(),
                                   config_json=model.config.model_dump_json(), bucket_bytes=self.bucket_bytes)
        self.announce(version)
        return done

    def announce(self, version: int) -> None:
        """("weights", v, dir) to every worker, for a version already complete in weights_dir (the
        trainer's ranks each published their part); the newest two complete versions are kept."""
        if not weight_sync.complete(self.weights_dir, version):
            raise weight_sync.IncompleteVersion(f"policy version {version} is not complete in {self.weights_dir}")
        self._weights = (version, str(self.weights_dir))
        for w in list(self.workers.values()):
            self._send(w, ("weights", version, str(self.weights_dir)))
        weight_sync.prune(self.weights_dir)

    def submit(self, group: int, task: Task, n: int) -> str:
        w = self.workers[self.ring.owner(str(group))]
        w.inflight[group] = (task, n)
        self._send(w, ("generate", group, task_to_dict(task), n))
        return w.id

    def inflight(self) -> dict[int, tuple[Task, int]]:
        return {g: tn for w in self.workers.values() for g, tn in w.inflight.items()}

    def _send(self, w: _Worker, msg: tuple) -> None:
        try:
            w.conn.send(msg)
        except OSError:
            self._replace(w, "socket closed on send")

    # ------------------------------------------------------------ results and failures
    def poll(self, timeout: float) -> list[tuple[int, list[Sample]]]:
        done: list[tuple[int, list[Sample]]] = []
        conns = {w.conn: w for w in self.workers.values()}
        for conn in wait(list(conns), timeout=timeout):
            w = conns[conn]
            try:
                while conn.poll():
                    msg = conn.recv()
                    w.last_seen = time.monotonic()
                    if msg[0] == "result":
                        _, _, group, samples = msg
                        if w.inflight.pop(group, None) is not None:
                            done.append((group, [sample_from_dict(s) for s in samples]))
            except (EOFError, OSError):
                self._replace(w, "socket closed")
        now = time.monotonic()
        for w in list(self.workers.values()):
            if w.id in self.workers and (w.proc.poll() is not None or now - w.last_seen > self.dead_after_s):
                self._replace(w, f"exit code {w.proc.poll()}" if w.proc.poll() is not None else "missed heartbeats")
        return done

    def kill(self, worker_id: str) -> None:
        """Kill a worker's whole process group (tests, chaos); poll() notices and replaces it."""
        os.killpg(self.workers[worker_id].proc.pid, 9)

    def _replace(self, w: _Worker, why: str) -> None:
        if w.id not in self.workers:
            return
        log.warning("rollout worker %s lost (%s): restarting it and re-routing %d groups", w.id, why,
                    len(w.inflight))
        del self.workers[w.id]
        self.ring.remove(w.id)
        try:
            os.killpg(w.proc.pid, 9)
        except ProcessLookupError:
            pass
        w.proc.wait()
        w.conn.close()
        self._spawn()
        self.restarts += 1
        for group, (task, n) in sorted(w.inflight.items()):
            self.rerouted += 1
            self.submit(group, task, n)
