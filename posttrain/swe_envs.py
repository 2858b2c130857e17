"""swe-envs: verifiable software-engineering environments from real repositories (rl.swe).

For each source (a local folder or git checkout, or a pinned source distribution from the package
index): fetch it, install its test environment, run its suite in the sandbox, then make instances
(rl.swe.build): bugs synthesised into its source files that its tests catch; the issue-pr stage's
mined pairs of its repository (`github`) when it is a git checkout holding their base commits;
and a share of canaries. Sources build in parallel (`workers` threads: the work is sandboxed test
runs, each its own process; or Prefect tasks on Dask with a `dask:` entry, tasks/dask_swe.py) and
each resumes on its own after a kill: a built source is not built again, a half-built one goes
on after the last instance it tried. A source that cannot be fetched, installed or tested is
recorded with its reason, and the stage goes on with the others.

Artifact:
    sources/<name>/{repo/, venv/, pairs/, instances.jsonl, tried.jsonl, report.json}
    instances.jsonl        every kept instance, all sources (what rl.envs.swe trains on)
    builds.jsonl           every source's report
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import Field

from data_processing.common import DaskConfig, StepConfig, expand_path
from runtime.stage import OPERATIONAL, Workdir
from rl.swe.build import BuildConfig, build_source
from rl.swe.sources import Source

# The default sources: small, pure-Python, permissively licensed projects whose source
# distributions ship their pytest suites, pinned by sha256 (fetched from the package index).
DEFAULT_SOURCES = tuple(Source(name=n, kind="sdist", package=n, version=v, sha256=h, license=lic,
                               **({"test_requires": ("pytest<8",)} if n == "boltons" else {}))
                        for n, v, h, lic in [
    ("inflection", "0.5.1", "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417", "MIT"),
    ("six", "1.17.0", "ff70335d468e7eb6ec65b95b99d3a2836546063f63acc5171de367e834932a81", "MIT"),
    ("toolz", "1.0.0", "2c86e3d9a04798ac556793bced838816296a2f085017664e4995cb40a1047a02", "BSD-3-Clause"),
    ("more-itertools", "10.5.0", "5482bfef7849c25dc3c6dd53a6173ae4795da2a41a80faea6700d9f5846c5da6", "MIT"),
    ("isodate", "0.7.2", "4cd1aa0f43ca76f4a6c6c0292a85f40b35ec2e43e315b59f06e6d32171a953e6", "BSD-3-Clause"),
    ("idna", "3.10", "12f65c9b470abda6dc35cf8e63cc574b1c52b11df2c86030af0ac09b01b13ea9", "BSD-3-Clause"),
    # boltons' conftest.py implements a hook with the `path` argument pytest 8 removed
    ("boltons", "24.1.0", "4a49b7d57ee055b83a458c8682a2a6f199d263a8aa517098bda9bab813554b87", "BSD-3-Clause"),
])


class SWEEnvsConfig(StepConfig):
    sources: tuple[Source, ...] = Field(DEFAULT_SOURCES, description="repositories to build environments from "
                                        "(default: seven projects from the package index, pinned)")
    build: BuildConfig = Field(BuildConfig(), description=(
        "how each source becomes environments: mutants tried, instances kept, test runs (rl.swe.build)"))
    workers: int = Field(2, ge=1, description="sources built at once (threads; without `dask`)")
    seed: int = Field(0, description="the order mutants are tried in, held-back tests")
    dask: DaskConfig | None = Field(None, json_schema_extra=OPERATIONAL, description="build the sources as Prefect "
                                    "tasks on Dask (tasks/dask_swe.py): a LocalCluster, or a cluster's scheduler")


def fingerprint(cfg: SWEEnvsConfig) -> str:
    """The local sources' files (a pinned archive is its sha256, already in the config)."""
    h = hashlib.sha256()
    for s in cfg.sources:
        if s.kind != "path":
            continue
        root = expand_path(s.path)
        if (root / ".git").exists():
            h.update(f"{s.name}:git:{s.rev or 'HEAD'}".encode())
            head = root / ".git" / "HEAD"
            h.update(head.read_bytes() if head.is_file() else b"")
            continue
        for p in sorted(root.rglob("*")) if root.is_dir() else []:
            if p.is_file() and not any(part in ("__pycache__", ".git") for part in p.parts):
                h.update(p.relative_to(root).as_posix().encode())
                h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def check_names(cfg: SWEEnvsConfig) -> None:
    names = [s.name for s in cfg.sources]
    if len(set(names)) != len(names):
        raise ValueError(f"swe_envs.sources: two sources share a name ({sorted(n for n in names if names.count(n) > 1)[0]})")


