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
(one load_state_dict), so it never samples from a half-loaded version.

Deltas. A rank that still holds what it published last (`base`) may publish only what changed:
each tensor's bytes XOR its previous bytes (zero wherever a weight did not move, and mostly
zero high bytes where it moved a little), zstd-compressed, in buckets of their own
(`rank00001-0003.xor.zst`). The manifest names the base version; a reader applies the delta on
the base it holds, or rebuilds the base from its chain (back to a full version). Every published
piece (a tensor, or one rank's expert shard) carries a checksum of its bytes after the delta is
applied: a reader that ends with other bytes refuses the version, and a server can prove what it
holds (`checksums`, compared with `expected_checksums`) after a sync. On a GPU cluster the same
protocol carries over with NCCL as the transport: the manifests stay, the buckets are broadcast
from the trainer ranks into the engines' buffers (vLLM's and SGLang's update-weights-from-
distributed endpoints) instead of written and read.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch
import zstandard
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from runtime.store.manifest import sha256_file

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
    bytes: int              # written (compressed, for a delta)
    buckets: int
    seconds: float
    full_bytes: int = 0     # the same tensors published whole
    base: Optional[int] = None   # the version a delta applies to (None: published whole)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (any dtype, bf16 included)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def checksum(t: torch.Tensor) -> str:
    return hashlib.blake2b(_raw(t).numpy().tobytes(), digest_size=16).hexdigest()


def piece_id(name: str, shard: Optional[tuple[int, int]]) -> str:
    """A published piece's name: the tensor's, or `name[k/R]` for shard k of R."""
    return name if shard is None else f"{name}[{shard[0]}/{shard[1]}]"


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
            bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            base: Optional[tuple[int, Mapping[str, torch.Tensor]]] = None) -> Published:
    """Write this rank's part of `version`: `tensors` are what this rank publishes (a replicated
    share from `assign`, plus its expert shards named in `shards`). base=(version, tensors): what
    this rank published as that version, the same names and shapes: write a delta on it."""
    t0 = time.perf_counter()
    out = version_dir(root, version)
    out.mkdir(parents=True, exist_ok=True)
    if base is not None:
        if base[0] >= version:
            raise ValueError(f"rank {rank}: version {version} cannot be a delta on version {base[0]} (not earlier)")
        _check_base(tensors, base[1], rank)
    buckets: list[dict] = []
    current: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal current, size
        if not current:
            return
        if base is None:
            path = out / f"rank{rank:05d}-{len(buckets):04d}.safetensors"
            tmp = path.with_name(path.name + ".tmp")
            save_file(current, str(tmp))
            entry: dict = {}
        else:
            path = out / f"rank{rank:05d}-{len(buckets):04d}.xor.zst"
            tmp = path.with_name(path.name + ".tmp")
            names = sorted(current)
            xor = torch.cat([torch.bitwise_xor(_raw(current[n]), _raw(base[1][n])) for n in names])
            tmp.write_bytes(zstandard.ZstdCompressor(level=3).compress(xor.numpy().tobytes()))
            entry = {"lengths": [_raw(current[n]).numel() for n in names]}
        os.replace(tmp, path)
        buckets.append({"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path),
                        "tensors": sorted(current), **entry})
        current, size = {}, 0

    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        if current and size + n > bucket_bytes:
            flush()
        current[name] = t
        size += n
    flush()
    shard_of = {k: [s.index, s.count] for k, s in (shards or {}).items()}
    manifest = {"version": version, "rank": rank, "world": world, "config": config_json, "buckets": buckets,
                "shards": shard_of, "base": None if base is None else base[0],
                "checksums": {piece_id(n, shard_of.get(n)): checksum(t) for n, t in tensors.items()}}
    path = out / f"rank{rank:05d}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path)
    full = sum(t.numel() * t.element_size() for t in tensors.values())
    return Published(version, sum(b["bytes"] for b in buckets), len(buckets), time.perf_counter() - t0, full,
                     None if base is None else base[0])


def _check_base(tensors: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], rank: int) -> None:
    if set(tensors) != set(base):
        raise ValueError(f"rank {rank}: a delta needs the tensors of its base; differ in "
                         f"{sorted(set(tensors) ^ set(base))[:4]}")
    for n, t in tensors.items():
        if t.shape != base[n].shape or t.dtype != base[n].dtype:
            raise ValueError(f"rank {rank}: {n} is {tuple(t.shape)} {t.dtype}, its base "
                             f"{tuple(base[n].shape)} {base[n].dtype}")


def complete(root: Path, version: int) -> bool:
    d = version_dir(root, version)
    first = d / "rank00000.json"
    if not first.is_file():
        return False
    world = json.loads(first.read_text())["world"]
    return all((d / f"rank{r:05d}.json").is_file() for r in range(world))


def manifests(root: Path, version: int) -> list[dict]:
    """Every rank's manifest of a complete version (IncompleteVersion otherwise)."""
    d = version_dir(root, version)
    if not complete(root, version):
        raise IncompleteVersion(f"policy version {version} is not complete in {d}: a rank's manifest is missing")
    return [json.loads(p.read_text()) for p in sorted(d.glob("rank*.json"))]


