"""Publishing a policy version in buckets, and loading one only whole and verified.

The trainer's ranks each write their part of version v, in buckets of at most `bucket_bytes`
(safetensors files, a tensor larger than a bucket alone in its own), without gathering the model
on any rank:

    v00000012/rank00001-0003.safetensors     bucket 3 of rank 1
    v00000012/rank00001.json                 rank 1's manifest: version, world, model config,
                                             every bucket's file, bytes, sha256 and tensors

Who writes what: replicated parameters are dealt out over the ranks by size (`assign`), so each
rank writes about 1/world of them; an expert-parallel shard is written by the first rank of its
expert-data-parallel group, with its place (shard k of R along dim 0) in the manifest. Each file
is written to a temporary name and renamed; a rank's manifest is renamed into place after all its
buckets. A version is complete when every rank's manifest is there.

A rollout worker loads a version with `load_version`: it refuses a version that is not complete,
checks each bucket's sha256 and the tensor names before reading it, joins expert shards, and
checks the result covers the model's state exactly; only then does the engine take the weights
(one load_state_dict), so it never samples from a half-loaded version. On a GPU cluster the same
protocol carries over with NCCL as the transport: the manifests stay, the buckets are broadcast
from the trainer ranks into the engines' buffers (vLLM's and SGLang's update-weights-from-
distributed endpoints) instead of written and read.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file, save_file

from glmforge.store.manifest import sha256_file

DEFAULT_BUCKET_BYTES = 256 << 20
KEEP_VERSIONS = 2


class IncompleteVersion(RuntimeError):
    """A version whose ranks have not all published (or that is gone)."""


class CorruptBucket(RuntimeError):
    """A bucket whose bytes or tensors differ from its manifest."""


@dataclass(frozen=True)
class Shard:
    """An expert-parallel parameter: this rank holds part `index` of `count` along dim 0."""

    index: int
    count: int


@dataclass(frozen=True)
class Published:
    version: int
    bytes: int
    buckets: int
    seconds: float


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def assign(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Replicated tensors dealt out over `world` ranks, largest first to the least-loaded rank:
    every rank computes the same assignment from the same names and sizes."""
    load = [0] * world
    out: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[name] = r
        load[r] += sizes[name]
    return out


def publish(root: Path, version: int, tensors: Mapping[str, torch.Tensor], *, rank: int = 0, world: int = 1,
            config_json: str = "", shards: Mapping[str, Shard] | None = None,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Published:
    """Write this rank's part of `version`: `tensors` are what this rank publishes (a replicated
    share from `assign`, plus its expert shards named in `shards`)."""
    t0 = time.perf_counter()
    out = version_dir(root, version)
    out.mkdir(parents=True, exist_ok=True)
    buckets: list[dict] = []
    current: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal current, size
        if not current:
            return
        path = out / f"rank{rank:05d}-{len(buckets):04d}.safetensors"
        tmp = path.with_name(path.name + ".tmp")
        save_file(current, str(tmp))
        os.replace(tmp, path)
        buckets.append({"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path),
                        "tensors": sorted(current)})
        current, size = {}, 0

    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        if current and size + n > bucket_bytes:
            flush()
        current[name] = t
        size += n
    flush()
    manifest = {"version": version, "rank": rank, "world": world, "config": config_json, "buckets": buckets,
                "shards": {k: [s.index, s.count] for k, s in (shards or {}).items()}}
    path = out / f"rank{rank:05d}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path)
    return Published(version, sum(b["bytes"] for b in buckets), len(buckets), time.perf_counter() - t0)


def complete(root: Path, version: int) -> bool:
    d = version_dir(root, version)
    first = d / "rank00000.json"
    if not first.is_file():
        return False
    world = json.loads(first.read_text())["world"]
    return all((d / f"rank{r:05d}.json").is_file() for r in range(world))


def load_version(root: Path, version: int) -> tuple[str, dict[str, torch.Tensor], int]:
    """(model config JSON, the whole state dict, bytes read) of a complete version, every bucket
    verified; IncompleteVersion / CorruptBucket otherwise (nothing is applied)."""
    d = version_dir(root, version)
    if not complete(root, version):
        raise IncompleteVersion(f"policy version {version} is not complete in {d}: a rank's manifest is missing")
    manifests = [json.loads(p.read_text()) for p in sorted(d.glob("rank*.json"))]
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    counts: dict[str, int] = {}
    moved = 0
    for m in manifests:
        if m["version"] != version:
            raise CorruptBucket(f"{d}/rank{m['rank']:05d}.json says version {m['version']}, expected {version}")
        for b in m["buckets"]:
            path = d / b["file"]
            if not path.is_file() or sha256_file(path) != b["sha256"]:
                raise CorruptBucket(f"{path}: missing, or its sha256 differs from rank {m['rank']}'s manifest")
            tensors = load_file(str(path))
            if sorted(tensors) != b["tensors"]:
                raise CorruptBucket(f"{path} holds {sorted(tensors)[:4]}..., its manifest lists {b['tensors'][:4]}...")
            moved += b["bytes"]
            for name, t in tensors.items():
                if name in m["shards"]:
                    index, count = m["shards"][name]
                    parts.setdefault(name, {})[index] = t
                    counts[name] = count
                elif name in state:
                    raise CorruptBucket(f"{name} is published twice (again by rank {m['rank']})")
                else:
                    state[name] = t
    for name, got in parts.items():
        if sorted(got) != list(range(counts[name])):
            raise IncompleteVersion(f"{name}: expert shards {sorted(got)} of {counts[name]} published")
        state[name] = torch.cat([got[i] for i in range(counts[name])])
    return manifests[0]["config"], state, moved


def apply(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """The loaded version into `model` in one step; refuses a state that does not cover the model
    exactly (a version of another shape, or a rank's part lost)."""
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise IncompleteVersion(f"the version does not match the model: missing {missing[:4]}, unexpected {extra[:4]}")
    model.load_state_dict(state, strict=True)


def prune(root: Path, keep: int = KEEP_VERSIONS) -> None:
    """Delete all but the newest `keep` complete versions (and older incomplete ones)."""
    dirs = sorted(p for p in Path(root).glob("v*") if p.is_dir())
    done = [p for p in dirs if complete(root, int(p.name[1:]))]
    newest = done[-keep:]
    for p in dirs:
        if p not in newest and (not newest or p.name < newest[0].name):
            shutil.rmtree(p, ignore_errors=True)


def rank_part(module: torch.nn.Module, rank: int, world: int,
              expert_shards: Mapping[str, Shard] | None = None, edp_rank: int = 0) -> dict[str, torch.Tensor]:
    """What rank `rank` publishes of `module`: its share of the replicated tensors (`assign`)
    and, on the first rank of its expert-data-parallel group, its expert shards."""
    state = module.state_dict()
    shards = expert_shards or {}
    replicated = {k: v.numel() * v.element_size() for k, v in state.items() if k not in shards}
    owner = assign(replicated, world)
    part = {k: v for k, v in state.items() if k not in shards and owner[k] == rank}
    if edp_rank == 0:
        part.update({k: state[k] for k in shards})
    return part
