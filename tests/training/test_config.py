"""Config validation (which DeepSpeed/ZeRO/optimizer combinations are refused), the launch
command line, LR schedules and the context-phase data mix."""
from __future__ import annotations

import math

import pytest

from data_processing.document import Document
from training.config import ContextConfig, LaunchConfig, MixConfig, PretrainConfig, TrainConfig
from training.engine import ds_config
from training.launch import command
from training.longdata import mix_weight
from training.schedule import lr_factor
from glmforge.pipeline import TRAINING
from training.drivers import model_config_for


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("opt", ["muon", "muon_split"])
def test_client_muon_needs_zero_0(opt, zero):
    with pytest.raises(ValueError, match="flattened 1-D partitions"):
        TrainConfig(optimizer=opt, zero_stage=zero)


def test_supported_combinations_validate():
    for opt, zero in [("muon", 0), ("muon_split", 0), ("deepspeed_muon", 0), ("adamw", 0), ("adamw", 2)]:
        TrainConfig(optimizer=opt, zero_stage=zero)
    TrainConfig(optimizer="deepspeed_muon", zero_stage=2, grad_clip=0)
    with pytest.raises(ValueError, match="grad_clip"):
        TrainConfig(optimizer="deepspeed_muon", zero_stage=1, grad_clip=1.0)
    with pytest.raises(ValueError):
        TrainConfig(zero_stage=3)
    with pytest.raises(ValueError):
        TrainConfig(unknown_field=1)


def test_deepspeed_config_per_combination():
    bf16 = ds_config(TrainConfig(precision="bf16"), cuda=True, n_params=10)
    assert bf16["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and "bf16" not in bf16
    assert "optimizer" not in bf16                                  # client optimizer
    ds = ds_config(TrainConfig(optimizer="deepspeed_muon", zero_stage=2, grad_clip=0, precision="bf16"), True, 10)
    assert ds["bf16"] == {"enabled": True} and ds["optimizer"]["type"] == "Muon"
    assert ds["optimizer"]["params"]["per_head_muon"] and ds["zero_optimization"]["stage"] == 2
    assert ds_config(TrainConfig(optimizer="adamw"), False, 10)["optimizer"]["params"]["torch_adam"]
    with pytest.raises(ValueError, match="CUDA"):
        ds_config(TrainConfig(precision="bf16"), cuda=False, n_params=10)


def test_expert_parallel_is_checked_when_the_config_is_read():
    from runtime.runner import key_config

    four = {"nproc_per_node": 4}
    cfg = PretrainConfig(expert_parallel=2, launch=four)                 # tiny: 8 experts, 4 ranks
    assert ds_config(cfg, False, 10)["gradient_clipping"] == 0.0           # ZeRO 0: the loop clips (whole norm)
    assert ds_config(PretrainConfig(), False, 10)["gradient_clipping"] == 1.0
    zero2 = PretrainConfig(expert_parallel=2, optimizer="adamw", zero_stage=2, launch=four)
    assert ds_config(zero2, False, 10)["gradient_clipping"] == 1.0         # ZeRO 1/2: DeepSpeed's MoE-aware norm
    assert key_config(cfg)["expert_parallel"] == 2                          # in the stage key
    PretrainConfig(expert_parallel=4, launch={"nproc_per_node": 2, "nnodes": 2, "master_addr": "10.0.0.1",
                                              "master_port": 29500})
    with pytest.raises(ValueError, match=r"expert_parallel=3 must divide the world size \(launch.world_size = "
                                         r"nproc_per_node x nnodes = 4\)"):
        TrainConfig(expert_parallel=3, launch=four)
    with pytest.raises(ValueError, match="expert_parallel=4 must divide the model's n_routed_experts=6"):
        PretrainConfig(model_overrides={"n_routed_experts": 6}, expert_parallel=4, launch=four)
    for stage in (1, 2):                                  # DeepSpeed's ZeRO optimizer, experts as MoE groups
        TrainConfig(expert_parallel=2, optimizer="adamw", zero_stage=stage, launch=four)
        TrainConfig(expert_parallel=2, optimizer="adamw", zero_stage=stage, precision="bf16", launch=four)
        TrainConfig(expert_parallel=2, optimizer="deepspeed_muon", zero_stage=stage, grad_clip=0, launch=four)
    with pytest.raises(ValueError, match="precision bf16 and zero_stage 0 needs optimizer muon or muon_split.*"
                                         "use zero_stage 1 or 2"):
        TrainConfig(expert_parallel=2, optimizer="adamw", precision="bf16", launch=four)
    TrainConfig(expert_parallel=2, optimizer="muon_split", precision="bf16", launch=four)
    with pytest.raises(ValueError, match="optimizer 'muon_split' .* needs zero_stage 0"):   # the client Muon
        TrainConfig(expert_parallel=2, optimizer="muon_split", zero_stage=2, launch=four)
    with pytest.raises(ValueError):
        TrainConfig(expert_parallel=0)


def test_launch_validation_and_commands(tmp_path):
    with pytest.raises(ValueError, match="launcher: deepspeed"):
        LaunchConfig(hostfile="hosts")
    with pytest.raises(ValueError, match="master_addr"):
        LaunchConfig(nnodes=2, master_port=29500)
    with pytest.raises(ValueError, match="master_port"):
        LaunchConfig(nnodes=2, master_addr="10.0.0.1")
    cmd = command(LaunchConfig(nproc_per_node=2), tmp_path / "s.json", 1234)    # one node: no torchrun agent
    assert cmd[1:3] == ["-m", "training.spawn"] and "--nproc_per_node=2" in cmd and "--master_port=1234" in cmd
    assert cmd[-3:] == ["-m", "training.launch", str(tmp_path / "s.json")]
    two = LaunchConfig(nproc_per_node=2, nnodes=2, master_addr="10.0.0.1", master_port=29500)
    assert command(two, tmp_path / "s.json", 29500)[1:3] == ["-m", "torch.distributed.run"]
    multi = LaunchConfig(launcher="deepspeed", hostfile="/etc/hosts.ds", nnodes=4, nproc_per_node=8,
                         master_addr="10.0.0.1", master_port=29500)
    cmd = command(multi, tmp_path / "s.json", 29500)
    assert "--hostfile=/etc/hosts.ds" in cmd and "--num_nodes=4" in cmd and "--module" in cmd
    assert "--master_addr=10.0.0.1" in cmd and multi.world_size == 32
    # without master_addr the DeepSpeed launcher takes the hostfile's first host
    cmd = command(LaunchConfig(launcher="deepspeed", hostfile="h", nnodes=2, master_port=29500), tmp_path / "s.json", 29500)
    assert not any(c.startswith("--master_addr") for c in cmd)
    assert "--master_addr=127.0.0.1" in command(LaunchConfig(nproc_per_node=2), tmp_path / "s.json", 1)
    # one rank on one node runs as itself (run_ranks gives it torchrun's variables)
    assert command(LaunchConfig(), tmp_path / "s.json", 1)[1:] == ["-m", "training.launch", str(tmp_path / "s.json")]
    assert "--module" in command(LaunchConfig(launcher="deepspeed"), tmp_path / "s.json", 1)


def test_steps_from_token_budget():
    cfg = TrainConfig(micro_batch_size=2, grad_accum=2, token_budget=10_000, max_steps=1000,
                      launch={"nproc_per_node": 2})
    assert cfg.steps_for(100) == 10_000 // (2 * 2 * 2 * 100)
    assert TrainConfig(max_steps=7).steps_for(100) == 7


def test_schedules():
    total = 100
    cos = [lr_factor(s, total, "cosine", warmup=10, min_ratio=0.1) for s in range(total)]
    assert cos[0] == pytest.approx(0.1) and cos[9] == 1.0 and cos[10] == 1.0
    assert cos[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(cos[10:], cos[11:]))
    assert cos[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 89)))
    wsd = [lr_factor(s, total, "wsd", warmup=0, min_ratio=0.0, decay_fraction=0.2) for s in range(total)]
    assert wsd[:80] == [1.0] * 80 and wsd[-1] == pytest.approx(0.0) and wsd[80] == pytest.approx(1 - 1 / 20)
    assert lr_factor(5, 10, "constant") == 1.0
    with pytest.raises(AssertionError):
        lr_factor(10, 10, "cosine")


