"""Rollouts from native server processes (rl.served, rl.native_server): the protocol's answers
match the trainer's own forward, the same request gives the same tokens on any replica and after
a kill -9 of its server, delta syncs move fewer bytes and land the same weights, a server that
missed a tensor is named, and nothing outlives the engine."""
from __future__ import annotations

import copy
import os
import signal
import time

import pytest
import torch

from chat.template import STOP_TOKENS
from domains import arithmetic
from quant.qat import QATConfig
from rl import weight_sync
from rl.rollout import RolloutConfig, SamplingParams, open_engine, prompt_ids
from rl.sample import Sample, Status
from rl.served import ServerPoolConfig, ServedEngine
from rl.update import recompute_old_logprobs
from rl.vllm_server import EngineFailed
from tests.rl.conftest import small_model



def _samples(tokenizer, n_prompts=3, group=4):
    tasks = arithmetic.tasks(n_prompts, "train", seed=0)
    return [Sample(t, g, prompt_ids(tokenizer, t)) for g, t in enumerate(tasks) for _ in range(group)]


def _open(tokenizer, model, root, **cfg):
    stops = [tokenizer.token_to_id(t) for t in STOP_TOKENS]
    rollout = RolloutConfig(backend="served", servers={"replicas": 2, "startup_timeout_s": 60, **cfg})
    return open_engine(rollout, model, tokenizer, stops, tokenizer.token_to_id("<|pad|>"), root)


def _nudge(model, every=3):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if i % every == 0:
                p.add_(1e-3 * torch.randn_like(p))


def _tokens(samples):
    return [(s.response_ids, s.rollout_logprobs, s.versions) for s in samples]


@pytest.fixture(scope="module")
def served(tokenizer, tmp_path_factory):
    model = small_model(tokenizer.get_vocab_size())
    root = tmp_path_factory.mktemp("served")
    with _open(tokenizer, model, root, full_every=3) as engine:
        engine.sync(model, 0)
        yield engine, model, root


def test_served_rollouts_carry_the_versions_and_logprobs_the_trainer_recomputes(served, tokenizer):
    engine, model, _ = served
    samples = _samples(tokenizer)
    engine.generate(samples, SamplingParams(1.0, 1.0, 10), torch.Generator().manual_seed(0))
    stops = {tokenizer.token_to_id(t) for t in STOP_TOKENS}
    for s in samples:
        assert 1 <= len(s.response_ids) <= 10 and s.versions == [0] * len(s.response_ids)
        assert (s.status == Status.OK) == (s.response_ids[-1] in stops)
    recompute_old_logprobs(model, samples, tokenizer.token_to_id("<|pad|>"), 1.0)
    for s in samples:
        assert s.train_logprobs == pytest.approx(s.rollout_logprobs, abs=1e-4)
    # the same requests again: the same tokens (a group is one seeded request)
    again = copy.deepcopy(samples)
    engine.generate(again, SamplingParams(1.0, 1.0, 10), torch.Generator().manual_seed(0))
    assert _tokens(again) == _tokens(samples)
    # a group's samples differ from each other (n samples of one request, not n copies)
    assert len({tuple(s.response_ids) for s in samples[:4]}) > 1


def test_delta_syncs_move_fewer_bytes_and_every_server_proves_it_holds_the_version(served, tokenizer):
    engine, model, root = served
    engine.sync(model, 1)                      # the second sync: a delta on version 0
    m = engine.metrics()
    assert m["sync/delta"] == 1.0 and m["sync/bytes"] < 0.05 * m["sync/full_bytes"]   # nothing moved
    _nudge(model)
    engine.sync(model, 2)
    m = engine.metrics()
    assert m["sync/delta"] == 1.0 and m["sync/bytes"] < 0.9 * m["sync/full_bytes"]
    engine.sync(model, 3)                      # full_every=3: whole again
    assert engine.metrics()["sync/delta"] == 0.0
    samples = _samples(tokenizer, 2, 2)
    engine.generate(samples, SamplingParams(1.0, 1.0, 6), torch.Generator().manual_seed(1))
    assert all(s.versions == [3] * len(s.response_ids) for s in samples)
    recompute_old_logprobs(model, samples, tokenizer.token_to_id("<|pad|>"), 1.0)
    assert all(s.train_logprobs == pytest.approx(s.rollout_logprobs, abs=1e-4) for s in samples)


def test_a_server_that_missed_a_version_is_named_with_the_tensor(served):
    engine, model, root = served
    before = engine.version
    _nudge(model, every=1)
    # version 9 published by hand and loaded by server 0 alone: server 1 still holds the last one
    weights = engine.weights
    weight_sync.publish(weights, 9, model.state_dict(), config_json=model.config.model_dump_json())
    engine._load(engine.servers[0], 9)
    with pytest.raises(EngineFailed, match=r"native server 1 .* reports version %d, expected 9" % before):
        engine.verify(engine.servers[1], 9)
    # a server that reports the right version but holds a stale tensor: version 10 is rewritten
    # (one tensor changed) after server 1 loaded it
    weight_sync.publish(weights, 10, model.state_dict(), config_json=model.config.model_dump_json())
    engine._load(engine.servers[1], 10)
    stale = dict(model.state_dict())
    name = sorted(stale)[5]
    stale[name] = stale[name] + 1
    weight_sync.publish(weights, 10, stale, config_json=model.config.model_dump_json())
    with pytest.raises(EngineFailed, match=rf"native server 1 .* holds {name} other than version 10"):
        engine.verify(engine.servers[1], 10)
    engine.sync(model, 11)                      # a full sync puts every server right again
    for s in engine.servers:
        engine.verify(s, 11)


