"""Rollout workers as processes: a worker killed mid-trajectory loses nothing."""
from __future__ import annotations

import time

from domains import arithmetic
from domains.task import Task
from rl.orchestrator import WorkerPool
from tests.rl.conftest import small_model


def test_killed_worker_is_replaced_and_its_groups_rerouted(tokenizer, tmp_path):
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    model = small_model(tokenizer.get_vocab_size())
    cfg = {"tokenizer": str(tmp_path / "tokenizer.json"), "seed": 0, "max_turns": 2,
           "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}, "int4": None, "batch_size": 8,
           "env_args": {}, "threads": 1}
    tasks = [Task("calc_arith", t.prompt, t.answer, t.meta) for t in arithmetic.tasks(6, "train", 0)]
    with WorkerPool(2, cfg, tmp_path / "weights", heartbeat_s=0.5, dead_after_s=20) as pool:
        pool.publish(model, 0)
        owners = [pool.submit(g, t, 3) for g, t in enumerate(tasks)]
        victim = owners[0]
        pool.kill(victim)                          # while its groups are generating
        got: dict[int, list] = {}
        deadline = time.monotonic() + 120
        while len(got) < len(tasks) and time.monotonic() < deadline:
            for g, samples in pool.poll(timeout=1.0):
                assert g not in got, f"group {g} returned twice"
                got[g] = samples
        assert sorted(got) == list(range(len(tasks)))
        assert pool.restarts == 1 and pool.rerouted >= 1
        assert victim not in pool.workers and len(pool.workers) == 2
        for g, samples in got.items():
            assert len(samples) == 3 and all(s.group == g and s.versions for s in samples)