def base_of(root: Path, version: int) -> Optional[int]:
    """The version a delta version applies to (None: published whole)."""
    bases = {m.get("base") for m in manifests(root, version)}
    if len(bases) != 1:
        raise CorruptBucket(f"policy version {version}: its ranks name different bases {sorted(map(str, bases))}")
    return bases.pop()


def chain(root: Path, version: int) -> list[int]:
    """The versions a reader needs to rebuild `version`: back to the full one, oldest first."""
    out = [version]
    while (b := base_of(root, out[-1])) is not None:
        if b >= out[-1]:
            raise CorruptBucket(f"policy version {out[-1]} names version {b} as its base: a delta applies to an "
                                "earlier version")
        out.append(b)
    return out[::-1]


@dataclass
class Pieces:
    """Published pieces of one version as a reader holds them: piece id -> tensor (a whole
    tensor, or one expert shard), and each piece's (tensor name, shard or None)."""
    tensors: dict[str, torch.Tensor]
    where: dict[str, tuple[str, Optional[tuple[int, int]]]]

    def whole(self) -> dict[str, torch.Tensor]:
        """The state dict: expert shards joined (IncompleteVersion when one is missing)."""
        state: dict[str, torch.Tensor] = {}
        parts: dict[str, dict[int, torch.Tensor]] = {}
        counts: dict[str, int] = {}
        for pid, t in self.tensors.items():
            name, shard = self.where[pid]
            if shard is None:
                state[name] = t
            else:
                parts.setdefault(name, {})[shard[0]] = t
                counts[name] = shard[1]
        for name, got in parts.items():
            if sorted(got) != list(range(counts[name])):
                raise IncompleteVersion(f"{name}: expert shards {sorted(got)} of {counts[name]} published")
            state[name] = torch.cat([got[i] for i in range(counts[name])])
        return state


Want = Callable[[str, Optional[tuple[int, int]]], bool]


def load_version(root: Path, version: int, held: Optional[tuple[int, Mapping[str, torch.Tensor]]] = None
                 ) -> tuple[str, dict[str, torch.Tensor], int]:
    """(model config JSON, the whole state dict, bytes read) of a complete version, every bucket
    verified; IncompleteVersion / CorruptBucket otherwise (nothing is applied). held=(version,
    state): what the reader holds, on which a delta applies; without it, or when the delta names
    another base, the base is rebuilt from its chain."""
    base = None
    if held is not None:
        state = held[1]
        base = (held[0], lambda name, shard: _piece(state, name, shard))
    config, pieces, moved = load_pieces(root, version, base)
    return config, pieces.whole(), moved


def load_pieces(root: Path, version: int, held: Optional[tuple[int, Callable]] = None, want: Optional[Want] = None
                ) -> tuple[str, Pieces, int]:
    """(model config JSON, the pieces of a complete version `want` asks for, bytes read): a
    server that holds only some experts reads only the buckets that hold them, each piece checked
    against its manifest's checksum (a whole bucket read whole: its sha256). held=(version,
    base(name, shard) -> the piece it holds): the base a delta applies on; without it, or when the
    delta names another base, the base is rebuilt from its chain."""
    d = version_dir(root, version)
    found = manifests(root, version)
    base_version = base_of(root, version)
    base: Optional[Callable] = None
    moved = 0
    if base_version is not None:
        if held is not None and held[0] == base_version:
            base = held[1]
        else:
            _, rebuilt, moved = load_pieces(root, base_version, held, want)
            base = lambda name, shard: rebuilt.tensors[piece_id(name, shard)]   # noqa: E731
    out = Pieces({}, {})
    for m in found:
        if m["version"] != version:
            raise CorruptBucket(f"{d}/rank{m['rank']:05d}.json says version {m['version']}, expected {version}")
        shards = {k: tuple(v) for k, v in m["shards"].items()}
        sums = m.get("checksums", {})
        for b in m["buckets"]:
            path = d / b["file"]
            wanted = [n for n in b["tensors"] if want is None or want(n, shards.get(n))]
            if not wanted:
                continue
            partial = len(wanted) < len(b["tensors"]) and "lengths" not in b
            if not path.is_file() or (not partial and sha256_file(path) != b["sha256"]):
                raise CorruptBucket(f"{path}: missing, or its sha256 differs from rank {m['rank']}'s manifest")
            if "lengths" in b:
                tensors = _undelta(path, b, base, shards, set(wanted))
            elif partial:
                with safe_open(str(path), framework="pt") as fh:
                    if sorted(fh.keys()) != b["tensors"]:
                        raise CorruptBucket(f"{path} holds {sorted(fh.keys())[:4]}..., its manifest lists "
                                            f"{b['tensors'][:4]}...")
                    tensors = {n: fh.get_tensor(n) for n in wanted}
            else:
                tensors = load_file(str(path))
                if sorted(tensors) != b["tensors"]:
                    raise CorruptBucket(f"{path} holds {sorted(tensors)[:4]}..., its manifest lists "
                                        f"{b['tensors'][:4]}...")
            moved += sum(tensors[n].numel() * tensors[n].element_size() for n in wanted) if partial else b["bytes"]
            for name in wanted:
                t, pid = tensors[name], piece_id(name, shards.get(name))
                # a whole bucket's bytes are its sha256's; a delta's or a partly read bucket's
                # result is checked piece by piece
                if (partial or "lengths" in b) and pid in sums and checksum(t) != sums[pid]:
                    raise CorruptBucket(f"{path}: {name} does not match its checksum in rank {m['rank']}'s manifest "
                                        f"(a delta applied to another base?)")
                if pid in out.tensors:
                    raise CorruptBucket(f"{name} is published twice (again by rank {m['rank']})")
                out.tensors[pid], out.where[pid] = t, (name, shards.get(name))
    return found[0]["config"], out, moved


