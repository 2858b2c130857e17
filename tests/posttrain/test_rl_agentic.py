"""The rl-agentic stage on a tiny random model: async vs synchronous, worker loss, exact resume."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from runtime.stage import Workdir
from model.hf import save_state
from posttrain.rl_agentic import RLAgenticConfig, run_rl_agentic
from tests.posttrain.conftest import Killed, kill_at
from tests.rl.conftest import small_model


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from data_processing.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("agentic_inputs")
    tok = train_tokenizer([" 1 2 + 3 4 = 6 4 0", " 9 9 + 9 9 = 8 9 1", "calculator expression 12+34"] * 40,
                          vocab_size=300, min_frequency=2)
    (root / "tokenize").mkdir()
    tok.save(str(root / "tokenize" / "tokenizer.json"))
    save_state(small_model(tok.get_vocab_size()), root / "rl-reasoning" / "consolidated.safetensors")
    return {"tokenize": root / "tokenize", "rl-reasoning": root / "rl-reasoning"}


def _cfg(**kw) -> RLAgenticConfig:
    base = dict(steps=3, prompts_per_step=2, group_size=3, optim={"lr": 1e-3}, max_new_tokens=6, max_turns=2, heldout=2,
                workers=1, eta=0, tau=0, sync_every=1, checkpoint_every=1, environments={"calc_arith": 1.0},
                gates={"evals": {"arithmetic": 4, "gsm8k": 2, "gsm8k_max_new_tokens": 4, "tool": 2, "tool_max_new_tokens": 4}})
    return RLAgenticConfig(**{**base, **kw})


def _records(root):
    return [json.loads(x) for x in (root / "out" / "metrics.jsonl").read_text().splitlines()]


def test_tau0_k1_one_worker_reproduces_synchronous_training(inputs, tmp_path):
    sync = run_rl_agentic(_cfg(synchronous=True), inputs, Workdir.at(tmp_path / "sync", seed=5))
    asyn = run_rl_agentic(_cfg(), inputs, Workdir.at(tmp_path / "async", seed=5))
    a, b = _records(tmp_path / "sync"), _records(tmp_path / "async")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["groups"] for r in a] == [r["groups"] for r in b] == [[0, 1], [2, 3], [4, 5]]
    wa = load_file(tmp_path / "sync" / "out" / "consolidated.safetensors")
    wb = load_file(tmp_path / "async" / "out" / "consolidated.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sync["groups_trained_twice"] == asyn["groups_trained_twice"] == 0
    assert asyn["version_lag_histogram"] == {"0": sum(r["kept"] for r in b)}


def test_async_with_two_workers_trains_every_group_once(inputs, tmp_path):
    m = run_rl_agentic(_cfg(workers=2, eta=1, tau=2, steps=4), inputs, Workdir.at(tmp_path, seed=5))
    rec = _records(tmp_path)
    trained = [g for r in rec for g in r["groups"]]
    assert len(trained) == len(set(trained)) and m["groups_trained"] == len(trained)
    assert set(m["heldout_accuracy"]) == {"calc_arith"}
    # 2 held-out tasks, 8 sampled episodes each (the default), before and after
    hs = m["heldout_sampled_accuracy"]["calc_arith"]
    assert hs["n"] == 2 and hs["samples"] == 8 and 0 <= hs["after"] <= 1 and hs["stderr_after"] >= 0
    assert all(int(k) <= 1 for k in m["version_lag_histogram"])      # eta = 1: at most one version behind


def test_killed_stage_resumes_without_losing_or_repeating_a_group(inputs, tmp_path):
    cfg = _cfg(steps=4, workers=2, eta=1, tau=2)
    with pytest.raises(Killed):
        run_rl_agentic(cfg, inputs, Workdir.at(tmp_path, seed=5, progress=kill_at(3)))
    m = run_rl_agentic(cfg, inputs, Workdir.at(tmp_path, seed=5))
    rec = _records(tmp_path)
    assert [r["step"] for r in rec] == [1, 2, 3, 4]
    trained = [g for r in rec for g in r["groups"]]
    assert len(trained) == len(set(trained)) and m["groups_trained_twice"] == 0


def test_sigterm_stops_the_stage_and_leaves_no_rollout_worker(inputs, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    script = f"""
import sys
from pathlib import Path
from runtime import shutdown
from runtime.stage import Workdir
from posttrain.rl_agentic import RLAgenticConfig, run_rl_agentic
shutdown.install()
cfg = RLAgenticConfig(steps=1000, prompts_per_step=2, group_size=3, max_new_tokens=6, max_turns=2, heldout=1,
                      workers=2, environments={{"calc_arith": 1.0}},
                      gates={{"evals": {{"arithmetic": 1, "gsm8k": 1, "gsm8k_max_new_tokens": 1, "tool": 1, "tool_max_new_tokens": 1}}}})
inputs = {{"tokenize": Path({str(inputs["tokenize"])!r}), "rl-reasoning": Path({str(inputs["rl-reasoning"])!r})}}
try:
    run_rl_agentic(cfg, inputs, Workdir.at(Path({str(tmp_path)!r}), seed=1))
except shutdown.Preempted:
    sys.exit(75)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    workers = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (tmp_path / "checkpoint" / "metrics.jsonl").exists():
        time.sleep(0.5)
    out = subprocess.run(["pgrep", "-f", "rl.rollout_worker"], capture_output=True, text=True).stdout.split()
    workers = [int(p) for p in out if open(f"/proc/{p}/stat").read().split()[3] == str(proc.pid)]
    assert len(workers) >= 2, "the stage never started its rollout workers"
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 75                  # the step in flight finished and was checkpointed
    assert (tmp_path / "checkpoint" / "ckpt" / "latest").exists()
    time.sleep(0.5)
    alive = [p for p in workers if os.path.exists(f"/proc/{p}") and "rl.rollout_worker" in open(f"/proc/{p}/cmdline").read()]
    assert not alive, f"rollout workers outlived the stage: {alive}"


def test_env_args_are_checked_against_the_environment_before_any_work():
    ok = RLAgenticConfig(environments={"calc_arith3": 1.0},
                         env_args={"calc_arith3": {"reverse_digits": True, "schema_in_prompt": False}})
    assert ok.env_args["calc_arith3"]["schema_in_prompt"] is False
    with pytest.raises(ValueError, match=r"env_args.calc_arith: unknown arguments \['reverse'\]; calc_arith takes "
                                         r"reverse_digits, digits, schema_in_prompt"):
        RLAgenticConfig(env_args={"calc_arith": {"reverse": True}})
    with pytest.raises(ValueError, match="env_args: unknown environment 'calc'"):
        RLAgenticConfig(env_args={"calc": {}})