def test_a_killed_server_is_replaced_at_the_current_version_and_answers_the_same(tokenizer, tmp_path):
    model = small_model(tokenizer.get_vocab_size(), seed=2)
    with _open(tokenizer, model, tmp_path) as engine:
        engine.sync(model, 0)
        _nudge(model)
        engine.sync(model, 1)                   # the replacement replays 0 then the delta 1
        samples = _samples(tokenizer, 4, 3)
        engine.generate(samples, SamplingParams(1.0, 1.0, 8), torch.Generator().manual_seed(5))
        pids = [s.proc.pid for s in engine.servers]
        os.killpg(pids[0], signal.SIGKILL)      # the guard and its server: a node that died
        again = copy.deepcopy(samples)
        engine.generate(again, SamplingParams(1.0, 1.0, 8), torch.Generator().manual_seed(5))
        assert _tokens(again) == _tokens(samples)
        assert engine.restarts == 1 and engine.metrics()["servers/restarts"] == 1
        engine.verify(engine.servers[0], 1)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)
    assert all(s.proc is None for s in engine.servers)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_int4_servers_sample_from_the_fake_quantized_copy(tokenizer, tmp_path):
    model = small_model(tokenizer.get_vocab_size())
    stops = [tokenizer.token_to_id(t) for t in STOP_TOKENS]
    cfg = ServerPoolConfig(replicas=1)
    with ServedEngine(model, tokenizer, stops, tokenizer.token_to_id("<|pad|>"), cfg, tmp_path,
                      int4=QATConfig(group_size=16)) as engine:
        engine.sync(model, 0)
        samples = _samples(tokenizer)
        engine.generate(samples, SamplingParams(1.0, 1.0, 8), torch.Generator().manual_seed(0))
    recompute_old_logprobs(model, samples, tokenizer.token_to_id("<|pad|>"), 1.0)
    gap = max(abs(a - b) for s in samples for a, b in zip(s.train_logprobs, s.rollout_logprobs))
    assert gap > 1e-3


def test_served_judges_answer_as_the_models_in_process(tokenizer, tmp_path):
    """A judge's pool: the GRM's first-token distribution and greedy completions, and the ORM's
    scores, equal the same models run in this process."""
    from model.hf import save_state
    from rl.orm import RewardModel, save_reward_model
    from rl.rollout import RolloutEngine

    vocab = tokenizer.get_vocab_size()
    grm = small_model(vocab, seed=4)
    save_state(grm, tmp_path / "grm.safetensors")
    orm = RewardModel(small_model(vocab, seed=5), tokenizer.token_to_id("<|pad|>"))
    with torch.no_grad():
        orm.head.weight.normal_()
        orm.likelihood.weight.normal_()
    save_reward_model(orm, tmp_path / "orm", {"max_len": 48, "score_mean": 0.0, "score_std": 1.0})
    stops = [tokenizer.token_to_id(t) for t in STOP_TOKENS]
    pad = tokenizer.token_to_id("<|pad|>")
    prefixes = [prompt_ids(tokenizer, t) for t in arithmetic.tasks(5, "train", seed=1)]
    cfg = ServerPoolConfig(replicas=2)
    with ServedEngine(None, tokenizer, stops, pad, cfg, tmp_path / "g") as g, \
            ServedEngine(None, tokenizer, stops, pad, cfg, tmp_path / "o") as o:
        g.serve_file(tmp_path / "grm.safetensors")
        o.serve_orm(tmp_path / "orm")
        local = RolloutEngine(grm, tokenizer, stops, pad)
        assert torch.allclose(g.next_token_logprobs(prefixes), local.next_token_logprobs(prefixes), atol=1e-5)
        greedy = SamplingParams(0.0, 1.0, 6)
        served, here = g.complete(prefixes, greedy, torch.Generator()), local.complete(prefixes, greedy, torch.Generator())
        assert [(c[0], c[2]) for c in served] == [(c[0], c[2]) for c in here]      # tokens, stopped
        assert [c[1] for c in served] == [pytest.approx(c[1], abs=1e-5) for c in here]
        items = [(p + [5, 6, 7], len(p)) for p in prefixes]
        assert torch.allclose(o.score_ids(items, batch=2), orm.score_ids(items), atol=1e-5)
        # a server killed (-9) is started again with the ORM and checked, by the watchdog
        os.killpg(o.servers[0].proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (o.restarts == 1 and (o.servers[0].health() or {}).get("version") == 0):
            time.sleep(0.2)
        assert o.restarts == 1 and o.servers[0].health() == {"version": 0}
        assert torch.allclose(o.score_ids(items, batch=1), orm.score_ids(items), atol=1e-5)