def _piece(state: Mapping[str, torch.Tensor], name: str, shard: Optional[Sequence[int]]) -> torch.Tensor:
    t = state[name]
    return t if shard is None else t.chunk(shard[1])[shard[0]]


def _undelta(path: Path, bucket: dict, base: Optional[Callable], shards: Mapping[str, tuple[int, int]],
             wanted: set[str]) -> dict[str, torch.Tensor]:
    if base is None:
        raise CorruptBucket(f"{path} is a delta but its version names no base")
    raw = torch.frombuffer(bytearray(zstandard.ZstdDecompressor().decompress(path.read_bytes())), dtype=torch.uint8)
    if raw.numel() != sum(bucket["lengths"]):
        raise CorruptBucket(f"{path}: {raw.numel()} bytes after decompression, its manifest says "
                            f"{sum(bucket['lengths'])}")
    out, at = {}, 0
    for name, n in zip(bucket["tensors"], bucket["lengths"]):
        if name in wanted:
            try:
                old = base(name, shards.get(name)).contiguous()
            except KeyError:
                raise CorruptBucket(f"{path}: {name} has no base tensor to apply its delta to") from None
            if _raw(old).numel() != n:
                raise CorruptBucket(f"{path}: {name}'s delta is {n} bytes, its base {_raw(old).numel()}")
            new = torch.bitwise_xor(raw[at:at + n], _raw(old))
            out[name] = new.view(old.dtype).reshape(old.shape).clone()
        at += n
    return out


def expert_selector(local: Mapping[str, Optional[set[int]]], n_experts: int) -> Want:
    """`want` for load_pieces on an engine that serves some of the `n_experts` routed experts:
    every piece except the expert shards that hold none of their layer's local experts. local:
    the module prefix of each MoE's packed experts ('layers.3.mlp.experts') -> the global expert
    ids served here (None: all); shard k of R holds experts [k E/R, (k+1) E/R)."""
    def want(name: str, shard: Optional[tuple[int, int]]) -> bool:
        ids = local.get(name.rsplit(".", 1)[0])
        if shard is None or ids is None:
            return True
        return any(e * shard[1] // n_experts == shard[0] for e in ids)
    return want


def expected_checksums(root: Path, version: int) -> dict[str, str]:
    """Every published piece of a version and its checksum, from the ranks' manifests."""
    return {k: v for m in manifests(root, version) for k, v in m.get("checksums", {}).items()}


def checksums(state: Mapping[str, torch.Tensor], root: Path, version: int) -> dict[str, str]:
    """The checksums of what `state` holds, cut into the pieces `version` was published in: a
    reader's proof that it holds that version (compare with `expected_checksums`)."""
    out = {}
    for m in manifests(root, version):
        for b in m["buckets"]:
            for name in b["tensors"]:
                shard = m["shards"].get(name)
                out[piece_id(name, shard)] = checksum(_piece(state, name, shard)) if name in state else "missing"
    return out


def first_difference(expected: Mapping[str, str], held: Mapping[str, str]) -> Optional[str]:
    """The first piece (sorted) whose checksum differs, or that one side lacks; None when equal."""
    for k in sorted(set(expected) | set(held)):
        if expected.get(k) != held.get(k):
            return k
    return None


def apply(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """The loaded version into `model` in one step; refuses a state that does not cover the model
    exactly (a version of another shape, or a rank's part lost)."""
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise IncompleteVersion(f"the version does not match the model: missing {missing[:4]}, unexpected {extra[:4]}")
    model.load_state_dict(state, strict=True)


def prune(root: Path, keep: int = KEEP_VERSIONS) -> None:
    """Delete all but the newest `keep` complete versions, and the versions their deltas build
    on, back to a full one (and older incomplete ones)."""
    dirs = sorted(p for p in Path(root).glob("v*") if p.is_dir())
    done = [p for p in dirs if complete(root, int(p.name[1:]))]
    newest = done[-keep:]
    needed = {version_dir(root, v).name for p in newest for v in chain(root, int(p.name[1:]))}
    for p in dirs:
        if p.name not in needed and (not newest or p.name < newest[-1].name):
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
