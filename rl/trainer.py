"""The post-training stages' one step loop: resume, step, metrics, checkpoint, preemption.

Every RL-side stage (rl-reasoning, rl-agentic, reward-model, rl-general, distill) is the same
loop around a different step: a stage builds its policy, optimizer and rollout RNG, measures what
it measures before training, and hands `run_steps` a `step(k) -> record` function (generate ->
score -> train for rl-reasoning; poll the rollout workers, then train for rl-agentic; a
Bradley-Terry batch for the reward model). The loop owns what they must all do alike:

    resume     load_latest() restores the newest good checkpoint (model, optimizer, rollout RNG,
               the stage's own text files and its JSON meta) and cuts metrics.jsonl back to its step,
               so a resumed stage gives the same records as an uninterrupted one;
    metrics    one record per step appended to metrics.jsonl, progress reported to the workdir;
    checkpoint every `checkpoint_every` steps and at the last (training.checkpoint.save_torch:
               atomic, verified, the last `keep_last` kept), mirrored to the store;
    preemption SIGTERM/SIGINT (glmforge.shutdown) finish the step in flight, write a checkpoint
               and raise Preempted (the CLI exits 75); a second signal interrupts at once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from glmforge import shutdown
from training import checkpoint, metrics

log = logging.getLogger("glmforge")
STATE = "state.pt"


@dataclass
class Policy:
    """What a checkpoint holds: the trained module, its optimizer, the rollout RNG (None for a
    stage that samples nothing) and the stage's own text files (rl-agentic's sample buffer)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    rng: torch.Generator | None = None
    texts: Callable[[], dict[str, str]] = field(default=lambda: {})


def save(root: Path, step: int, policy: Policy, meta: dict[str, Any], keep_last: int) -> None:
    state = {"model": policy.model.state_dict(), "optimizer": policy.optimizer.state_dict()}
    if policy.rng is not None:
        state["rollout_rng"] = policy.rng.get_state()
    checkpoint.save_torch(root, step, state, meta, keep_last, policy.texts(), name=STATE)


def load_latest(root: Path, policy: Policy, log_path: Path, stage: str) -> tuple[int, dict[str, Any], Path] | None:
    """(step, meta, folder) of the newest good checkpoint, with the model, optimizer and RNG
    restored and metrics.jsonl cut back to that step; None (and no metrics file) for a fresh
    start. The stage reads its own text files from the folder."""
    found = checkpoint.select_resume(root)
    if found is None:
        log_path.unlink(missing_ok=True)
        return None
    tag, meta = found
    state = torch.load(root / tag / STATE, weights_only=True)
    policy.model.load_state_dict(state["model"])
    policy.optimizer.load_state_dict(state["optimizer"])
    if policy.rng is not None:
        policy.rng.set_state(state["rollout_rng"])
    metrics.truncate(log_path, meta["step"])
    log.info("%s: resuming after step %d", stage, meta["step"])
    return meta["step"], meta, root / tag


def run_steps(stage: str, policy: Policy, step: Callable[[int], dict[str, Any]], *, start: int, steps: int,
              root: Path, log_path: Path, workdir: Any, checkpoint_every: int, keep_last: int,
              meta: Callable[[], dict[str, Any]], describe: Callable[[dict[str, Any]], str]) -> None:
    """Steps start+1 .. steps. `meta()` is the JSON saved with each checkpoint; `describe(record)`
    the progress line."""
    with shutdown.deferred() as stop_requested:
        for k in range(start + 1, steps + 1):
            record = step(k)
            metrics.append(log_path, record)
            workdir.progress(k, steps, f"{stage} {describe(record)}")
            stop = stop_requested() and k < steps
            if k % checkpoint_every == 0 or k == steps or stop:
                save(root, k, policy, meta(), keep_last)
                workdir.persist_checkpoint()
            if stop:
                raise shutdown.Preempted(f"{stage} stopped by a signal: checkpoint at step {k} of {steps} written")
