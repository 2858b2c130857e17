"""A rollout worker process: `python -m rl.rollout_worker HOST:PORT WORKER_ID`.

It connects to the orchestrator (rl.orchestrator) over TCP with the auth key from the
environment (GLMFORGE_RL_AUTHKEY, hex; never on the command line), receives its configuration,
and then serves requests in order:
    ("weights", version, dir)    load a published policy version, verified whole (rl.weight_sync),
                                 between requests or turns
    ("generate", group, task, n) run n episodes of the task (rl.agent.run_group) and answer
                                 ("result", worker_id, group, [sample dicts])
    ("stop",)                    exit
A heartbeat thread sends ("heartbeat", worker_id) every `heartbeat_s`; the orchestrator takes a
worker that stops beating (or whose socket closes) for dead and re-routes its groups. The same
program runs on another machine given the orchestrator's address.
"""
from __future__ import annotations

import os
import sys
import threading
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any


def serve(address: tuple[str, int], worker_id: str) -> None:
    conn = Client(address, authkey=bytes.fromhex(os.environ["GLMFORGE_RL_AUTHKEY"]))
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        with lock:
            conn.send(msg)

    send(("hello", worker_id, os.getpid()))
    kind, cfg = conn.recv()
    assert kind == "config", kind
    import torch

    torch.set_num_threads(int(cfg.get("threads", 1)))
    from chat.template import STOP_TOKENS
    from data_processing.tokenizer import load_tokenizer
    from model.config import ModelConfig
    from model.model import GLMModel
    from quant.qat import QATConfig
    from rl import weight_sync
    from rl.agent import context_for, prompt_tools, run_group
    from rl.envs import make_env
    from rl.rollout import RolloutEngine, SamplingParams
    from rl.wire import sample_to_dict, task_from_dict

    tokenizer = load_tokenizer(cfg["tokenizer"])
    params = SamplingParams(**cfg["sampling"])
    int4 = QATConfig(**cfg["int4"]) if cfg.get("int4") else None
    engine: RolloutEngine | None = None
    if cfg.get("vllm"):                 # the stage's vLLM servers: they take the weights, not this process
        from rl.vllm_engine import VLLMEngine
        from rl.vllm_server import VLLMConfig

        engine = VLLMEngine.connect(cfg["vllm"]["urls"], VLLMConfig(**cfg["vllm"]["config"]), tokenizer,
                                    [tokenizer.token_to_id(t) for t in STOP_TOKENS])
    elif cfg.get("served"):             # the stage's native servers: they take the weights
        from rl.served import ServerPoolConfig, ServedEngine

        engine = ServedEngine.connect(cfg["served"]["urls"], ServerPoolConfig(**cfg["served"]["config"]), tokenizer,
                                      [tokenizer.token_to_id(t) for t in STOP_TOKENS])
    queue: list[tuple] = []
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(cfg["heartbeat_s"]):
            try:
                send(("heartbeat", worker_id))
            except OSError:
                return

    threading.Thread(target=beat, daemon=True).start()

    def load(version: int, root: str) -> None:
        nonlocal engine
        if cfg.get("vllm") or cfg.get("served"):
            return
        config_json, state, _ = weight_sync.load_version(Path(root), version)
        model = GLMModel(ModelConfig.model_validate_json(config_json))
        weight_sync.apply(model, state)
        if engine is None:
            stops = [tokenizer.token_to_id(t) for t in STOP_TOKENS]
            engine = RolloutEngine(model, tokenizer, stops, tokenizer.token_to_id("<|pad|>"), int4=int4,
                                   batch_size=cfg["batch_size"])
        engine.sync(model, version)

    def drain() -> None:
        # between turns: apply new weights now, keep other requests for later (in order)
        while conn.poll(0):
            msg = conn.recv()
            if msg[0] == "weights":
                load(msg[1], msg[2])
            else:
                queue.append(msg)

    try:
        while True:
            msg: tuple[Any, ...] = queue.pop(0) if queue else conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "weights":
                load(msg[1], msg[2])
            elif msg[0] == "generate":
                _, group, task, n = msg
                if engine is None:
                    raise RuntimeError("generate before any weights were published")
                t = task_from_dict(task)
                env = lambda: make_env(t.domain, **cfg["env_args"].get(t.domain, {}))  # noqa: E731
                samples = run_group(engine, tokenizer, env, t, group, n, params, cfg["max_turns"], cfg["seed"],
                                    context=context_for(cfg.get("context"), tokenizer, prompt_tools(env())), on_turn=drain)
                send(("result", worker_id, group, [sample_to_dict(s) for s in samples]))
    except (EOFError, OSError):
        pass                                   # the orchestrator went away: nothing to answer to
    finally:
        stop.set()
        conn.close()


if __name__ == "__main__":
    host, port = sys.argv[1].rsplit(":", 1)
    serve((host, int(port)), sys.argv[2])
