"""Two "nodes" on this machine: two separate torchrun launchers (--nnodes 2, --node_rank 0 and 1,
one rank each, gloo) rendezvous at node 0's address and train the tiny model for a couple of
steps as one 2-rank job; the commands come from the same launch config. Also: the DeepSpeed
launcher's hostfile from the config."""
from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import pytest

from runtime.stage import Workdir
from tests.training.conftest import MODEL_OVERRIDES
from training import checkpoint, metrics
from training.config import LaunchConfig, PretrainConfig
from training.launch import REPO, free_port, hostfile_text, node_commands
from training.drivers import run_pretrain


def test_two_launchers_as_two_nodes_train_one_job(packed, tmp_path):
    addr = socket.gethostname()       # node 0 by name, as another node would reach it
    launch = dict(nproc_per_node=1, nnodes=2, master_addr=addr, master_port=free_port(), backend="gloo")
    cfg = PretrainConfig(model_overrides=MODEL_OVERRIDES, micro_batch_size=2, max_steps=2, checkpoint_every=2,
                         eval_sequences=4, launch=launch)
    wd = Workdir.at(tmp_path, seed=3)
    wd.persist_checkpoint = lambda: None
    spec_path = wd.checkpoint / "launch.json"
    cmds = node_commands(cfg.launch, spec_path)
    assert [c for c in cmds[1] if c.startswith("--node_rank")] == ["--node_rank=1"]

    result: dict = {}
    node0 = threading.Thread(target=lambda: result.update(run_pretrain(cfg, packed, wd)), daemon=True)
    node0.start()                            # node 0: the stage itself (writes the spec, streams rank 0)
    deadline = time.monotonic() + 60
    while not spec_path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    node1 = subprocess.run(cmds[1], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    node0.join(timeout=240)
    assert node1.returncode == 0, node1.stdout[-3000:] + node1.stderr[-3000:]
    assert result["world_size"] == 2 and result["steps"] == 2
    meta = checkpoint.select_resume(wd.checkpoint)[1]
    assert meta["world_size"] == 2 and len(meta["rng"]) == 2      # both nodes' ranks wrote into it
    assert [r["step"] for r in metrics.read(wd.checkpoint / "metrics.jsonl")] == [1, 2]


def test_hostfile_and_node_commands_from_config():
    cfg = LaunchConfig(launcher="deepspeed", nproc_per_node=8, nnodes=2, master_addr="10.0.0.1", master_port=29500,
                       hostfile="/etc/glmforge/hostfile")
    assert hostfile_text(["gpu-0", "gpu-1"], cfg) == "gpu-0 slots=8\ngpu-1 slots=8\n"
    with pytest.raises(ValueError, match="1 host\\(s\\) given for launch.nnodes=2"):
        hostfile_text(["gpu-0"], cfg)
    with pytest.raises(ValueError, match="starts every node from node 0"):
        node_commands(cfg, REPO / "spec.json")
    tr = LaunchConfig(nproc_per_node=8, nnodes=3, master_addr="10.0.0.1", master_port=29500)
    cmds = node_commands(tr, REPO / "spec.json")
    assert [[a for a in c if a.startswith(("--node_rank", "--master_addr", "--nnodes"))] for c in cmds] == [
        ["--nnodes=3", f"--node_rank={n}", "--master_addr=10.0.0.1"] for n in range(3)]
