"""One shutdown path for every long-running process: SIGTERM is handled like SIGINT, children
are stopped in order and waited for, and a training step in flight ends with a checkpoint.

Three pieces:

* `install()` (commands: run, resume, serve, curate): SIGTERM and SIGINT both raise
  KeyboardInterrupt in the main thread, so the same `finally` blocks run for `docker stop`,
  a Kubernetes eviction and Ctrl-C. Inside `deferred()` the first signal only sets the stop
  flag (the code there checks it at a safe point, e.g. the end of a training
  step) and runs the registered `on_stop` callbacks (forward the signal to training ranks);
  a second signal raises at once.
* `stop_process_group` / `ProcessGroups`: stop children that run in their own process group
  (Prefect server and worker, the training launcher) with their signals, wait `timeout`
  seconds, then SIGKILL the whole group, so no grandchild outlives the command
  (`reap_orphans` for those in sessions of their own).
* `PreemptionGuard` (training ranks, the RL stage): the first SIGTERM/SIGINT sets a flag that
  the loop reads after each step (it then writes a checkpoint and exits with EXIT_PREEMPTED);
  a second signal, or `grace_s` seconds passing, ends the process at once with 128+signal.
  The guard reads signals through `signal.set_wakeup_fd` in its own thread, so it acts even
  while the main thread is blocked inside a collective that never returns.

Exit statuses: EXIT_PREEMPTED (75, EX_TEMPFAIL: "try again") = stopped on request after writing
a checkpoint; 128+signal (143 for SIGTERM, 130 for SIGINT) = stopped at once, the previous
checkpoint stands.
"""
from __future__ import annotations

import contextlib
import os
import sys
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

EXIT_PREEMPTED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(RuntimeError):
    """The stage stopped because its process was asked to (SIGTERM/SIGINT, a pod eviction).
    Not a fault of the stage: a rerun (`glmforge resume`, the deployment's retry) continues
    from the checkpoint written on the way out."""


class CancelledByUser(Preempted):
    """A stop that was a user's cancel (Prefect's Cancel of the flow run): the stage stopped as
    on any stop, its checkpoint kept, and the run ends Cancelled, never rerun."""


# ---------------------------------------------------------------- command processes
_lock = threading.Lock()
_stop = threading.Event()
_signals: list[int] = []
_callbacks: list[Callable[[int], None]] = []
_defer_depth = 0


def note(signum: int) -> bool:
    """Remember a stop signal and run the on_stop callbacks; True for the first. Another handler
    that takes the signal (Prefect's, which raises in whatever frame runs, a weakref callback
    included, where the exception is lost) calls this first, so the stop is never forgotten."""
    with _lock:
        _signals.append(signum)
        callbacks = list(_callbacks)
        first = len(_signals) == 1
    _stop.set()
    for cb in callbacks:
        try:
            cb(signum)
        except Exception:  # a failing callback must not hide the interrupt
            pass
    return first


def _handler(signum: int, frame) -> None:
    if note(signum) and _defer_depth > 0:
        return
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def install() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handler)


def stop_requested() -> bool:
    return _stop.is_set()


def received() -> list[int]:
    """Signals received since install() (or reset()), oldest first."""
    with _lock:
        return list(_signals)


def reset() -> None:
    """Forget received signals (tests, or a long-lived process that recovered from one)."""
    with _lock:
        _signals.clear()
    _stop.clear()


def exit_code() -> int:
    """128 + the first signal received (130 for SIGINT, 143 for SIGTERM); 130 when none."""
    sigs = received()
    return 128 + (sigs[0] if sigs else signal.SIGINT)


@contextlib.contextmanager
def deferred() -> Iterator[Callable[[], bool]]:
    """Within this block the first stop signal does not raise: the code calls the yielded
    function (True once a signal arrived in the block) where stopping is safe. A second signal raises KeyboardInterrupt.
    From the main thread; elsewhere the handler of the main thread decides."""
    global _defer_depth
    # Prefect's flow engine swaps in its own SIGTERM handler for the flow's duration (it raises
    # at once and marks the run Crashed); within this block ours takes over, then theirs returns.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _handler) for sig in STOP_SIGNALS}
    with _lock:
        _defer_depth += 1
        seen = len(_signals)
    try:
        yield lambda: len(received()) > seen
    finally:
        with _lock:
            _defer_depth -= 1
        for sig, h in previous.items():
            signal.signal(sig, h if h is not None else signal.SIG_DFL)


@contextlib.contextmanager
def on_stop(callback: Callable[[int], None]) -> Iterator[None]:
    """Call callback(signum) on every stop signal while in this block (from the signal
    handler, so keep it short: send a signal, set a flag). Called at once for signals that
    already arrived."""
    with _lock:
        _callbacks.append(callback)
        early = list(_signals)
    try:
        for sig in early:
            callback(sig)
        yield
    finally:
        with _lock:
            _callbacks.remove(callback)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Record stop signals without raising (main thread): for a cleanup that must finish,
    such as stopping children, which a second Ctrl-C would otherwise cut short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def record(signum: int, frame) -> None:
        with _lock:
            _signals.append(signum)
        _stop.set()

    previous = {sig: signal.signal(sig, record) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h if h is not None else signal.SIG_DFL)


