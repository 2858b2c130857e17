"""Starting the ranks, and the entry point each rank runs.

Parent side (the stage's process): `run_ranks(spec, launch_cfg, spec_path, on_line)` writes the
spec, starts the ranks of `python -m training.launch SPEC` (one node: training.spawn; several:
torchrun on each node, or the DeepSpeed launcher; one rank on one node alone), streams the ranks' output line by line into logging (logger
"glmforge") and to `on_line`, and turns a failure into `TrainingFailed` naming the rank, its exit
code and the last output lines, so the caller's retry policy retries and the retry resumes from
the checkpoint. A stop signal to the stage (SIGTERM/SIGINT, see runtime.shutdown) is passed to
the ranks, which finish the step, checkpoint and exit; `run_ranks` then raises `Preempted`.

Rank side: `python -m training.launch SPEC` reads the spec and runs training.loop.train.

Only rank 0 prints progress; every rank's traceback still reaches the stream through stderr.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Callable

from runtime import shutdown
from training.config import LaunchConfig
from training.rank_spec import RankSpec
from training.spawn import MARK as SPAWN_MARK, rank_env

log = logging.getLogger("glmforge")
REPO = Path(__file__).resolve().parent.parent
TAIL_LINES = 200   # kept from the stream
QUOTE_LINES = 25   # quoted in the error


class TrainingFailed(RuntimeError):
    """A rank (or the launcher) exited non-zero; the message names it and quotes the output."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(cfg: LaunchConfig, spec_path: Path, port: int, module: str = "training.launch") -> list[str]:
    """The launcher command line for this config (same config on a laptop and a cluster): every
    rank runs `python -m MODULE SPEC` (training.launch; rl.launch for the RL stages). torchrun's
    agent costs ~3 s and a core's 3.5 s per launch before the first rank starts and supervises
    nothing one node needs, so on one node `launcher: torchrun` means torchrun's environment
    without its agent: one rank is started as itself (run_ranks sets the variables), more by
    training.spawn. Several nodes run torchrun on each (node_commands)."""
    if single_rank(cfg):
        return [sys.executable, "-m", module, str(spec_path)]
    if cfg.launcher == "torchrun" and cfg.nnodes == 1:
        return [sys.executable, "-m", "training.spawn", f"--nproc_per_node={cfg.nproc_per_node}",
                f"--master_addr={cfg.master_addr or '127.0.0.1'}", f"--master_port={port}",
                "-m", module, str(spec_path)]
    if cfg.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run",
                f"--nproc_per_node={cfg.nproc_per_node}", f"--nnodes={cfg.nnodes}",
                f"--node_rank={cfg.node_rank}", f"--master_addr={cfg.master_addr or '127.0.0.1'}",
                f"--master_port={port}", "--max_restarts=0",
                "-m", module, str(spec_path)]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", f"--master_port={port}",
           f"--num_gpus={cfg.nproc_per_node}"]
    if cfg.master_addr:
        cmd.append(f"--master_addr={cfg.master_addr}")
    if cfg.hostfile:
        cmd += [f"--hostfile={cfg.hostfile}", f"--num_nodes={cfg.nnodes}"]
    return cmd + ["--module", module, str(spec_path)]


def single_rank(cfg: LaunchConfig) -> bool:
    return cfg.launcher == "torchrun" and cfg.world_size == 1


def node_commands(cfg: LaunchConfig, spec_path: Path) -> list[list[str]]:
    """Multi-node torchrun: the launcher command of every node (node_rank 0..nnodes-1), all
    pointing at the same master address and port. Each node runs its own line (a Kubernetes
    Indexed Job puts JOB_COMPLETION_INDEX there; by hand, ssh/pdsh); the DeepSpeed launcher instead
    reads a hostfile (`hostfile_text`) and starts them itself over pdsh/ssh from node 0."""
    if cfg.launcher != "torchrun":
        raise ValueError("node_commands is for launcher: torchrun; the DeepSpeed launcher starts every node "
                         "from node 0 with the hostfile")
    if cfg.master_port is None:
        raise ValueError("multi-node launch needs launch.master_port (every node must use the same one)")
    return [command(cfg.model_copy(update={"node_rank": n}), spec_path, cfg.master_port) for n in range(cfg.nnodes)]


def hostfile_text(hosts: list[str], cfg: LaunchConfig) -> str:
    """The DeepSpeed launcher's hostfile for `hosts` (one per node, node 0 first): 'HOST slots=N'."""
    if len(hosts) != cfg.nnodes:
        raise ValueError(f"{len(hosts)} host(s) given for launch.nnodes={cfg.nnodes}")
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"hosts repeat in {hosts}: the DeepSpeed launcher needs one line per node")
    return "".join(f"{h} slots={cfg.nproc_per_node}\n" for h in hosts)