def test_vocab_comes_from_the_tokenizer():
    cfg = PretrainConfig(model_preset="tiny")
    assert model_config_for(cfg, 5000).vocab_size == 5000
    assert model_config_for(PretrainConfig(model_overrides={"vocab_size": 5056}), 5000).vocab_size == 5056
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        model_config_for(PretrainConfig(model_overrides={"vocab_size": 4000}), 5000)
    with pytest.raises(ValueError, match="valid tiny model"):
        PretrainConfig(model_overrides={"num_layers": 0})
    with pytest.raises(ValueError, match="only DSA layers"):     # would fail at the HF export
        PretrainConfig(model_overrides={"attention_pattern": ["full", "dsa", "dsa", "dsa"]})


def test_mix_weights_favour_long_code_and_issue_pr():
    mix = MixConfig(sources={"issue-pr": 3.0, "stdlib": 2.0}, default_weight=0.5, long_chars=100, long_weight=2.0)
    short_prose = Document("a", "x" * 50, "shakespeare")
    long_code = Document("b", "x" * 500, "stdlib", {"quality": {"weight": 1.5}})
    assert mix_weight(short_prose, mix) == 0.5
    assert mix_weight(long_code, mix) == 1.5 * 2.0 * 2.0
    assert mix_weight(Document("c", "x" * 50, "issue-pr"), mix) == 3.0
    with pytest.raises(ValueError):
        MixConfig(sources={"x": -1.0})


def test_stage_registry():
    by = {s.name: s for s in TRAINING}
    assert list(by)[:4] == ["pretrain", "context-1", "context-2", "context-3"]
    assert by["pretrain"].parents == ("pack", "tokenize") and by["pretrain"].config_cls is PretrainConfig
    assert by["context-2"].parents == ("context-1", "decontaminate", "tokenize")
    assert all(by[f"context-{k}"].config_cls is ContextConfig for k in (1, 2, 3))
    assert by["context-3"].run.__name__ == "run" and by["context-3"].run is not by["context-2"].run


