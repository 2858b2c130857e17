"""Lease: an exclusive, expiring claim on a name in the store (the runner claims `stage/key`).

Leases live under leases/{name}/{generation} in the store; the Lease docstring says how they work.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runtime.store.base import Store

log = logging.getLogger("glmforge")


class LeaseTimeout(TimeoutError):
    """Another run held a stage's lease for longer than this run was willing to wait."""


def _machine() -> str:
    """This machine: hostname and kernel boot id, so a pid is only ever judged on its own host."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def pid_alive(pid: int) -> bool:
    """Whether a process of this id exists on this machine (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_LIVE_OWNERS: set[str] = set()  # leases held right now by this process (any thread)


class Lease:
    """An exclusive, expiring claim on a name in the store (the runner claims `stage/key`).

    Generations make it atomic with one primitive, `create_exclusive`: the lease is the object
    `leases/{name}/{generation}` with the highest generation. To take it, a run reads the top
    one; when it is released, expired, or held by a dead process on this machine, the run
    creates generation top+1 — of two runs racing for it exactly one succeeds. The holder
    renews `expires` every ttl/3 from a background thread and marks its generation released on
    exit. A run SIGKILLed on this machine is noticed at once (its pid is gone); on another
    machine its lease expires `ttl` seconds after the last heartbeat. Clocks of the machines
    sharing a store must agree to well within `ttl`.
    """

    def __init__(self, store: Store, name: str, ttl: float = 60.0):
        if ttl <= 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl}")
        self.store, self.name, self.ttl = store, name, float(ttl)
        self.prefix = f"leases/{name}"
        self.owner = uuid.uuid4().hex[:16]
        self.generation: int | None = None
        self.holder: dict[str, Any] | None = None  # the live record that made the last try fail
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def uri(self, generation: int) -> str:
        return f"{self.store.uri}/{self.prefix}/{generation:010d}"

    def _key(self, generation: int) -> str:
        return f"{self.prefix}/{generation:010d}"

    def _generations(self) -> list[int]:
        return sorted(int(k.rsplit("/", 1)[1]) for k in self.store.list(self.prefix + "/") if k.rsplit("/", 1)[1].isdigit())

    def _top(self) -> int | None:
        gens = self._generations()
        return gens[-1] if gens else None

    def _record(self, released: bool = False) -> bytes:
        now = time.time()
        return json.dumps({
            "owner": self.owner, "machine": _machine(), "pid": os.getpid(), "generation": self.generation,
            "heartbeat": now, "expires": now + self.ttl, "ttl": self.ttl, "released": released,
        }).encode()

    @staticmethod
    def is_stale(rec: dict[str, Any]) -> bool:
        if rec.get("released") or rec.get("expires", 0) < time.time():
            return True
        if rec.get("machine") == _machine():
            if not pid_alive(int(rec.get("pid", 0))):
                return True  # killed on this machine: no need to wait for the expiry
            if rec.get("pid") == os.getpid() and rec.get("owner") not in _LIVE_OWNERS:
                return True  # an earlier attempt in this process that could not release it
        return False

    def try_acquire(self) -> bool:
        gens = self._generations()
        top = gens[-1] if gens else None
        if top is not None:
            try:
                rec = json.loads(self.store.get_bytes(self._key(top)))
            except FileNotFoundError:
                return False  # superseded and cleaned up while we looked: look again
            except ValueError:
                rec = {}  # unreadable record (torn local write): treat as stale
            if rec and not self.is_stale(rec):
                self.holder = rec
                return False
        self.generation = 0 if top is None else top + 1
        # Live before it exists: a thread of this process that reads the new record at once must
        # not take it for an earlier attempt's leftover (is_stale) and supersede it.
        _LIVE_OWNERS.add(self.owner)
        if not self.store.create_exclusive(self._key(self.generation), self._record()):
            _LIVE_OWNERS.discard(self.owner)
            self.generation = None
            return False
        for older in gens:  # superseded generations: only the top one matters
            self.store.delete_prefix(self._key(older))
        return True

    def acquire(self, wait: float, poll: float | None = None) -> None:
        """Take the lease, waiting up to `wait` seconds for another holder; LeaseTimeout after."""
        poll = poll if poll is not None else min(2.0, self.ttl / 4)
        deadline = time.monotonic() + wait
        said = False
        while not self.try_acquire():
            if time.monotonic() >= deadline:
                h = self.holder or {}
                raise LeaseTimeout(
                    f"{self.name} is being run by another run (owner {h.get('owner')}, pid {h.get('pid')} on "
                    f"{h.get('machine')}, lease {self.uri(int(h.get('generation') or 0))}); gave up after {wait:g} s. "
                    f"A killed run's lease expires {self.ttl:g} s after its last heartbeat."
                )
            if not said and self.holder:
                log.info("%s: held by pid %s on %s; waiting up to %g s", self.name, self.holder.get("pid"),
                         self.holder.get("machine"), wait)
                said = True
            time.sleep(poll)
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name=f"lease-{self.name}", daemon=True)
        self._thread.start()

    def renew(self) -> bool:
        """Push `expires` forward; False (and `lost`) when another run took the lease over."""
        if self.generation is None:
            return False
        if self._top() != self.generation:
            self.lost = True
            log.error("%s: lease taken over by another run (this run stalled past its ttl of %g s)", self.name, self.ttl)
            return False
        self.store.put_bytes(self._key(self.generation), self._record())
        return True

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                if not self.renew():
                    return
            except Exception as e:  # a store outage: keep trying until the lease would expire
                log.warning("%s: lease heartbeat failed: %s", self.name, e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            if self.generation is not None and not self.lost and self._top() == self.generation:
                self.store.put_bytes(self._key(self.generation), self._record(released=True))
        finally:
            _LIVE_OWNERS.discard(self.owner)
            self.generation = None

    @contextlib.contextmanager
    def held(self, wait: float) -> Iterator["Lease"]:
        self.acquire(wait)
        try:
            yield self
        finally:
            try:
                self.release()
            except Exception as e:  # the store is gone: the lease expires on its own
                log.warning("%s: could not release the lease (%s); it expires in %g s", self.name, e, self.ttl)
