"""The project's own rollout engine as an inference server: `python -m rl.native_server CONFIG`.

It speaks the protocol the stage's served engine (rl.served) uses for every server it talks to,
the subset of vLLM's that RL needs, token ids in and token ids out:

    GET  /health                    {"version": v}  (null before the first weights)
    POST /inference/v1/generate     {"token_ids": prompt, "sampling_params": {"n", "seed",
                                     "max_tokens", "temperature", "top_p", "stop_token_ids",
                                     "prompt_logprobs", "logprobs"}}
                                 -> {"choices": [{"token_ids", "logprobs": {"content":
                                     [{"logprob"}]}, "finish_reason", "weight_versions":
                                     [{"version", "start", "end"}]}], "prompt_logprobs"}
    POST /weights/load              {"root", "version"}: a published version (rl.weight_sync,
                                     a delta applied on the version held) -> {"version", "bytes"}
    POST /weights/load_file         {"path", "version"}: a model's state file (a teacher's
                                     artifact, a judge's weights), labelled `version`
    POST /weights/load_orm          {"dir", "version"}: an outcome reward model (rl.orm)
    POST /score                     {"items": [[token ids, reply start], ...]}: the ORM's scores
                                     -> {"scores"}
    POST /weights/checksums         {"root", "version"}: the checksums of the weights held, cut
                                     as that version was published (without them: per tensor)
                                     -> {"version", "checksums"}

`logprobs` (with max_tokens 1): the first token's distribution at the request's temperature, its
top k entries as {"token_id", "logprob"} (vLLM's shape; -1: the whole vocabulary), a judge's verdict read
from the first token (rl.judges.grm_judge, "expected" scoring).

A request's `n` samples are one batch drawn from a generator seeded with its `seed`: the same
request on the same weights gives the same tokens, whichever replica serves it, before or after
a restart. Requests run one at a time (one model, the process's torch threads). With `int4` in
the config the served copy is fake-quantized (quant.qat), as the in-process engine's is.

The process holds no credentials (rl.served builds its environment) and runs under
rl/server_guard.py, which takes it down when the stage that started it is gone.
"""
from __future__ import annotations

import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from model.config import ModelConfig
from model.hf import load_state
from model.model import GLMModel
from quant.qat import QATConfig
from rl import weight_sync
from rl.orm import ARTIFACT_FILES, RewardModel, load_reward_model
from rl.rollout import RolloutEngine, SamplingParams

log = logging.getLogger("glmforge")