# ---------------------------------------------------------------- children
def terminate_children(signum: int = signal.SIGTERM) -> None:
    """SIGTERM every direct child of this process (process-pool workers): an on_stop callback
    for commands whose pools would otherwise finish their whole queue before exiting."""
    for pid in _pids():
        try:
            if int(_stat(pid)[3]) == os.getpid():
                os.kill(pid, signal.SIGTERM)
        except (OSError, IndexError, ValueError):
            continue


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) also succeeds for zombies; a group whose members are all zombies is done.
    for pid in _pids():
        try:
            stat = _stat(pid)
        except (OSError, IndexError):
            continue
        if int(stat[4]) == pgid and stat[2] != "Z":
            return True
    return False


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat fields, the command name (field 2, may hold spaces) kept whole."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    head, _, tail = raw.rpartition(")")
    pid_s, _, comm = head.partition(" (")
    return [pid_s, comm, *tail.split()]


def die_with_parent() -> None:
    """A Popen preexec_fn: SIGTERM this child when the thread that started it dies (Linux
    PR_SET_PDEATHSIG), so a launcher or rank never outlives the process that supervises it."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def descendants(pid: int) -> list[int]:
    """Every live descendant of pid (children first), from /proc."""
    children: dict[int, list[int]] = {}
    for p in _pids():
        try:
            children.setdefault(int(_stat(p)[3]), []).append(p)
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def stop_process_group(proc: subprocess.Popen, signals: Sequence[int] = (signal.SIGTERM,),
                       timeout: float = 20.0) -> int | None:
    """Stop a child started with start_new_session=True and everything in its process group:
    send `signals` in turn to the group, wait up to `timeout` s for the child, then SIGKILL the
    group (also when the child exited but left members behind). Returns its exit status."""
    pgid = proc.pid
    if proc.poll() is None:
        for sig in signals:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + min(timeout, 5.0)
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)  # members still finishing after the leader exited
    if _group_alive(pgid) or proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    return proc.wait()


def process_ids(pids: Sequence[int]) -> list[tuple[int, str]]:
    """(pid, start time) of each live pid: a pid that ends and is reused is not the same process."""
    out = []
    for p in pids:
        with contextlib.suppress(OSError, IndexError):
            out.append((p, _stat(p)[21]))
    return out


def reap_orphans(processes: Sequence[tuple[int, str]], timeout: float = 20.0) -> None:
    """Processes (process_ids) seen before their parents were stopped that outlive them: a flow
    run's rank launcher or sandbox, in a session of its own, finishing on the SIGTERM its
    parent's death sent (die_with_parent). Wait up to `timeout` s for them, then SIGKILL the rest."""
    def alive(pid: int, start: str) -> bool:
        try:
            stat = _stat(pid)
        except (OSError, IndexError):
            return False
        return stat[21] == start and stat[2] != "Z"

    deadline = time.monotonic() + timeout
    left = list(processes)
    while True:
        left = [p for p in left if alive(*p)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for pid, _ in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class ProcessGroups:
    """Children in their own process groups, stopped in reverse start order (a Prefect worker
    before its server; ranks' launcher before anything it depends on)."""

    def __init__(self) -> None:
        self._procs: list[tuple[subprocess.Popen, Sequence[int], float]] = []

    def add(self, proc: subprocess.Popen, signals: Sequence[int] = (signal.SIGTERM,), timeout: float = 20.0
            ) -> subprocess.Popen:
        self._procs.append((proc, signals, timeout))
        return proc

    def stop(self) -> None:
        while self._procs:
            proc, signals, timeout = self._procs.pop()
            stop_process_group(proc, signals, timeout)


# ---------------------------------------------------------------- training ranks
class PreemptionGuard:
    """See the module docstring. `install()` from the main thread before the loop; the loop
    calls `requested()` once per step (all ranks must agree: reduce it). grace_s=None: no deadline (the launcher's)."""

    def __init__(self, grace_s: float | None):
        self.grace_s = grace_s
        self.signals: list[int] = []
        self._flag = threading.Event()
        self._r = self._w = -1

    def install(self) -> "PreemptionGuard":
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        # Python handlers run only when the main thread returns to the interpreter; the wakeup
        # fd gets the signal number from the C handler at once, which the watcher thread reads.
        signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, frame: None)
        threading.Thread(target=self._watch, name="preemption-guard", daemon=True).start()
        return self

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._r, 64)
            except OSError:
                return
            for signum in data:
                if signum not in STOP_SIGNALS:
                    continue
                self.signals.append(signum)
                if len(self.signals) == 1:
                    self._flag.set()
                    if self.grace_s is not None:
                        t = threading.Timer(self.grace_s, os._exit, args=(128 + signum,))
                        t.daemon = True
                        t.start()
                else:
                    os._exit(128 + self.signals[0])

    def request(self) -> None:
        """Ask for a stop as a signal would (tests, an orchestrator's message)."""
        self._flag.set()

    def requested(self) -> bool:
        return self._flag.is_set()


# ---------------------------------------------------------------- pod grace period
KILL_MARGIN_S = 15.0  # the stage SIGKILLs the ranks' launcher this long past their grace
TEARDOWN_S = 20  # then: the launcher's exit, the run record, the pod


def leave_finished_rank() -> None:
    """End a training or RL rank whose work is on disk without running the interpreter's static
    destructors: gloo / DeepSpeed threads left to them were seen to abort a finished rank
    ("terminate called without an active exception"), failing the whole launch. Call it after
    destroy_process_group, on success only: errors and preemption exits must still raise."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def pod_grace_seconds(cfg) -> int:
    """terminationGracePeriodSeconds for a pipeline config: the largest preempt_grace_s of its
    sections (training stages) plus the launcher's kill margin and TEARDOWN_S, rounded up."""
    import math

    graces = [getattr(getattr(cfg, name), "preempt_grace_s") for name in type(cfg).model_fields
              if hasattr(getattr(cfg, name), "preempt_grace_s")]
    return int(math.ceil(max(graces, default=0.0) + KILL_MARGIN_S + TEARDOWN_S))