def read_pairs(path: Path | None, repo: str | None) -> list[dict]:
    """The issue-pr stage's pairs (pairs.jsonl) of repository `repo` (None: none, the file still
    checked); ValueError naming the file and line of a malformed one."""
    if path is None or not Path(path).is_file():
        return []
    pairs = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            pair = json.loads(line)
            pair["repo"], pair["instance_id"]
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{path}:{n}: not an issue-pr pair (a JSON object with repo, instance_id, ...): "
                             f"{type(e).__name__}: {e}") from None
        if pair["repo"] == repo:
            pairs.append(pair)
    return pairs


def build_one(source: Source, root: Path, build: BuildConfig, seed: int, pairs_file: Path | None) -> dict[str, Any]:
    """One source built under root/sources/<name> (resuming); its report."""
    sourced = source.model_copy(update={"path": str(expand_path(source.path))}) if source.path else source
    return build_source(sourced, root / "sources" / source.name, root / "downloads", build, seed,
                        pairs=read_pairs(pairs_file, source.github))


def build_all(cfg: SWEEnvsConfig, root: Path, progress=None, pairs_file: Path | None = None) -> list[dict[str, Any]]:
    """Every source built under root/sources/<name> (resuming), in parallel threads; their
    reports in config order. `pairs_file`: the issue-pr stage's pairs.jsonl."""
    check_names(cfg)
    done = []

    def one(source: Source) -> dict[str, Any]:
        report = build_one(source, root, cfg.build, cfg.seed, pairs_file)
        done.append(source.name)
        if progress is not None:
            progress(len(done), len(cfg.sources), f"swe-envs: {source.name} {'built' if report['built'] else report['reason']}")
        return report

    with ThreadPoolExecutor(cfg.workers) as pool:
        return list(pool.map(one, cfg.sources))


def run(cfg: SWEEnvsConfig, inputs: dict[str, Path], workdir: Workdir, build_sources=None) -> dict[str, Any]:
    """The stage; `build_sources(cfg, root, progress, pairs_file)` builds (build_all, or the Dask path)."""
    t0 = time.perf_counter()
    build = workdir.checkpoint / "build"
    pairs_file = inputs["issue-pr"] / "pairs.jsonl" if "issue-pr" in inputs else None
    reports = (build_sources or build_all)(cfg, build, workdir.progress, pairs_file)
    out = workdir.out
    shutil.rmtree(out / "sources", ignore_errors=True)
    instances = []
    for s, r in zip(cfg.sources, reports):
        src = build / "sources" / s.name
        dest = out / "sources" / s.name
        dest.mkdir(parents=True)
        for name in ("report.json", "tried.jsonl", "instances.jsonl"):
            if (src / name).is_file():
                shutil.copy2(src / name, dest / name)
        if r["built"]:
            for folder in ("repo", "venv", "pairs"):
                if (src / folder).is_dir():
                    shutil.copytree(src / folder, dest / folder, symlinks=True)
            instances += [json.loads(x) for x in (src / "instances.jsonl").read_text().splitlines() if x.strip()] \
                if (src / "instances.jsonl").is_file() else []
    with open(out / "instances.jsonl", "w", encoding="utf-8") as f:
        for inst in instances:
            f.write(json.dumps(inst) + "\n")
    with open(out / "builds.jsonl", "w", encoding="utf-8") as f:
        for r in reports:
            f.write(json.dumps(r) + "\n")
    result = summary(reports, sum(not i.get("canary") for i in instances), time.perf_counter() - t0)
    known = {s.github for s in cfg.sources if s.github}
    mined = [json.loads(x)["repo"] for x in pairs_file.read_text(encoding="utf-8").splitlines() if x.strip()] \
        if pairs_file is not None and pairs_file.is_file() else []
    result["pairs_mined"] = len(mined)
    result["pairs_without_source"] = sum(repo not in known for repo in mined)
    return result


def summary(reports: list[dict[str, Any]], instances: int, seconds: float) -> dict[str, Any]:
    built = [r for r in reports if r["built"]]
    reasons: dict[str, int] = {}
    for r in reports:
        if not r["built"]:
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    build_s = sum(r.get("seconds", 0.0) for r in reports)
    return {
        "sources": len(reports), "built": len(built), "build_rate": len(built) / len(reports) if reports else 0.0,
        "failed_by_reason": reasons, "instances": instances,
        "from_mutants": sum(r.get("from_mutants", 0) for r in built),
        "from_pairs": sum(r.get("from_pairs", 0) for r in built),
        "canaries": sum(r.get("canaries", 0) for r in built),
        "tests_collected": sum(r.get("tests_collected", 0) for r in built),
        "mutants_tried": sum(r.get("mutants_tried", 0) for r in built),
        "instances_per_cpu_minute": round(instances / (build_s / 60), 2) if build_s else None,
        "seconds": round(seconds, 1),
        "per_source": {r["source"]: {k: r.get(k) for k in ("built", "reason", "tests_collected", "tests_passing",
                                                           "instances", "canaries", "mutants_tried", "pairs_tried",
                                                           "seconds")}
                       for r in reports},
    }