class NativeServer:
    """The engine behind the HTTP handler (usable in-process, as the tests do)."""

    def __init__(self, int4: dict | None = None, batch_size: int = 64, pad_id: int = 0):
        self.int4 = QATConfig(**int4) if int4 else None
        self.batch_size, self.pad_id = batch_size, pad_id
        self.engine: RolloutEngine | None = None
        self.orm: RewardModel | None = None
        self.version: int | None = None
        self.lock = threading.Lock()

    def state(self) -> dict[str, torch.Tensor]:
        if self.orm is not None:
            return self.orm.state_dict()
        assert self.engine is not None
        return self.engine.model.state_dict()

    def load_orm(self, path: str, version: int) -> dict[str, Any]:
        with self.lock:
            self.orm, _ = load_reward_model(Path(path), self.pad_id)
            self.engine, self.version = None, version
            return {"version": version, "bytes": sum((Path(path) / f).stat().st_size for f in ARTIFACT_FILES)}

    def score(self, body: dict[str, Any]) -> dict[str, Any]:
        items = [(list(map(int, ids)), int(start)) for ids, start in body["items"]]
        with self.lock:
            if self.orm is None:
                raise RuntimeError("no reward model loaded (POST /weights/load_orm first)")
            return {"scores": self.orm.score_ids(items, self.batch_size).tolist()}

    def load(self, root: str, version: int) -> dict[str, Any]:
        with self.lock:
            held = (self.version, self.state()) if self.engine is not None and self.version is not None else None
            config_json, state, moved = weight_sync.load_version(Path(root), version, held)
            if self.engine is None:
                model = GLMModel(ModelConfig.model_validate_json(config_json))
                self.engine = RolloutEngine(model, None, [], self.pad_id, int4=self.int4, batch_size=self.batch_size)
            weight_sync.apply(self.engine.model, state)
            self.version = self.engine.version = version
            return {"version": version, "bytes": moved}

    def load_file(self, path: str, version: int) -> dict[str, Any]:
        with self.lock:
            model = load_state(path)
            self.engine = RolloutEngine(model, None, [], self.pad_id, int4=self.int4, batch_size=self.batch_size)
            self.orm, self.version = None, version
            self.engine.version = version
            return {"version": version, "bytes": Path(path).stat().st_size}

    def checksums(self, root: str | None, version: int | None) -> dict[str, Any]:
        with self.lock:
            if self.engine is None and self.orm is None:
                return {"version": None, "checksums": {}}
            if root is None:
                return {"version": self.version,
                        "checksums": {k: weight_sync.checksum(v) for k, v in self.state().items()}}
            return {"version": self.version, "checksums": weight_sync.checksums(self.state(), Path(root), version)}

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = [int(t) for t in body["token_ids"]]
        sp = body.get("sampling_params", {})
        n, temperature = int(sp.get("n", 1)), float(sp.get("temperature", 1.0))
        if not prompt or n < 1:
            raise ValueError("token_ids must not be empty and n must be at least 1")
        with self.lock:
            if self.engine is None:
                raise RuntimeError("no weights loaded yet (POST /weights/load first)")
            out: dict[str, Any] = {"choices": []}
            if sp.get("prompt_logprobs") is not None:
                out["prompt_logprobs"] = self._prompt_logprobs(prompt)
            max_tokens = int(sp.get("max_tokens", 16))
            if max_tokens < 1:
                return out
            if sp.get("logprobs") is not None:
                if max_tokens != 1 or n != 1:
                    raise ValueError("logprobs: the first token's distribution, with max_tokens 1 and n 1")
                out["choices"].append(self._first_token(prompt, temperature, int(sp["logprobs"])))
                return out
            self.engine.stop_ids = [int(t) for t in sp.get("stop_token_ids", [])]
            params = SamplingParams(temperature, float(sp.get("top_p", 1.0)), max_tokens)
            gen = torch.Generator().manual_seed(int(sp.get("seed", 0)))
            for toks, lps, stopped, _ in self.engine._batch([prompt] * n, params, gen):
                out["choices"].append({
                    "token_ids": toks, "logprobs": {"content": [{"logprob": x} for x in lps]},
                    "finish_reason": "stop" if stopped else "length",
                    "weight_versions": [{"version": str(self.version), "start": 0, "end": len(toks)}]})
            return out

    @torch.no_grad()
    def _first_token(self, ids: list[int], temperature: float, k: int) -> dict[str, Any]:
        logits = self.engine.model(torch.tensor([ids])).logits[0, -1].float()
        logp = torch.log_softmax(logits / (temperature or 1.0), -1)
        top = torch.argsort(logp, descending=True, stable=True)
        top = top if k < 0 else top[:k]
        first = int(top[0])
        return {"token_ids": [first], "finish_reason": "length",
                "logprobs": {"content": [{"logprob": float(logp[first]),
                                          "top_logprobs": [{"token_id": int(t), "logprob": float(logp[t])}
                                                           for t in top]}]},
                "weight_versions": [{"version": str(self.version), "start": 0, "end": 1}]}

    @torch.no_grad()
    def _prompt_logprobs(self, ids: list[int]) -> list[dict[str, dict[str, float]] | None]:
        """log p(token t | tokens before it) at temperature 1 for every token but the first (vLLM's shape)."""
        logp = self.engine.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        return [None] + [{str(t): {"logprob": float(logp[i, t])}} for i, t in enumerate(ids[1:])]


def handler_for(server: NativeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:     # a line per request is noise
            pass

        def _reply(self, code: int, payload: Any) -> None:
            raw = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(200, {"version": server.version})
            else:
                self._reply(404, {"error": f"no GET {self.path}"})

        def do_POST(self) -> None:
            routes = {"/inference/v1/generate": server.generate,
                      "/weights/load": lambda b: server.load(b["root"], int(b["version"])),
                      "/weights/load_file": lambda b: server.load_file(b["path"], int(b["version"])),
                      "/weights/load_orm": lambda b: server.load_orm(b["dir"], int(b["version"])),
                      "/score": server.score,
                      "/weights/checksums": lambda b: server.checksums(b.get("root"), b.get("version"))}
            if self.path not in routes:
                self._reply(404, {"error": f"no POST {self.path}"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                self._reply(200, routes[self.path](body))
            except (KeyError, ValueError, TypeError) as e:
                self._reply(400, {"error": f"{type(e).__name__}: {e}"})
            except Exception as e:  # noqa: BLE001 (the client names the server and shows this)
                log.exception("%s failed", self.path)
                self._reply(500, {"error": f"{type(e).__name__}: {e}"})

    return Handler


def main(argv: list[str]) -> None:
    cfg = json.loads(Path(argv[0]).read_text())
    torch.set_num_threads(int(cfg.get("threads", 1)))
    server = NativeServer(cfg.get("int4"), int(cfg.get("batch_size", 64)), int(cfg.get("pad_id", 0)))
    httpd = ThreadingHTTPServer(("127.0.0.1", int(cfg["port"])), handler_for(server))
    httpd.daemon_threads = True
    log.info("native inference server on 127.0.0.1:%d", cfg["port"])
    httpd.serve_forever()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main(sys.argv[1:])