def _failure(rc: int, tail: deque, single: bool = False) -> str:
    """What failed, from the launcher's error summary (torchrun's and training.spawn's "Root Cause
    ... rank : 1 (local_rank: 1)", "exitcode : -9"), and the ranks' last lines before the
    launcher's own report."""
    lines = list(tail)
    text = "\n".join(lines)
    cause = text[text.find("Root Cause"):] if "Root Cause" in text else text
    ranks = re.findall(r"rank\s*:\s*(\d+)\s*\(local_rank", cause)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", cause)
    agent = next((i for i, ln in enumerate(lines) if "torch/distributed/elastic" in ln or
                  "torch.distributed.elastic" in ln or "sigkill_handler" in ln or
                  ln.startswith(SPAWN_MARK)), len(lines))
    quoted = lines[max(0, agent - QUOTE_LINES):agent] or lines[-QUOTE_LINES:]
    # the DeepSpeed launcher: "[... '--local_rank=1', ...] exits with return code = -9"
    ds = re.findall(r"--local_rank=(\d+)'.*exits with return code = (-?\d+)", text)

    def how(code: int) -> str:
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    if ranks:
        who = f"rank {ranks[0]} failed ({how(int(codes[0]) if codes else rc)})"
    elif ds:
        who = f"local rank {ds[0][0]} failed ({how(int(ds[0][1]))})"
    elif single:        # the rank was the launched process: its own status
        who = f"rank 0 failed ({how(rc)})"
    elif rc < 0:
        who = f"the launcher was killed by signal {-rc}"
    else:
        who = f"the launcher exited with code {rc}"
    return f"training failed: {who}; last output:\n" + "\n".join(quoted)


def run_ranks(spec: RankSpec, cfg: LaunchConfig, spec_path: Path,
              on_line: Callable[[str], None] = lambda line: None, module: str = "training.launch") -> None:
    """`spec`: a RankSpec, or any spec with write() and preempt_grace_s that `module` reads."""
    spec.write(spec_path)
    port = cfg.master_port or free_port()
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    import torch

    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
        # torchrun and training.spawn give each rank 1 thread, the DeepSpeed launcher nothing: share the cores
        # out so ranks do not oversubscribe them (a 5-20x slowdown on a small machine).
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc_per_node)))
    if single_rank(cfg):
        env = rank_env(0, 1, cfg.master_addr or "127.0.0.1", port, env)    # the rank is the launched process
    cmd = command(cfg, spec_path, port, module)
    log.info("launching %d rank(s): %s", cfg.world_size, " ".join(cmd))
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    grace = spec.train.preempt_grace_s if isinstance(spec, RankSpec) else spec.preempt_grace_s
    # Its own session: a terminal's Ctrl-C or a group kill reaches the ranks only through
    # forward() (once, as SIGTERM), never also through the launcher (whose own SIGTERM handling
    # would be their second signal). If only the stage's process dies (kill -9 of a worker),
    # the launcher gets SIGTERM (PDEATHSIG) and stops its ranks, so a retry never finds the old
    # ranks still writing checkpoints.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(REPO), bufsize=1, preexec_fn=shutdown.die_with_parent, start_new_session=True)
    forwarded: list[int] = []
    last_resort: list[threading.Timer] = []

    def forward(signum: int) -> None:
        """Stop signal to the stage: pass it to the ranks themselves (they finish the step and
        checkpoint, or exit at once on the second); SIGKILL the group if they overrun."""
        forwarded.append(signum)
        for pid in rank_pids(proc.pid, module):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if not last_resort:
            t = threading.Timer(grace + shutdown.KILL_MARGIN_S, _kill_group, args=(proc,))
            t.daemon = True
            t.start()
            last_resort.append(t)

    try:
        with shutdown.deferred(), shutdown.on_stop(forward):
            assert proc.stdout is not None
            for raw in proc.stdout:  # keeps streaming after a stop: the checkpoint line persists it
                line = raw.rstrip("\n")
                tail.append(line)
                on_line(line)
            rc = proc.wait()
    except BaseException:
        # A second signal, a cancelled task, an error in on_line: do not leave ranks running.
        shutdown.stop_process_group(proc, (signal.SIGTERM,), timeout=30)
        raise
    finally:
        for t in last_resort:
            t.cancel()
    preempted = f"exitcode : {shutdown.EXIT_PREEMPTED}" in "\n".join(tail) or rc == shutdown.EXIT_PREEMPTED
    if forwarded or preempted:
        done = [ln for ln in tail if ln.startswith("preempted: checkpoint")]
        raise shutdown.Preempted(
            f"training stopped by {signal.Signals(forwarded[0]).name if forwarded else 'a signal to the ranks'}: "
            + (done[-1][len("preempted: "):] if done else
               f"no new checkpoint (launcher exit status {rc}); the previous one stands")
        )
    if rc != 0:
        raise TrainingFailed(_failure(rc, tail, single_rank(cfg)))


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def rank_pids(launcher_pid: int, module: str = "training.launch") -> list[int]:
    """The rank processes under a launcher (training.spawn's or torchrun's workers, the DeepSpeed
    launcher's children): `-m MODULE` processes that are not a launcher themselves."""
    found = []
    for pid in [launcher_pid, *shutdown.descendants(launcher_pid)]:    # a single rank is its own launcher
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if module.encode() in argv and not any(a.startswith((b"training.spawn", b"torch.distributed", b"deepspeed.launcher"))
                                                   for a in argv):
            found.append(pid)
    return found


def main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m training.launch")
    p.add_argument("spec", type=Path, help="the JSON spec the stage wrote")
    # The DeepSpeed launcher appends --local_rank; LOCAL_RANK in the environment says the same.
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch.distributed as dist

    from training.loop import train

    spec = RankSpec.read(args.spec)
    guard = shutdown.PreemptionGuard(spec.train.preempt_grace_s).install()
    try:
        train(spec, guard)
    finally:
        # Tear the process group down before interpreter exit: left to static destructors, gloo's
        # threads can abort a rank ("terminate called without an active exception") after a
        # run that finished.
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    shutdown.leave_finished_rank()   # seen aborting in teardown on ZeRO-2 + EP


if __name__ == "__main__":
    import warnings

    # torch 2.13 warns on every ZeRO collective; the stream should carry training output.
    warnings.filterwarnings("ignore", category=FutureWarning)
    main(sys.argv[1:])