def test_long_context_packing_keeps_the_favoured_sources_under_a_cap(packed, tmp_path):
    from data_processing.document import ShardWriter
    from data_processing.packing import PackedDataset
    from tests.training.conftest import stdlib_docs
    from training.longdata import MARKER, pack_long

    docs = stdlib_docs(30)
    threads = [Document(f"pr-{i}", d.text, "issue-pr") for i, d in enumerate(docs[:2])]
    w = ShardWriter(tmp_path / "docs", 100)
    w.write_all(threads + docs[2:])
    w.close()
    mix = MixConfig(sources={"issue-pr": 50.0}, default_weight=1.0, long_weight=1.0, max_chars=20_000)
    meta = pack_long(tmp_path / "docs", packed["tokenize"], tmp_path / "out", 128, mix, 0.2, seed=3)
    assert meta["mix_chars_share"]["issue-pr"] > 0.5 and meta["documents_in_mix"] < 30
    assert PackedDataset(tmp_path / "out", "train").seq_len == 128 and (tmp_path / "out" / MARKER).exists()
    again = pack_long(tmp_path / "docs", packed["tokenize"], tmp_path / "out", 128, mix, 0.2, seed=3)
    assert again == meta                                             # a retry reuses the packed data


def test_long_context_cap_cuts_a_document_larger_than_the_whole_budget(packed, tmp_path):
    """A repository-level document can be the whole corpus: the cap holds, cut at a line end."""
    from data_processing.document import ShardWriter
    from training.longdata import pack_long

    lines = [f"line {i}: " + "word " * (i % 13) for i in range(20_000)]
    w = ShardWriter(tmp_path / "docs", 100)
    threads = [Document(f"pr-{i}", f"thread {i} " * 200, "issue-pr") for i in range(4)]   # ~2K chars each
    w.write_all([Document("repo:big", "\n".join(lines), "stdlib"), *threads])
    w.close()
    mix = MixConfig(sources={"stdlib": 1.0, "issue-pr": 3.0}, long_weight=1.0, max_chars=30_000, max_repeats=1.0)
    meta = pack_long(tmp_path / "docs", packed["tokenize"], tmp_path / "out", 128, mix, 0.2, seed=3)
    assert meta["documents_in_mix"] == 5                      # the threads, then the big one cut to fit
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    assert 30_000 / 8 < tokens < 30_000 + 10, tokens        # not the 300K-character document


def test_failure_messages_name_the_rank():
    from collections import deque

    from training.launch import _failure

    torchrun = deque(["[rank1]: ValueError: boom", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
                      "Failures:", "  rank      : 0 (local_rank: 0)", "  exitcode  : -15 (pid: 1)",
                      "Root Cause (first observed failure):", "  rank      : 1 (local_rank: 1)",
                      "  exitcode  : -9 (pid: 2)"])
    msg = _failure(1, torchrun)
    assert msg.startswith("training failed: rank 1 failed (killed by signal 9)") and "ValueError: boom" in msg
    ds = deque(["Traceback ...", "RuntimeError: bad", "[INFO] [launch.py:253:sigkill_handler] Killing subprocess 7",
                "[ERROR] [launch.py:259:sigkill_handler] ['python', '-u', '-m', 'training.launch', "
                "'--local_rank=1', 'spec.json'] exits with return code = 1"])
    msg = _failure(1, ds)
    assert "local rank 1 failed (exit code 1)" in msg and "RuntimeError: bad" in msg
    assert "launcher was killed by signal 9" in _failure(-9, deque(["x"]))
    alone = _failure(-9, deque(["step 3", "RuntimeError: late"]), single=True)     # one rank, no launcher
    assert alone.startswith("training failed: rank 0 failed (killed by signal 9)") and "RuntimeError: late" in alone
    assert "rank 0 failed (exit code 1)" in _failure(1, deque(["x"]), single=True)


def test_a_single_rank_is_its_own_launcher_for_stop_signals():
    """run_ranks forwards a stop to rank_pids(launched pid); one rank on one node is the launched
    process itself (no torchrun above it), so it must be among them, and a launcher never is."""
    import subprocess
    import sys

    from training.launch import rank_pids

    sleep = "import time; time.sleep(30)"
    alone = subprocess.Popen([sys.executable, "-c", sleep, "-m", "training.launch", "spec.json"])
    launcher = subprocess.Popen([sys.executable, "-c", sleep, "torch.distributed.run", "-m", "training.launch"])
    spawner = subprocess.Popen([sys.executable, "-c", sleep, "training.spawn", "-m", "training.launch"])
    try:
        assert rank_pids(alone.pid) == [alone.pid]
        assert rank_pids(launcher.pid) == [] and rank_pids(spawner.pid) == []
    finally:
        for p in (alone, launcher, spawner):
            p.kill()
            p.wait()
