"""What both engines of a served pool (rl.served) share: the pool's configuration
(ServerPoolConfig, named_pool) and one server of it (Server: the native server, rl.native_server,
whose protocol operations rl.served_vllm.VLLMPoolServer implements for vLLM)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal, Optional

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.shutdown import stop_process_group
from rl import weight_sync
from rl.vllm_server import GUARD, NETWORK_ERRORS, EngineFailed, VLLMServerSettings, http, http_error
from training.launch import free_port

REPO = Path(__file__).resolve().parents[1]


class ServerPoolConfig(BaseModel):
    """A pool of inference servers a stage starts (or is given as URLs) while its trainer's ranks
    only train: `rollout.servers` (the policy's rollouts), rl-general's `judge_servers`, distill's
    `teacher_servers`. One protocol, two engines: `native` (rl.native_server, one device per
    replica: CPU, tests, laptops) and `vllm` (rl.served_vllm: GPUs, a replica over
    `gpus_per_replica` of them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: Literal["native", "vllm"] = Field("native", description=(
        "native: the project's engine as a server process; vllm: vLLM servers (`make vllm-setup`), the weights "
        "loaded from the trainer's published versions by the worker extension in rl/vllm_ext"))
    replicas: int = Field(2, ge=1, description="server processes the stage starts (rank 0 owns them)")
    urls: list[str] = Field([], description="servers someone else runs (then none is started); they must read "
                            "the published weights' folder. In judge_servers and teacher_servers `{name}` stands "
                            "for the judge's or the teacher's name (a pool each)")
    gpus_per_replica: int = Field(1, ge=1, description="GPUs one replica runs on (vLLM: tensor x data parallel)")
    data_parallel: int = Field(1, ge=1, description="attention data parallelism inside a replica (vLLM "
                               "--data-parallel-size); its other GPUs are tensor parallel")
    expert_parallel: int = Field(1, ge=1, description="GPUs of a replica the routed experts are sharded over "
                                 "(vLLM --enable-expert-parallel: all of them)")
    weights: Literal["bf16", "fp8"] = Field("bf16", description="the served weights' precision (fp8: vLLM "
                                            "--quantization fp8); INT4 rollouts are the stage's rollout_int4")
    vllm: VLLMServerSettings = Field(VLLMServerSettings(), description="how the vLLM processes run (engine: vllm)")
    threads: int = Field(1, ge=1, description="torch threads per native server")
    batch_size: int = Field(64, ge=1, description="sequences a native server decodes at once")
    delta: bool = Field(True, description="publish what changed since the last version (XOR + zstd) instead of "
                        "every byte")
    full_every: int = Field(10, ge=1, description="a whole version every N syncs (the chain a restarted "
                            "server replays stays short)")
    bucket_bytes: int = Field(weight_sync.DEFAULT_BUCKET_BYTES, ge=1 << 10, description=(
        "bytes per safetensors bucket file a rank writes of a published weight version (a larger tensor "
        "alone in its own)"))
    restarts: int = Field(2, ge=0, description="times a dead server is started again before the stage fails")
    startup_timeout_s: float = Field(120.0, gt=0, description=(
        "seconds a server may take to become healthy after it starts"))
    request_timeout_s: float = Field(600.0, gt=0, description=(
        "seconds one request to a server (a generation, a weight load) may take"))

    @model_validator(mode="after")
    def _layout(self) -> "ServerPoolConfig":
        g = self.gpus_per_replica
        if g % self.data_parallel:
            raise ValueError(f"data_parallel={self.data_parallel} does not divide gpus_per_replica={g}")
        if g % self.expert_parallel:
            raise ValueError(f"expert_parallel={self.expert_parallel} does not divide gpus_per_replica={g}: a "
                             "replica's GPUs are split into equal expert shards")
        if self.engine == "native" and (g, self.expert_parallel, self.data_parallel, self.weights) != (1, 1, 1, "bf16"):
            raise ValueError("a native server replica runs on one device with the weights as trained: "
                             "gpus_per_replica, data_parallel and expert_parallel > 1 or weights: fp8 need engine: vllm")
        if self.engine == "vllm" and self.expert_parallel not in (1, g):
            raise ValueError(f"expert_parallel={self.expert_parallel}: vLLM shards the experts over all "
                             f"{g} GPUs of a replica (--enable-expert-parallel) or none")
        return self


def named_pool(cfg: "ServerPoolConfig", name: str) -> "ServerPoolConfig":
    """A judge's or a teacher's own pool: `{name}` in the urls becomes its name."""
    return cfg.model_copy(update={"urls": [u.replace("{name}", name) for u in cfg.urls]}) if cfg.urls else cfg


def _server_env() -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return env


class Server:
    """One native server: a process of ours on a fixed port (restarted there), or a URL. The
    served protocol's operations (load a version, a file, an ORM; checksums; requests) are
    methods, so another engine is another subclass (rl.served_vllm.VLLMPoolServer)."""

    kind = "native server"

    def __init__(self, index: int, root: Path, settings: dict[str, Any], url: str | None = None):
        self.index, self.root, self.settings = index, Path(root), settings
        self.owned = url is None
        self.port = free_port() if self.owned else None
        self.url = url.rstrip("/") if url else f"http://127.0.0.1:{self.port}"
        self.log_path = self.root / f"server-{index}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def name(self) -> str:
        return f"{self.kind} {self.index} ({self.url})"

    def command(self) -> list[str]:
        cfg = self.root / f"server-{self.index}.json"
        cfg.write_text(json.dumps({**self.settings, "port": self.port}))
        return [sys.executable, "-m", "rl.native_server", str(cfg)]

    def env(self) -> dict[str, str]:
        return _server_env()

    def launch(self) -> None:
        if not self.owned:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        self.starts += 1
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== start {self.starts} on port {self.port}: {' '.join(cmd)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen([sys.executable, str(GUARD), str(os.getpid()), "--", *cmd], stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env(),
                                         cwd=str(REPO), start_new_session=True)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineFailed(f"{self.kind} {self.index} exited with {self.proc.returncode} while starting; "
                                   f"last lines of {self.log_path}:\n{self.tail()}")
            if self.health() is not None:
                return self.prepare()
            time.sleep(0.2)
        raise EngineFailed(f"{self.name} not healthy after {timeout:.0f} s; see {self.log_path}")

    def prepare(self) -> None:
        """What a freshly started server needs before its first load (nothing, here)."""

    def health(self) -> Optional[dict]:
        """{"version": the version it serves, None before its first load}; None when it does not answer."""
        try:
            return http(self.url + "/health", timeout=5)
        except (httpx.HTTPStatusError, *NETWORK_ERRORS, ValueError):
            return None

    def dead(self) -> bool:
        return self.owned and (self.proc is None or self.proc.poll() is not None)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, timeout=10.0)
            self.proc = None

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def request(self, path: str, body: dict, timeout: float) -> Any:
        """One request of the protocol (HTTP errors raised as they are)."""
        return http(self.url + path, "POST", body, timeout)

    def call(self, path: str, body: dict, timeout: float) -> Any:
        try:
            return self.request(path, body, timeout)
        except httpx.HTTPStatusError as e:
            raise EngineFailed(f"{self.name} {path}: {http_error(e)}") from e

    # ------------------------------------------------------------ the protocol's loads
    def load_version(self, root: Path, version: int, timeout: float) -> Any:
        """Take a published version (a delta on the one held); returns the version it reports."""
        return self.call("/weights/load", {"root": str(root), "version": version}, timeout).get("version")

    def load_file(self, path: Path, timeout: float) -> None:
        self.call("/weights/load_file", {"path": str(path), "version": 0}, timeout)

    def load_orm(self, artifact: Path, timeout: float) -> None:
        self.call("/weights/load_orm", {"dir": str(artifact), "version": 0}, timeout)

    def checksums(self, timeout: float, root: Path | None = None, version: int | None = None) -> dict:
        """{"version", "checksums"} of what it holds: per piece of `version` as published under
        `root`, or per tensor."""
        body = {} if root is None else {"root": str(root), "version": version}
        return self.call("/weights/checksums", body, timeout)
