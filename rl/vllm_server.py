"""A vLLM server's life, for a stage that rolls out on vLLM (rl.vllm_engine).

The stage starts the server (`python -m vllm.entrypoints.openai.api_server` from the vLLM
environment, `make vllm-setup`), waits for /health, restarts it when it dies, and stops it, with
everything it spawned, on the way out: a stage that ends, fails or is stopped by SIGTERM. A
`kill -9` of the stage cannot run that cleanup, so the server runs under rl/server_guard.py, which
takes its process group down once the stage's process is gone. With `urls` the servers are someone else's (a shared inference
pool): the stage only talks to them; they must run with the same flags (`VLLMServer.command`: token-only
generate endpoint, dev-mode RL endpoints, this module's worker extension) and read the path the
stage publishes weights to.

The server runs with an environment built here, not the stage's: no cloud or store credentials
reach it, and the RL endpoints it needs (pause, resume, reload_weights, weight versions) are
switched on with VLLM_SERVER_DEV_MODE, on 127.0.0.1 only.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal, Optional

import httpx
from pydantic import BaseModel, ConfigDict, Field

from runtime.shutdown import stop_process_group
from training.launch import free_port

log = logging.getLogger("glmforge")

SERVED_NAME = "policy"
# the worker extension (weight updates that vLLM's own reload gets wrong for MoE on CPU)
EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"
EXTENSION_CLS = "glmforge_vllm_ext.WeightUpdate"
GUARD = Path(__file__).resolve().parent / "server_guard.py"
CONTROL_TIMEOUT_S = 120.0       # pause / reload / resume / labels: seconds, not a generation's minutes
# a server that is gone (refused, reset, timed out); its HTTP errors are httpx.HTTPStatusError
NETWORK_ERRORS = (httpx.TransportError, OSError)


class VLLMServerSettings(BaseModel):
    """How a vLLM server process runs: what both the `vllm` rollout backend and a served pool with
    `engine: vllm` (rl.served_vllm) start."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    python: str = Field(".venv-vllm/bin/python", description="the vLLM environment's interpreter (make vllm-setup); "
                        "relative paths are from the working directory")
    checkpoint: Literal["dense_mla", "glm_moe_dsa"] = Field("dense_mla", description=(
        "the format the policy is served in: dense_mla (DeepSeek-V3's architecture, indexer dropped: vLLM "
        "serves it on CPU and GPU) or glm_moe_dsa (GLM-5's sparse attention: vLLM on GPUs)"))
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("float32", description=(
        "vLLM's --dtype: the precision the server computes in"))
    attention_backend: Optional[str] = Field(None, description=(
        "vLLM's --attention-backend (null: vLLM's choice, except float32 on CPU: CPU_MLA, because on CPUs with "
        "AMX vLLM picks AMX_MLA, which refuses float32 weights at start-up)"))
    max_model_len: int = Field(2048, ge=16, description="prompt + response tokens per sequence")
    max_num_seqs: int = Field(64, ge=1, description="sequences the server batches at once")
    extra_args: list[str] = Field([], description="more `vllm serve` arguments, e.g. --tensor-parallel-size 8")
    env: dict[str, str] = Field({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
                                description="environment for the server, beside a minimal one built here")
    enforce_eager: bool = Field(True, description="skip torch.compile (on CPU: a minute of start-up for nothing)")


class VLLMConfig(VLLMServerSettings):
    replicas: int = Field(1, ge=1, description="servers this stage starts; rollouts go to them by a consistent "
                          "hash of the prompt group (session affinity: a group's samples share one prefix cache)")
    urls: list[str] = Field([], description="servers someone else runs (then none is started); they must read "
                            "the published weights' path")
    concurrency: int = Field(64, ge=1, description="requests in flight per stage")
    startup_timeout_s: float = Field(900.0, gt=0, description=(
        "seconds a server may take to become healthy after it starts"))
    request_timeout_s: float = Field(900.0, gt=0, description="seconds one request to a server may take")
    pause_mode: Literal["wait", "abort", "keep"] = Field("wait", description="in-flight requests at a weight "
                                                         "update: finish them, abort them, or freeze them")
    restarts: int = Field(2, ge=0, description="times a dead server is restarted before the stage fails")
    max_parity_gap: Optional[float] = Field(0.1, gt=0, description=(
        "after every start and weight update, the server's log-probs of a probe sequence are compared with the "
        "trainer's forward on the same weights; a mean |delta log p| above this stops the stage (null: off)"))


class EngineFailed(RuntimeError):
    """A vLLM server did not start, died, or refused a request; the message names the log."""


def server_env(cfg: VLLMServerSettings) -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(VLLM_SERVER_DEV_MODE="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), VLLM_CONFIGURE_LOGGING="1",
               PYTHONPATH=str(EXTENSION_DIR))
    env.update(cfg.env)
    return env


def http(url: str, method: str = "GET", body: dict | None = None, timeout: float = 60.0) -> Any:
    """One JSON request: its answer (None when empty). An HTTP error status raises
    httpx.HTTPStatusError (http_error() words it); a server that is gone, NETWORK_ERRORS."""
    data = None if body is None else json.dumps(body).encode()   # as json.dumps writes it (NaN included)
    r = httpx.request(method, url, content=data, timeout=timeout, headers={"Content-Type": "application/json"})
    r.raise_for_status()
    return json.loads(r.content) if r.content else None


def http_error(e: httpx.HTTPStatusError) -> str:
    """`HTTP 500: what the server said` (its first 2000 characters)."""
    return f"HTTP {e.response.status_code}: {e.response.content.decode(errors='replace')[:2000]}"


def answers(url: str, timeout: float = 5.0) -> bool:
    """Whether `url` answers 200 (a health check)."""
    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except NETWORK_ERRORS:
        return False


def serve_command(c: VLLMServerSettings, model_dir: Path, port: int) -> list[str]:
    cmd = [c.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", c.dtype, "--max-model-len", str(c.max_model_len), "--max-num-seqs", str(c.max_num_seqs),
           # token ids in and out (/inference/v1/generate): the server never needs our tokenizer
           "--skip-tokenizer-init", "--tokens-only", "--worker-extension-cls", EXTENSION_CLS,
           # log-probs of the distribution sampled from (temperature applied), as the trainer computes them
           "--logprobs-mode", "processed_logprobs"]
    if c.attention_backend:
        cmd += ["--attention-backend", c.attention_backend]
    return cmd + (["--enforce-eager"] if c.enforce_eager else []) + list(c.extra_args)


class VLLMServer:
    """One server: a process this stage owns (`model_dir` is its first weights), or a URL."""

    def __init__(self, cfg: VLLMConfig, model_dir: Path, log_path: Path, url: str | None = None):
        self.cfg, self.model_dir, self.log_path = cfg, Path(model_dir), Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.owned = url is None
        self.url = url.rstrip("/") if url else ""
        self.starts = 0

    def command(self, port: int) -> list[str]:
        return serve_command(self.cfg, self.model_dir, port)

    def start(self) -> None:
        """launch(), then wait_healthy(); a server that does not come up is stopped."""
        self.launch()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def launch(self) -> None:
        """Start the process (ours) without waiting for it; a URL's server needs nothing."""
        if not self.owned:
            return
        if not Path(self.cfg.python).exists():
            raise EngineFailed(f"vLLM's interpreter {self.cfg.python} does not exist: run `make vllm-setup` "
                               "(or set rollout.vllm.python)")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== start {self.starts}: {' '.join(self.command(port))}\n".encode())
            out.flush()
            guarded = [sys.executable, str(GUARD), str(os.getpid()), "--", *self.command(port)]
            self.proc = subprocess.Popen(guarded, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=server_env(self.cfg), start_new_session=True)
        log.info("vLLM server pid %d on %s (log %s)", self.proc.pid, self.url, self.log_path)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineFailed(f"vLLM server exited with {self.proc.returncode} while starting; "
                                   f"last lines of {self.log_path}:\n{self.tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise EngineFailed(f"vLLM server at {self.url} not healthy after {self.cfg.startup_timeout_s:.0f} s; "
                           f"see {self.log_path}")

    def healthy(self) -> bool:
        return answers(self.url + "/health")

    def alive(self) -> bool:
        if self.owned:
            return self.proc is not None and self.proc.poll() is None and self.healthy()
        return self.healthy()

    def stop(self) -> None:
        if self.proc is not None:
            code = stop_process_group(self.proc, timeout=30.0)
            log.info("vLLM server pid %d stopped (%s)", self.proc.pid, code)
            self.proc = None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def call(self, path: str, body: dict | None = None, method: str = "POST",
             timeout: Optional[float] = None) -> Any:
        try:
            return http(self.url + path, method, body, timeout or self.cfg.request_timeout_s)
        except httpx.HTTPStatusError as e:
            raise EngineFailed(f"vLLM {path} at {self.url}: {http_error(e)}") from e
