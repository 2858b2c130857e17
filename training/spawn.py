"""One node's ranks without torchrun's agent:

    python -m training.spawn --nproc_per_node N --master_addr A --master_port P -m MODULE ARG...

starts N processes of `python -m MODULE ARG...` with the variables torchrun gives its workers
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...; rank 0's env:// init serves the store),
waits for them and reports the first failure. training.launch.run_ranks uses it for
`launcher: torchrun` on one node; several nodes still run torchrun on each.

Why: torchrun's elastic agent imports torch and runs a rendezvous before the first rank starts,
~3 s of wall time and ~3.5 s of a core per launch on a 2-core machine (measured against starting
the same ranks directly), and on one node with no restarts it supervises nothing this does not.
Standard library only, so it starts in milliseconds.

The contract run_ranks relies on, as with torchrun: the ranks inherit this process's output; a
rank's failure stops the others (SIGTERM, then SIGKILL after KILL_AFTER_S) and prints one
"Root Cause" line naming the first failed rank and its exit status; a stop signal to this process
reaches every rank once per signal (the ranks checkpoint and exit with EXIT_PREEMPTED); the exit
status is 0, EXIT_PREEMPTED when the ranks stopped at a checkpoint (or died of the stop passed
on before they could), else 1. A rank also gets
SIGTERM if this process dies, so no rank outlives its launcher.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from runtime.shutdown import EXIT_PREEMPTED, die_with_parent

KILL_AFTER_S = 30   # torchrun's wait between SIGTERM and SIGKILL of the surviving ranks
MARK = "training.spawn:"   # starts every line this process prints (training.launch._failure reads them)


def rank_env(rank: int, nproc: int, addr: str, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (this process's environment by default) with the variables torchrun sets for a worker
    of a single-node job."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
               MASTER_ADDR=addr, MASTER_PORT=str(port))
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")     # as torchrun: one thread per rank unless told
    return env


def run(nproc: int, addr: str, port: int, argv: list[str]) -> int:
    live: dict[int, int] = {}          # pid -> rank
    stops: list[int] = []

    def terminate_all(sig: int = signal.SIGTERM) -> None:
        for pid in list(live):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def on_stop(signum, frame) -> None:   # the stage's stop, or its death (PDEATHSIG): once per signal
        stops.append(signum)
        terminate_all()

    def on_alarm(signum, frame) -> None:
        terminate_all(signal.SIGKILL)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGALRM, on_alarm)
    for rank in range(nproc):
        if stops:                      # stopped while starting: the started ranks have their signal
            break
        proc = subprocess.Popen([sys.executable, "-m", *argv], env=rank_env(rank, nproc, addr, port),
                                preexec_fn=die_with_parent)
        live[proc.pid] = rank
    first: tuple[int, int] | None = None      # (rank, exit status) of the first rank to fail
    while live:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        rank = live.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code == 0 or first is not None:
            continue
        first = (rank, code)
        if code != EXIT_PREEMPTED and live:   # a preempted rank's peers are checkpointing too: leave them
            terminate_all()
            signal.alarm(KILL_AFTER_S)
    signal.alarm(0)
    if first is None:
        return 0
    rank, code = first
    # A rank that the stop reached before it set its handler (still importing torch) dies of the
    # SIGTERM passed on: it wrote nothing, the last checkpoint stands, so that is a stop too.
    if code == EXIT_PREEMPTED or (stops and code == -signal.SIGTERM):
        return EXIT_PREEMPTED
    print(f"{MARK} Root Cause (first observed failure): rank : {rank} (local_rank: {rank}), exitcode : {code}",
          flush=True)
    return 1


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m training.spawn")
    p.add_argument("--nproc_per_node", type=int, required=True)
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, required=True)
    p.add_argument("-m", dest="module", required=True, help="the module every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.nproc_per_node < 1:
        p.error("--nproc_per_node must be >= 1")
    return run(a.nproc_per_node, a.master_addr, a.master_port, [a.module, *a.args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
