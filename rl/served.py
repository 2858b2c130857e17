"""Rollouts from inference servers while the trainer's ranks only train (`rollout.backend:
served`): rl.rollout.RolloutEngine's interface (sync / generate / complete) over a pool of
server processes (rl.native_server), as slime runs GLM-5's RL with SGLang engines beside its
Megatron ranks.

    trainer ranks   log-prob recompute, loss, optimizer step (rl.update, rl.ranks); expert-
                    parallel when `parallel.expert_parallel` > 1. Never generate.
    servers         `replicas` processes started by rank 0 (or `urls`), each holding a whole
                    copy of the weights at one version; every rank sends its groups to them.

Weight sync (`sync(policy, version)`, a collective over the trainer's ranks): every rank
publishes only its own part (rl.weight_sync.rank_part: its share of the replicated tensors, its
expert shards) in buckets, whole or as a delta on what it published last (`delta`, a whole
version every `full_every` syncs); then rank 0 has every server load the version (a delta applies
on the version the server holds) and compares each server's checksums of what it now holds with
the ranks' manifests: a server holding anything else stops the stage, naming the server and the
tensor. Bytes written (and what the same versions would have cost whole) and seconds go into
`metrics()`. To write a delta a rank keeps a CPU copy of the part it published last.

Requests: a prompt group is one request (`n` samples, one seed drawn in order from the rank's
sampling generator), routed to a server by a consistent hash of its group, so a resumed stage
sends the same requests and the native servers answer them with the same tokens.

Failures: rank 0 watches its servers; one that dies is started again on its port, loads the
current version (its chain of deltas back to a whole version) and is checked, up to `restarts`
times. A request that meets a dead server waits for it to come back at the current version and
is sent again. The servers run under rl/server_guard.py, so none outlives the stage (kill -9
included), and with an environment built here: no credentials reach them.
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import httpx
import torch

from model.config import ModelConfig
from model.model import GLMModel
from model.moe import MoE
from quant.qat import QATConfig
from rl import weight_sync
from rl.orchestrator import HashRing
from rl.ranks import SINGLE, Ranks
from rl.sample import Sample, Status
from rl.served_pool import REPO, Server, ServerPoolConfig, named_pool
from rl.served_vllm import VLLMPoolServer, pool_settings
from rl.vllm_server import NETWORK_ERRORS, EngineFailed, http_error

__all__ = ["REPO", "Server", "ServerPoolConfig", "named_pool", "group_seeds", "expert_shards", "ServedEngine"]

if TYPE_CHECKING:
    from rl.sampling import SamplingParams

log = logging.getLogger("glmforge")


def group_seeds(key: int, n: int) -> list[int]:
    """n request seeds drawn from a generator seeded with `key` (a stage's (seed, step)): every
    rank draws the same list and sends its share, so the requests do not depend on the placement."""
    return torch.randint(0, 2**31 - 1, (n,), generator=torch.Generator().manual_seed(key)).tolist()


def expert_shards(model: torch.nn.Module) -> dict[str, weight_sync.Shard]:
    """The state-dict names of this rank's expert shards (expert parallelism: model.moe.shard_experts)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, MoE) and getattr(m, "ep_group", None) is not None:
            for pname, _ in m.experts.named_parameters():
                out[f"{name}.experts.{pname}" if name else f"experts.{pname}"] = weight_sync.Shard(m.ep_rank, m.ep_size)
    return out


class ServedEngine:
    """A pool of native servers: the policy's rollouts (`sync` each version, `generate`,
    `complete`), or a fixed model (`serve_file`: a distillation teacher scored with
    `prefill_logprobs`, a GRM judging with `complete` / `next_token_logprobs`; `serve_orm`: the
    ORM, `score_ids`)."""

    def __init__(self, policy: GLMModel | None, tokenizer, stop_ids: list[int], pad_id: int, cfg: ServerPoolConfig,
                 root: Path, *, int4: QATConfig | None = None, ranks: Ranks = SINGLE,
                 model: ModelConfig | None = None):
        """model: the architecture a pool without a policy serves (a teacher's, a judge's), which a
        vLLM server needs at start; the policy's otherwise."""
        self.tokenizer, self.stop_ids, self.cfg, self.ranks = tokenizer, list(stop_ids), cfg, ranks
        self.root, self.weights = Path(root), Path(root) / "weights"
        self.config_json = policy.config.model_dump_json() if policy is not None else ""
        self.state_file: Path | None = None
        self.orm_dir: Path | None = None
        self.version: int | None = None
        self.restarts = 0
        self._syncs = 0
        self._base: Optional[tuple[int, dict[str, torch.Tensor]]] = None
        self._sent = {"bytes": 0.0, "full_bytes": 0.0, "seconds": 0.0, "delta": 0.0}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None
        lead = ranks.rank == 0
        settings = {"threads": cfg.threads, "batch_size": cfg.batch_size, "pad_id": pad_id,
                    "int4": int4.model_dump() if int4 is not None else None}
        urls = cfg.urls or [None] * cfg.replicas
        if cfg.engine == "vllm":
            arch = policy.config if policy is not None else model
            vsettings = pool_settings(cfg, arch) if arch is not None else cfg.vllm   # every rank: the same refusal
            servers = [VLLMPoolServer(i, self.root, cfg, vsettings, arch, int4, url if url or lead else "http://unset")
                       for i, url in enumerate(urls)]
        else:
            servers = [Server(i, self.root, settings, url if url or lead else "http://unset")
                       for i, url in enumerate(urls)]
        error = None
        if lead:
            try:
                for s in servers:
                    s.launch()
                for s in servers:
                    s.wait_healthy(cfg.startup_timeout_s)
            except BaseException as e:
                for s in servers:
                    s.stop()
                if not isinstance(e, Exception):      # a stop signal: the stage stops, not a bad server
                    raise
                error = str(e)
        urls_on_lead = ranks.broadcast([s.url for s in servers] if lead else None)
        error = ranks.broadcast(error)
        if error:
            raise EngineFailed(error)
        if not lead:
            for s, url in zip(servers, urls_on_lead):
                s.url, s.owned = url, False
        self.servers = servers
        self.ring = HashRing()
        for i in range(len(servers)):
            self.ring.add(str(i))
        if lead and any(s.owned for s in servers):
            self._watchdog = threading.Thread(target=self._watch, daemon=True, name="native-server-watchdog")
            self._watchdog.start()

    @classmethod
    def connect(cls, urls: list[str], cfg: ServerPoolConfig, tokenizer, stop_ids: list[int]) -> "ServedEngine":
        """A client of servers another process owns and syncs (rl-agentic's rollout workers): it
        generates; versions come from the servers' labels."""
        return cls(None, tokenizer, stop_ids, 0, cfg.model_copy(update={"urls": list(urls)}), Path("."))

    # ------------------------------------------------------------ life
    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for s in self.servers:
                if s.owned:
                    s.stop()

    def __enter__(self) -> "ServedEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def metrics(self) -> dict[str, float]:
        return {"sync/bytes": self._sent["bytes"], "sync/full_bytes": self._sent["full_bytes"],
                "sync/seconds": self._sent["seconds"], "sync/delta": self._sent["delta"],
                "servers/restarts": float(self.restarts)}

    def _watch(self) -> None:
        """Rank 0: a server process that died is started again at the current version."""
        while not self._closed.wait(0.5):
            for s in self.servers:
                if s.owned and s.dead() and not self._closed.is_set():
                    try:
                        self._restart(s)
                    except EngineFailed as e:
                        log.error("%s", e)
                        return

    def _restart(self, server: Server) -> None:
        with self._lock:
            self._revive(server)

    def _revive(self, server: Server) -> None:
        """A dead server of ours started again at the current version (the lock held)."""
        if self._closed.is_set() or not server.dead():
            return
        if self.restarts >= self.cfg.restarts:
            raise EngineFailed(f"{server.kind} {server.index} died again after {self.restarts} restarts; "
                               f"last lines of {server.log_path}:\n{server.tail()}")
        self.restarts += 1
        log.warning("%s %d died: starting it again at version %s", server.kind, server.index, self.version)
        server.stop()
        server.launch()
        server.wait_healthy(self.cfg.startup_timeout_s)
        if self.state_file is not None:
            self._load_file(server)
        elif self.orm_dir is not None:
            self._load_orm(server)
        elif self.version is not None:
            self._load(server, self.version)

    def _take(self, server: Server, version: int) -> None:
        """`version` onto one server (the lock held); one that died on the way is revived first."""
        for attempt in range(2):
            self._revive(server)
            try:
                return self._load(server, version)
            except NETWORK_ERRORS:
                # the server process is gone; its guard notices within half a second
                deadline = time.monotonic() + 5.0
                while server.owned and not server.dead() and time.monotonic() < deadline:
                    time.sleep(0.1)
                if attempt or not server.dead():
                    raise

    # ------------------------------------------------------------ weights
    def sync(self, policy: torch.nn.Module, version: int) -> None:
        """Publish `policy` as `version` from every trainer rank and have every server take it; a
        collective: every rank calls it."""
        ranks, lead = self.ranks, self.ranks.rank == 0
        t0 = time.perf_counter()
        shards = expert_shards(policy)
        edp_rank = ranks.ep.edp_rank if ranks.ep is not None else 0
        part = {k: v.detach().to("cpu").clone()
                for k, v in weight_sync.rank_part(policy, ranks.rank, ranks.world, shards, edp_rank).items()}
        # a version published again under its own number (weights trained between two syncs of one
        # version) is written whole: a delta names an earlier version as its base
        whole = (not self.cfg.delta or self._base is None or self._base[0] >= version
                 or self._syncs % self.cfg.full_every == 0)
        if lead:       # what a killed attempt left of this version is not part of it
            shutil.rmtree(weight_sync.version_dir(self.weights, version), ignore_errors=True)
        ranks.barrier()
        sent = weight_sync.publish(self.weights, version, part, rank=ranks.rank, world=ranks.world,
                                   config_json=self.config_json, shards=shards, bucket_bytes=self.cfg.bucket_bytes,
                                   base=None if whole else self._base)
        self._base, self._syncs = (version, part), self._syncs + 1
        ranks.barrier()
        error = None
        if lead:
            try:
                with self._lock:
                    with ThreadPoolExecutor(len(self.servers)) as pool:
                        list(pool.map(lambda s: self._take(s, version), self.servers))
                    weight_sync.prune(self.weights, keep=1)
            except (EngineFailed, *NETWORK_ERRORS) as e:
                error = f"weight sync of version {version}: {e}"
        error = ranks.broadcast(error)
        if error:
            raise EngineFailed(error)
        self.version = version
        moved = ranks.sum([float(sent.bytes), float(sent.full_bytes)])
        self._sent = {"bytes": moved[0], "full_bytes": moved[1], "seconds": time.perf_counter() - t0,
                      "delta": 0.0 if whole else 1.0}

    def _load(self, server: Server, version: int) -> None:
        """The server takes `version`, then proves it holds exactly that."""
        reported = server.load_version(self.weights.resolve(), version, self.cfg.request_timeout_s)
        self.verify(server, version, reported=reported)

    def verify(self, server: Server, version: int, reported: Any = "ask") -> None:
        held = server.checksums(self.cfg.request_timeout_s, self.weights.resolve(), version)
        if reported == "ask":
            reported = held["version"]
        if reported != version or held["version"] != version:
            raise EngineFailed(f"{server.name} reports version {held['version']}, expected {version}")
        differs = weight_sync.first_difference(weight_sync.expected_checksums(self.weights, version),
                                               held["checksums"])
        if differs is not None:
            raise EngineFailed(f"{server.name} holds {differs} other than version {version} publishes it")

    def serve_file(self, path: Path) -> None:
        """Every server loads a fixed model from its state file (version 0) and proves it holds
        each of its tensors; a collective over the ranks (rank 0 does the work)."""
        self.state_file = Path(path).resolve()
        self._serve_fixed(path, self._load_file)

    def serve_orm(self, artifact: Path) -> None:
        """Every server loads an outcome reward model (rl.orm) from its artifact, checked tensor by
        tensor; then `score_ids` scores on them. A collective over the ranks."""
        self.orm_dir = Path(artifact).resolve()
        self._serve_fixed(artifact, self._load_orm)

    def _serve_fixed(self, what: Path, load) -> None:
        error = None
        if self.ranks.rank == 0:
            try:
                with self._lock:
                    for s in self.servers:
                        self._revive(s)
                        load(s)
            except (EngineFailed, *NETWORK_ERRORS) as e:
                error = f"serving {what}: {e}"
        error = self.ranks.broadcast(error)
        if error:
            raise EngineFailed(error)
        self.version = 0

    def _load_file(self, server: Server) -> None:
        server.load_file(self.state_file, self.cfg.request_timeout_s)
        self._check_files(server, [(self.state_file, "")])

    def _load_orm(self, server: Server) -> None:
        server.load_orm(self.orm_dir, self.cfg.request_timeout_s)
        self._check_files(server, [(self.orm_dir / "backbone.safetensors", "backbone."),
                                   (self.orm_dir / "head.safetensors", "")])

    def _check_files(self, server: Server, files: list[tuple[Path, str]]) -> None:
        """The server holds every tensor of these state files (name prefixed) exactly."""
        from safetensors import safe_open

        held = server.checksums(self.cfg.request_timeout_s)["checksums"]
        for path, prefix in files:
            with safe_open(str(path), framework="pt") as fh:
                for name in sorted(fh.keys()):
                    if held.get(prefix + name) != weight_sync.checksum(fh.get_tensor(name)):
                        raise EngineFailed(f"{server.name} holds {prefix + name} other than {path} has it")

    def score_ids(self, items: list[tuple[list[int], int]], batch: int = 32) -> torch.Tensor:
        """The served ORM's score of each (token ids, reply start), as rl.orm.RewardModel.score_ids."""
        chunks = [items[i:i + batch] for i in range(0, len(items), batch)]

        def one(k: int) -> list[float]:
            server = self.servers[int(self.ring.owner(f"score/{k}"))]
            return self._send(server, {"items": [[list(ids), start] for ids, start in chunks[k]]},
                              "/score")["scores"]

        return torch.tensor([x for part in self._map(one, list(range(len(chunks))), 16) for x in part])

    def next_token_logprobs(self, prefixes: list[list[int]]) -> torch.Tensor:
        """log p(next token | prefix) over the whole vocabulary for each prefix [N, vocab]: the
        first token's distribution at temperature 1 (a judge's verdict)."""
        def one(i: int) -> list[list[float]]:
            server = self.servers[int(self.ring.owner(f"next/{i}"))]
            out = self._send(server, {"token_ids": prefixes[i], "sampling_params": {
                "n": 1, "max_tokens": 1, "temperature": 1.0, "logprobs": -1}})
            return out["choices"][0]["logprobs"]["content"][0]["top_logprobs"]

        rows = self._map(one, list(range(len(prefixes))))
        vocab = max((len(r) for r in rows), default=0)
        out = torch.full((len(prefixes), vocab), float("-inf"))
        for i, row in enumerate(rows):
            ids = torch.tensor([int(c["token_id"]) for c in row])
            out[i, ids] = torch.tensor([float(c["logprob"]) for c in row])
        return out

    def prefill_logprobs(self, sequences: list[tuple[list[int], list[int]]], keys: list[str] | None = None
                         ) -> list[list[float]]:
        """log p(response token | everything before it) at temperature 1 for each (prompt,
        response): one prefill each, no sampling (a distillation teacher's scores)."""
        keys = keys or [f"seq/{i}" for i in range(len(sequences))]

        def one(seq: tuple[list[int], list[int]], key: str) -> list[float]:
            prompt, response = seq
            server = self.servers[int(self.ring.owner(key))]
            out = self._send(server, {"token_ids": list(prompt) + list(response),
                                      "sampling_params": {"max_tokens": 0, "prompt_logprobs": 0}})
            rows = out["prompt_logprobs"][len(prompt):]
            return [row[str(t)]["logprob"] for row, t in zip(rows, response)]    # JSON keys: strings

        return self._map(lambda i: one(sequences[i], keys[i]), list(range(len(sequences))))

    # ------------------------------------------------------------ sampling
    def generate(self, samples: list[Sample], params: SamplingParams, generator: torch.Generator,
                 seeds: dict[Any, int] | None = None) -> None:
        """Fill response_ids, rollout_logprobs, versions, loss_mask, status and text in place: one
        request per prompt group, seeded from `generator` in order, or by `seeds` (group -> seed:
        the same requests whichever rank sends them)."""
        groups: dict[Any, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group, []).append(s)
        members = list(groups.values())
        seeds = [seeds[g] for g in groups] if seeds is not None else self._seeds(len(members), params, generator)
        outs = self._run([(g[0].prompt_ids, len(g), f"group/{key}", seed)
                          for (key, g), seed in zip(groups.items(), seeds)], params)
        for group, choices in zip(members, outs):
            for s, (toks, lps, stopped, versions) in zip(group, choices):
                s.status = Status.OK if stopped else Status.TRUNCATED
                s.response_ids, s.rollout_logprobs, s.versions = toks, lps, versions
                s.loss_mask = [1] * len(toks)
                s.text = self.tokenizer.decode(toks, skip_special_tokens=True)

    def complete(self, prefixes: list[list[int]], params: SamplingParams, generator: torch.Generator,
                 keys: list[str] | None = None) -> list[tuple[list[int], list[float], bool, list[int]]]:
        """Continue each token prefix: (new ids up to and including the first stop token, their
        log-probs, whether a stop token ended it, the version of each). keys: affinity keys."""
        keys = keys or [f"seq/{i}" for i in range(len(prefixes))]
        seeds = self._seeds(len(prefixes), params, generator)
        return [c[0] for c in self._run([(p, 1, k, s) for p, k, s in zip(prefixes, keys, seeds)], params)]

    @staticmethod
    def _map(fn, items: list, most: int = 64) -> list:
        """fn over items in threads (HTTP requests in flight at once), results in order."""
        if not items:
            return []
        with ThreadPoolExecutor(min(most, len(items))) as pool:
            return list(pool.map(fn, items))

    @staticmethod
    def _seeds(n: int, params: SamplingParams, generator: torch.Generator) -> list[int]:
        # one seed per request, drawn in order: the same requests after a resume
        if params.temperature == 0:
            return [0] * n
        return torch.randint(0, 2**31 - 1, (n,), generator=generator).tolist()

    def _run(self, jobs: list[tuple[list[int], int, str, int]], params: SamplingParams
             ) -> list[list[tuple[list[int], list[float], bool, list[int]]]]:
        return self._map(lambda j: self._one(*j, params), jobs)

    def _one(self, prompt: list[int], n: int, key: str, seed: int, params: SamplingParams
             ) -> list[tuple[list[int], list[float], bool, list[int]]]:
        sp = {"n": n, "seed": seed, "max_tokens": params.max_new_tokens, "temperature": params.temperature,
              "top_p": params.top_p, "stop_token_ids": self.stop_ids}
        server = self.servers[int(self.ring.owner(key))]
        out = self._send(server, {"token_ids": prompt, "sampling_params": sp})
        result = []
        for choice in out["choices"]:
            toks = list(choice["token_ids"])
            lps = [c["logprob"] for c in choice["logprobs"]["content"]]
            versions = [0] * len(toks)
            for span in choice.get("weight_versions") or [{"version": self.version or 0, "start": 0,
                                                           "end": len(toks)}]:
                versions[span["start"]:span["end"]] = [int(span["version"])] * (span["end"] - span["start"])
            result.append((toks, lps, choice["finish_reason"] == "stop", versions))
        return result

    def _other_version(self, out: Any) -> Optional[str]:
        """The version a generate answer came from, when it is not the one this pool holds."""
        if self.version is None or not isinstance(out, dict):
            return None
        for choice in out.get("choices") or []:
            for span in choice.get("weight_versions") or []:
                if str(span["version"]) != str(self.version):
                    return str(span["version"])
        return None

    def _send(self, server: Server, body: dict, path: str = "/inference/v1/generate") -> dict:
        """A request; a server that is down is waited for (rank 0 restarts it) until it serves
        the current version again."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s + self.cfg.request_timeout_s
        while True:
            try:
                out = server.request(path, body, self.cfg.request_timeout_s)
                stale = self._other_version(out)
                if stale is None:
                    return out
                # a server started again answers before it has loaded the current version
                reason = f"it answered from version {stale}, not {self.version}"
            except httpx.HTTPStatusError as e:
                detail = e.response.content.decode(errors="replace")[:2000]
                if e.response.status_code != 500 or not ("no weights loaded" in detail
                                                          or "no reward model loaded" in detail):
                    raise EngineFailed(f"{server.name}: {http_error(e)}") from e
                reason = detail
            except NETWORK_ERRORS as e:
                reason = repr(e)
            if time.monotonic() > deadline or (self._watchdog is not None and not self._watchdog.is_alive()):
                raise EngineFailed(f"{server.name} is not serving ({reason}); "
                                   f"last lines of {server.log_path}:\n{server.tail()}")
            while time.monotonic() < deadline:
                h = server.health()
                if h is not None and (self.version is None or h.get("version") == self.version):
                    break
                time.sleep(0.2)
