"""runtime.gpus: the GPUs a stage takes on its node, held with lock files so two stages never
share one; tasks.stage_task.gpu_slots: the cluster-wide count in Prefect's concurrency limit."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from glmforge.config import load_config
from runtime.gpus import GpuShortage, claim_gpus, stage_gpus, visible_gpus
from glmforge.pipeline import STAGES
from tests.conftest import REPO

SPECS = {s.name: s for s in STAGES}


def test_visible_gpus_read_cuda_visible_devices_then_the_device_files(tmp_path):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,2"}) == ["0", "2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,3"}) == ["1"]   # CUDA stops at the first invalid entry
    for name in ("nvidia1", "nvidia0", "nvidiactl", "nvidia-uvm", "nvidia10"):
        (tmp_path / name).touch()
    assert visible_gpus({}, dev=tmp_path) == ["0", "1", "10"]
    assert visible_gpus({}, dev=tmp_path / "none") == []


def test_a_stage_takes_its_ranks_and_the_servers_it_starts():
    tiny = load_config(preset="tiny")
    assert stage_gpus(SPECS["ingest"], tiny.ingest) == 0
    assert stage_gpus(SPECS["pretrain"], tiny.pretrain) == tiny.pretrain.launch.nproc_per_node == 2
    glm5 = load_config(preset="glm5")
    assert stage_gpus(SPECS["pretrain"], glm5.pretrain) == 8
    # glm5's RL pools run in the cluster (urls): the stage holds its 8 ranks' GPUs on its node
    assert stage_gpus(SPECS["rl-general"], glm5.rl_general) == 8
    served = load_config(preset="tiny", overrides=[
        "rl_reasoning.parallel.launch.nproc_per_node=2", "rl_reasoning.rollout.backend=served",
        "rl_reasoning.rollout.servers={engine: vllm, replicas: 2, gpus_per_replica: 2}",
        "distill.rollout.backend=served", "distill.teacher_servers={replicas: 2}"])
    assert stage_gpus(SPECS["rl-reasoning"], served.rl_reasoning) == 2 + 2 * 2
    d = served.distill
    assert stage_gpus(SPECS["distill"], d) == (d.parallel.launch.nproc_per_node + d.rollout.servers.replicas
                                               + 2 * len(d.teachers))   # a pool per teacher


HOLDER = """
import sys, time
from runtime.gpus import claim_gpus
with claim_gpus("pretrain", 2, ["0", "1", "2"], lock_dir=__import__("pathlib").Path(sys.argv[1])) as got:
    import os
    print(os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
    time.sleep(600)
"""


def test_two_stages_never_hold_the_same_gpu_and_a_killed_holder_frees_its_own(tmp_path, caplog):
    locks = tmp_path / "locks"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(locks)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        held_there = holder.stdout.readline().strip().split(",")
        assert held_there == ["0", "1"]
        before = os.environ.get("CUDA_VISIBLE_DEVICES")
        with claim_gpus("sft", 1, ["0", "1", "2"], lock_dir=locks) as got:
            assert got == ["2"] and os.environ["CUDA_VISIBLE_DEVICES"] == "2"
        assert os.environ.get("CUDA_VISIBLE_DEVICES") == before
        with caplog.at_level("INFO", logger="glmforge"), pytest.raises(TimeoutError, match="2 GPUs not free"):
            with claim_gpus("sft", 2, ["0", "1", "2"], lock_dir=locks, poll_s=0.1, wait_s=0.5):
                pass
        assert "held by pretrain (pid" in caplog.text      # who it waits for
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        t0 = time.monotonic()
        with claim_gpus("sft", 2, ["0", "1", "2"], lock_dir=locks, poll_s=0.1) as got:
            assert got == ["0", "1"]
        assert time.monotonic() - t0 < 2
    finally:
        holder.kill()
        holder.wait()


def test_more_gpus_than_the_machine_has_is_refused_and_no_gpus_claims_nothing(tmp_path):
    with pytest.raises(GpuShortage, match="pretrain needs 4 GPUs; this machine shows 3"):
        with claim_gpus("pretrain", 4, ["0", "1", "2"], lock_dir=tmp_path):
            pass
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    with claim_gpus("pretrain", 2, [], lock_dir=tmp_path) as got:
        assert got == [] and os.environ.get("CUDA_VISIBLE_DEVICES") == before
    assert not list(tmp_path.iterdir())


def test_gpu_slots_keep_two_flows_off_the_same_gpus(prefect_server):
    """Limit 2 (as `glmforge serve` sets on a 2-GPU machine), two flows wanting 2 each: one waits."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    from runtime.gpus import CONCURRENCY_LIMIT
    from tasks.stage_task import gpu_slots

    with get_client(sync_client=True) as client:
        try:
            client.delete_global_concurrency_limit_by_name(CONCURRENCY_LIMIT)
        except Exception:
            pass
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=CONCURRENCY_LIMIT, limit=2))
    spans = []

    @flow
    def stage(seconds: float):
        with gpu_slots(2):
            t0 = time.monotonic()
            time.sleep(seconds)
            spans.append((t0, time.monotonic()))

    try:
        threads = [threading.Thread(target=stage, args=(1.5,)) for _ in range(2)]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        assert len(spans) == 2
        (a0, a1), (b0, b1) = sorted(spans)
        assert b0 >= a1 - 0.05, spans            # the second held its slots only after the first let go
        with gpu_slots(0):                       # a stage without GPUs takes no slot
            pass
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(CONCURRENCY_LIMIT)
