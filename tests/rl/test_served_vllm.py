"""vLLM behind the served protocol (rl.served_vllm, `engine: vllm`): the same pool operations as
the native servers, against real vLLM servers (opt-in: make test-vllm). Without vLLM: the pool's
layout checks and the arguments a replica's layout becomes."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from domains.task import Task
from model.hf import save_state
from rl import weight_sync
from rl.rollout import SamplingParams
from rl.sample import Sample
from rl.served import ServedEngine, ServerPoolConfig
from rl.served_vllm import layout_args
from rl.update import recompute_old_logprobs
from rl.vllm_server import EngineFailed
from tests.posttrain._chain import make_tokenizer
from tests.rl.conftest import small_model
from tests.rl.test_vllm_backend import VLLM_PYTHON, servable_model


def test_a_pool_layout_is_checked_and_becomes_vllm_arguments():
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide gpus_per_replica=8"):
        ServerPoolConfig(engine="vllm", gpus_per_replica=8, expert_parallel=3)
    with pytest.raises(ValueError, match="data_parallel=3 does not divide gpus_per_replica=8"):
        ServerPoolConfig(engine="vllm", gpus_per_replica=8, data_parallel=3)
    with pytest.raises(ValueError, match="native server replica runs on one device"):
        ServerPoolConfig(gpus_per_replica=8)
    with pytest.raises(ValueError, match="vLLM shards the experts over all 8 GPUs"):
        ServerPoolConfig(engine="vllm", gpus_per_replica=8, expert_parallel=4)
    pool = ServerPoolConfig(engine="vllm", gpus_per_replica=64, data_parallel=8, expert_parallel=64, weights="fp8")
    assert layout_args(pool) == ["--tensor-parallel-size", "8", "--data-parallel-size", "8",
                                 "--enable-expert-parallel", "--quantization", "fp8"]
    assert layout_args(ServerPoolConfig(engine="vllm")) == []


def _pool(**kw) -> ServerPoolConfig:
    return ServerPoolConfig(engine="vllm", replicas=1, startup_timeout_s=600, full_every=3,
                            vllm={"python": str(VLLM_PYTHON), "max_model_len": 256, "max_num_seqs": 16}, **kw)


def _nudge(model, scale=0.02):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if i % 2 == 0:
                p.add_(scale * torch.randn_like(p))


def _gap(model, samples) -> float:
    recompute_old_logprobs(model, samples, 0, 1.0)
    d = [abs(a - b) for s in samples for a, b in zip(s.rollout_logprobs, s.train_logprobs)]
    return sum(d) / len(d)


@pytest.mark.vllm
def test_vllm_pool_syncs_deltas_proves_the_version_and_survives_a_kill(tmp_path):
    tok = make_tokenizer()
    model = servable_model(tok.get_vocab_size())
    stops = [tok.token_to_id("7")]
    task = Task("arithmetic", "1+1", "2")
    gen = torch.Generator().manual_seed(0)
    with ServedEngine(model, tok, stops, 0, _pool(), tmp_path) as engine:
        engine.sync(model, 1)
        samples = [Sample(task, g, list(range(5, 20 + g))) for g in range(3) for _ in range(4)]
        engine.generate(samples, SamplingParams(1.0, 1.0, 10), gen)
        assert all(s.versions == [1] * len(s.response_ids) and s.response_ids for s in samples)
        assert _gap(model, samples) < 0.01
        _nudge(model)
        engine.sync(model, 2)                        # a delta on version 1, applied in vLLM's workers
        assert engine.metrics()["sync/delta"] == 1.0
        assert engine.metrics()["sync/bytes"] < engine.metrics()["sync/full_bytes"]
        after = [Sample(task, g, list(range(5, 20 + g))) for g in range(3) for _ in range(4)]
        engine.generate(after, SamplingParams(1.0, 1.0, 10), gen)
        assert all(s.versions == [2] * len(s.response_ids) for s in after)
        assert _gap(model, after) < 0.015
        # a teacher's prefill: log-probs of given tokens
        lps = engine.prefill_logprobs([(list(range(5, 15)), [20, 21, 22])])[0]
        ref = Sample(task, 0, list(range(5, 15)))
        ref.response_ids, ref.rollout_logprobs, ref.loss_mask = [20, 21, 22], lps, [1, 1, 1]
        assert _gap(model, [ref]) < 0.01
        # a judge's first-token distribution: the whole vocabulary
        first = engine.next_token_logprobs([list(range(5, 15))])
        assert first.shape == (1, tok.get_vocab_size()) and abs(float(first.exp().sum()) - 1) < 1e-3

        # kill -9: the watchdog starts it again, it replays 1 then the delta 2 and proves it
        server = engine.servers[0]
        os.killpg(server.proc.pid, signal.SIGKILL)
        again = [Sample(task, 0, list(range(5, 20)))]
        engine.generate(again, SamplingParams(1.0, 1.0, 6), gen)
        assert engine.restarts == 1 and again[0].versions == [2] * len(again[0].response_ids)
        engine.verify(server, 2)

        # a server that holds a stale tensor is named with it: version 3 rewritten (one tensor
        # changed) after the server loaded it
        weight_sync.publish(engine.weights, 3, model.state_dict(), config_json=model.config.model_dump_json())
        engine._load(server, 3)
        stale = dict(model.state_dict())
        name = sorted(stale)[5]
        stale[name] = stale[name] + 1
        weight_sync.publish(engine.weights, 3, stale, config_json=model.config.model_dump_json())
        with pytest.raises(EngineFailed, match=rf"vLLM server 0 .* holds {name} other than version 3"):
            engine.verify(server, 3)

    # a teacher served from its state file
    save_state(model, tmp_path / "teacher.safetensors")
    with ServedEngine(None, tok, stops, 0, _pool(), tmp_path / "teacher", model=model.config) as teacher:
        teacher.serve_file(tmp_path / "teacher.safetensors")
        lps = teacher.prefill_logprobs([(list(range(5, 15)), [20, 21, 22])])[0]
        ref = Sample(task, 0, list(range(5, 15)))
        ref.response_ids, ref.rollout_logprobs, ref.loss_mask = [20, 21, 22], lps, [1, 1, 1]
        assert _gap(model, [ref]) < 0.01
        with pytest.raises(EngineFailed, match="ORM .* native servers"):
            teacher.serve_orm(tmp_path)


@pytest.mark.vllm
def test_rl_reasoning_on_two_expert_parallel_ranks_with_a_vllm_pool(tmp_path):
    """The glm5 placement in miniature: 2 trainer ranks with the experts sharded over them, the
    rollouts and evaluations from a vLLM replica that loads each rank's published shards."""
    from runtime.stage import Workdir
    from posttrain.rl_reasoning import RLReasoningConfig, run_rl_reasoning
    from tests.rl.test_vllm_backend import STAGE_CFG, _servers_of, _stage_inputs

    inputs = _stage_inputs(tmp_path / "in")
    pool = _pool().model_copy(update={"vllm": _pool().vllm.model_copy(update={"max_model_len": 512})})
    cfg = RLReasoningConfig(**STAGE_CFG, rollout={"backend": "served", "servers": pool.model_dump()},
                            parallel={"launch": {"nproc_per_node": 2}, "expert_parallel": 2})
    m = run_rl_reasoning(cfg, inputs, Workdir.at(tmp_path / "wd", seed=3))
    assert m["steps"] == 3
    assert m["placement"] == {"trainer_ranks": 2, "expert_parallel": 2, "rollout": "served", "servers": 1}
    assert m["weight_sync"]["deltas"] >= 1
    recs = [json.loads(x) for x in (tmp_path / "wd" / "out" / "metrics.jsonl").read_text().splitlines()]
    # the trainer's recomputed log-probs against vLLM's, on the shards it published
    assert all(r["trainer_ranks"] == 2 and r["mismatch/abs_logp"] < 0.02 for r in recs), recs
    assert not _servers_of(tmp_path / "wd")


def test_what_vllm_cannot_run_is_refused_before_a_server_starts(tmp_path):
    tok = make_tokenizer()
    model = servable_model(tok.get_vocab_size())
    with pytest.raises(EngineFailed, match="nowhere/python does not exist: run `make vllm-setup`"):
        ServedEngine(model, tok, [1], 0, ServerPoolConfig(engine="vllm", replicas=1, vllm={"python": "/nowhere/python"}),
                     tmp_path)
    with pytest.raises(ValueError, match="vLLM on CPU crashes with expert parallelism"):
        ServedEngine(model, tok, [1], 0, ServerPoolConfig(engine="vllm", gpus_per_replica=2, expert_parallel=2),
                     tmp_path)
    with pytest.raises(ValueError, match="512 \\+ 64"):      # vLLM's CPU MLA: GLM-5's latent sizes only
        ServedEngine(small_model(64), tok, [1], 0, ServerPoolConfig(engine="vllm"), tmp_path)
