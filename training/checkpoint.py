"""Checkpoints in the stage's checkpoint directory: DeepSpeed state + JSON meta + a marker.

Layout (root = workdir.checkpoint):
    step_00000040/            engine.save_checkpoint(root, tag): model, per-rank optimizer shards
        expert_shard_000.pt   expert_parallel > 1 only: each shard's experts and their optimizer
                              state (training.expert_parallel)
        meta.json             step, tokens seen, data-loader state, RNG states of every rank, config
        COMPLETE              written last: {"step": 40, "files": {relative path: sha256}}
    latest                    the tag of the newest complete checkpoint, replaced atomically
                              (tmp file + rename) only after COMPLETE exists

A checkpoint counts only with its COMPLETE marker and matching digests. A crash while saving
leaves a directory without the marker (or newer than `latest`); a damaged file changes a digest.
`select_resume` walks from the newest checkpoint down, warns about and removes every broken one,
and returns the newest good one, so a retried task never starts from a partial checkpoint.
"""
from __future__ import annotations

import base64
import contextlib
import errno
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from runtime.store.manifest import sha256_file
from training import metrics

log = logging.getLogger("glmforge")

LATEST, MARKER, META = "latest", "COMPLETE", "meta.json"
_TAG = re.compile(r"^step_(\d{8})$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int:
    m = _TAG.match(tag)
    assert m, f"not a checkpoint tag: {tag}"
    return int(m.group(1))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class CheckpointSpaceError(OSError):
    """A checkpoint did not fit on its disk. The partial one is removed; the previous one stays."""


_NEARLY_FULL = 4 * 2**20  # bytes


def _is_full(e: BaseException, root: Path) -> bool:
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    # torch.save to a path reports a full disk as an opaque RuntimeError from its zip writer
    # ("unexpected pos ..."): judge by the disk, which the partial file has just filled.
    if isinstance(e, RuntimeError):
        try:
            return shutil.disk_usage(root).free < _NEARLY_FULL
        except OSError:
            return False
    return False


@contextlib.contextmanager
def saving(root: Path, tag: str) -> Iterator[None]:
    """Wrap every write of checkpoint `tag` (torch.save, engine.save_checkpoint, finalize): a full
    disk becomes a CheckpointSpaceError naming the folder and the free space, the partial
    `tag` directory is deleted (it holds no COMPLETE marker, and deleting frees the space), and
    `latest` and the older checkpoints are untouched, so select_resume returns the previous one."""
    try:
        yield
    except BaseException as e:
        if not _is_full(e, Path(root)):
            raise
        d = Path(root) / tag
        shutil.rmtree(d, ignore_errors=True)
        for tmp in Path(root).glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        try:
            free = f"{shutil.disk_usage(root).free / 2**20:.1f} MiB free"
        except OSError:
            free = "free space unknown"
        prev = (Path(root) / LATEST).read_text().strip() if (Path(root) / LATEST).exists() else None
        raise CheckpointSpaceError(
            errno.ENOSPC,
            f"no space left on device writing checkpoint {tag} in {Path(root).resolve()} ({free}); "
            f"the partial checkpoint was removed, "
            + (f"the previous one ({prev}) is kept and a resume starts from it" if prev else "no earlier checkpoint exists")
            + "; free space there or lower keep_last",
        ) from e


def save_torch(root: Path, step: int, state: dict[str, Any], meta: dict[str, Any], keep_last: int,
               texts: dict[str, str] | None = None, name: str = "state.pt") -> None:
    """Checkpoint `step` of a one-process stage (the RL stages, the reward model): `state`
    torch.save'd as `name`, plus `texts` as text files. The leftover of a save a crash interrupted
    is replaced; a full disk is a clear error with the previous checkpoint kept (saving); then
    digests and meta with the step (finalize)."""
    tag = tag_for(step)
    shutil.rmtree(root / tag, ignore_errors=True)
    (root / tag).mkdir(parents=True)
    with saving(root, tag):
        torch.save(state, root / tag / name)
        for file, text in (texts or {}).items():
            (root / tag / file).write_text(text)
    finalize(root, tag, {"step": step, **meta}, keep_last)


def tags(root: Path) -> list[str]:
    """Checkpoint directories under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and _TAG.match(p.name))


def finalize(root: Path, tag: str, meta: dict[str, Any], keep_last: int) -> None:
    """Rank 0, after every rank's engine.save_checkpoint returned: meta, digests and marker,
    then the `latest` pointer, then pruning to keep_last complete checkpoints."""
    d = Path(root) / tag
    with saving(root, tag):
        _atomic_write(d / META, json.dumps(meta, indent=1))
        files = {p.relative_to(d).as_posix(): sha256_file(p) for p in sorted(d.rglob("*"))
                 if p.is_file() and p.name != MARKER}
        _atomic_write(d / MARKER, json.dumps({"step": meta["step"], "files": files}, indent=1))
        _atomic_write(Path(root) / LATEST, tag)
    complete = [t for t in tags(root) if (Path(root) / t / MARKER).exists()]
    for old in complete[:-keep_last]:
        shutil.rmtree(Path(root) / old, ignore_errors=True)


def verify(root: Path, tag: str) -> str | None:
    """None when the checkpoint is complete and intact, else what is wrong with it."""
    d = Path(root) / tag
    if not (d / MARKER).exists():
        return "no COMPLETE marker (partial: the save was interrupted)"
    try:
        listed = json.loads((d / MARKER).read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable COMPLETE marker ({e})"
    on_disk = {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() and p.name != MARKER}
    if set(listed) != on_disk:
        return f"files differ from the marker (missing {sorted(set(listed) - on_disk)}, extra {sorted(on_disk - set(listed))})"
    for rel, digest in listed.items():
        if sha256_file(d / rel) != digest:
            return f"digest mismatch in {rel}"
    return None


def select_resume(root: Path) -> tuple[str, dict[str, Any]] | None:
    """The newest intact checkpoint (tag, meta), or None to start fresh. Broken checkpoints
    newer than it are logged as warnings and removed; `latest` is rewritten to the choice."""
    root = Path(root)
    for tag in reversed(tags(root)):
        problem = verify(root, tag)
        if problem is None:
            if (root / LATEST).exists() and (root / LATEST).read_text().strip() != tag:
                _atomic_write(root / LATEST, tag)
            return tag, json.loads((root / tag / META).read_text())
        log.warning("checkpoint %s in %s is unusable: %s; removing it and falling back to the previous one",
                    tag, root, problem)
        shutil.rmtree(root / tag, ignore_errors=True)
    if (root / LATEST).exists():
        (root / LATEST).unlink()
    return None


def branch(src: Path, dst: Path, tag: str) -> None:
    """Start run `dst` from run `src`'s complete checkpoint `tag`: the checkpoint and the metrics
    of its steps are copied into `dst` (empty), which then resumes from it as from its own. Two
    runs that share their first steps (same seed, data, schedule) train them once (sft)."""
    src, dst = Path(src), Path(dst)
    problem = verify(src, tag)
    if problem is not None:
        raise ValueError(f"cannot branch from checkpoint {tag} in {src}: {problem}")
    step = json.loads((src / tag / META).read_text())["step"]
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / f".branch-{tag}"            # not a tag name: a copy cut short is never resumed from
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src / tag, tmp)
    records = dst / "metrics.jsonl"
    if (src / "metrics.jsonl").exists():
        shutil.copy(src / "metrics.jsonl", records)
        metrics.truncate(records, step)         # the steps the checkpoint contains
    else:
        records.unlink(missing_ok=True)
    os.replace(tmp, dst / tag)
    _atomic_write(dst / LATEST, tag)


# ---------------------------------------------------------------- RNG states (JSON-safe)
def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


# ---------------------------------------------------------------- resuming on another rank count
def reshard(meta: dict[str, Any], train: dict[str, Any], world: int) -> tuple[dict[str, Any], list[Any]]:
    """A checkpoint written by meta["world_size"] ranks, resumed by `world` ranks: the data-loader
    state and the per-rank RNG states for the new layout, or a ValueError saying why it cannot be.

    The model and optimizer move by themselves: at ZeRO 0 every rank holds the whole state (rank 0
    wrote it); at ZeRO 1/2 the ranks' partitions are converted to DeepSpeed's universal checkpoint (one
    folder per parameter: fp32, exp_avg, exp_avg_sq; `to_universal`) and loaded with
    `checkpoint.load_universal`, which cuts them for the new data-parallel size.
    Expert parallelism (training.expert_parallel) keeps one file per expert shard: such a
    checkpoint resumes with the same expert_parallel, ZeRO stage and rank count only.
    What remains is the data order. The loader deals the epoch's permutation round-robin, so
    after `index` sequences per rank on W ranks exactly the first index*W positions are consumed
    and each step takes the next micro*accum*W: the same global batches come next on W' ranks if
    the global batch (micro_batch_size x grad_accum x ranks) is unchanged. RNG: rank r continues
    old rank r's stream (r mod the old count) -- the training step draws no random numbers, so
    this only has to be valid, not equal."""
    old = int(meta["world_size"])
    saved = meta["train"]
    ep_then, ep_now = int(saved.get("expert_parallel", 1)), int(train.get("expert_parallel", 1))
    if ep_then != ep_now:
        raise ValueError(f"checkpoint step {meta['step']} was written with expert_parallel {ep_then}, this run has "
                         f"{ep_now}: its experts are stored as {ep_then} shard(s); resume with expert_parallel {ep_then}")
    if ep_then > 1 and old != world:
        raise ValueError(f"checkpoint step {meta['step']} (expert_parallel {ep_then}) was written by {old} ranks: an "
                         f"expert-parallel checkpoint resumes only on the same number of ranks, not {world}")
    zero_then, zero_now = int(saved.get("zero_stage", 0)), int(train.get("zero_stage", 0))
    if ep_then > 1 and zero_then != zero_now:
        where = "its expert-shard files" if zero_then == 0 else "the ranks' ZeRO partition files"
        raise ValueError(f"checkpoint step {meta['step']} (expert_parallel {ep_then}) is ZeRO {zero_then}, this run "
                         f"zero_stage {zero_now}: an expert-parallel checkpoint keeps its experts' optimizer state in "
                         f"{where}; resume with zero_stage {zero_then}")
    if old == world:
        return meta["loader"], meta["rng"]
    if saved.get("zero_stage", 0) > 0 and saved.get("optimizer") == "deepspeed_muon":
        raise ValueError(f"checkpoint step {meta['step']} (optimizer deepspeed_muon, ZeRO {saved['zero_stage']}) "
                         f"was written by {old} ranks: DeepSpeed's universal conversion carries Adam's state "
                         "(exp_avg, exp_avg_sq), not Muon's momentum_buffer; resume it on the same number of ranks")
    if int(train.get("zero_stage", 0)) != int(saved.get("zero_stage", 0)):
        raise ValueError(f"checkpoint step {meta['step']} is ZeRO {saved.get('zero_stage', 0)}, this run "
                         f"zero_stage {train.get('zero_stage', 0)}: change rank count or ZeRO stage, not both")
    before = saved["micro_batch_size"] * saved["grad_accum"] * old
    now = train["micro_batch_size"] * train["grad_accum"] * world
    if before != now:
        raise ValueError(
            f"checkpoint step {meta['step']}: global batch was {saved['micro_batch_size']} (micro_batch_size) x "
            f"{saved['grad_accum']} (grad_accum) x {old} ranks = {before} sequences, this run has "
            f"{train['micro_batch_size']} x {train['grad_accum']} x {world} = {now}; keep it equal "
            f"(e.g. grad_accum {before // (train['micro_batch_size'] * world)}) to resume on {world} ranks")
    loader = dict(meta["loader"])
    consumed = int(loader["index"]) * old
    if consumed % world:
        raise ValueError(f"checkpoint step {meta['step']}: {consumed} sequences of epoch {loader['epoch']} consumed, "
                         f"not divisible by {world} ranks")
    loader.update(index=consumed // world, world=world)
    rngs = [meta["rng"][r % old] for r in range(world)]
    return loader, rngs


UNIVERSAL = "universal"   # ckpt_dir/universal/<tag>: a checkpoint converted for another rank count


def to_universal(root: Path, tag: str) -> Path:
    """Convert checkpoint `tag` (ZeRO 1/2, per-rank optimizer partitions) to DeepSpeed's universal
    format under root/universal/<tag> with DeepSpeed's own converter (ds_to_universal, run as a
    process: it forks worker pools). Replaces an earlier conversion; returns the folder."""
    import subprocess
    import sys

    out = Path(root) / UNIVERSAL / tag
    shutil.rmtree(out, ignore_errors=True)
    # the converter also writes temp files next to the output
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(Path(root) / tag),
           "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ds_to_universal failed on {Path(root) / tag} (exit {done.returncode}):\n"
                           + "\n".join((done.stdout + done.stderr).splitlines()[-20:]))
    log.info("converted %s to a universal checkpoint in %s", tag, out)
    return out
