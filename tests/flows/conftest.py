"""One tiny pipeline run per test session, shared by the resume and deployment tests, and one
`glmforge serve` (server, deployments, process worker) over a copy of it, shared by every test
that runs deployments through a worker.

FAST cuts the tiny preset to a few hundred documents and one or two optimizer steps per
training stage on one rank: every stage still runs its real code and publishes a real artifact,
in a few minutes on 2 CPU cores (most of it is starting the training ranks, once per stage)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime import shutdown
from tests._processes import alive, port_open, session_members

REPO = Path(__file__).resolve().parents[2]

_CONTEXT = ["max_steps=1", "eval_sequences=1", "launch.nproc_per_node=1", "seq_len=256", "retrieval.docs_per_task=0",
            "retrieval.key_value_docs=0"]
_DSA = ["max_steps=1", "eval_sequences=1", "launch.nproc_per_node=1", "seq_len=256", "retrieval.docs_per_task=1",
        "retrieval.lengths=[128]", "retrieval.key_value_docs=0"]
FAST: list[str] = [
    "ingest.sources=[{name: shakespeare, path: '{samples}/tinyshakespeare/input.txt', format: text, "
    "split_on: \"\\n\\n\", max_documents: 300}, {name: gsm8k, path: '{samples}/gsm8k/train.jsonl', "
    "text_template: \"Question: {question}\\nAnswer: {answer}\", max_documents: 300}, {name: stdlib, "
    "path: '{stdlib}', include: '*.py', repo: cpython-stdlib, max_documents: 60, max_file_bytes: 200000}]",
    "tokenize.vocab_size=1024",
    "pretrain.max_steps=6", "pretrain.checkpoint_every=2", "pretrain.eval_sequences=2", "pretrain.launch.nproc_per_node=1",
    *[f"{s}.{o}" for s in ("context_1", "context_2", "context_3") for o in _CONTEXT],
    *[f"{s}.{o}" for s in ("dsa_warmup", "dsa_adapt") for o in _DSA],
    "dsa_warmup.probe_sequences=1", "dsa_adapt.long_eval.n_per_task=1",
    "dsa_adapt.long_eval.lengths=[128]",
    "sft.max_steps=2", "sft.launch.nproc_per_node=1", "sft.eval_sequences=2",
    "sft.eval_gsm8k=1", "sft.max_new_tokens=4", "sft.seq_len=256",
    "sft.data={reasoning: 8, tool_calc: 4, tool_docs: 4, code: 4, arithmetic: 16, val_per_kind: 2}",
    "rl_prompts.candidates=4", "rl_prompts.samples=2", "rl_prompts.chunk=2",
    "rl_reasoning.steps=1", "rl_reasoning.prompts_per_step=2", "rl_reasoning.group_size=2", "rl_reasoning.minibatches=1",
    "rl_reasoning.heldout=2", "rl_reasoning.gsm8k_test=1", "rl_reasoning.gsm8k_max_new_tokens=4",
    "rl_reasoning.examples=1",
    *[f"{s}.gates.evals={{arithmetic: 2, gsm8k: 1, gsm8k_max_new_tokens: 2, tool: 1, tool_max_new_tokens: 2}}"
      for s in ("rl_reasoning", "rl_agentic", "rl_general", "distill")],
    # two-step runs say nothing about regressions: the gates record, they do not fail here
    *[f"{s}.gates.tolerances={{arithmetic_acc: 1, gsm8k_acc: 1, heldout_ppl: 100, tool_call_validity: 1}}"
      for s in ("rl_reasoning", "rl_agentic", "rl_general", "distill")],
    "rl_agentic.steps=1", "rl_agentic.prompts_per_step=2", "rl_agentic.group_size=2", "rl_agentic.workers=1",
    "rl_agentic.max_turns=1", "rl_agentic.max_new_tokens=4", "rl_agentic.heldout=1",
    "reward_model.steps=2", "reward_model.batch_pairs=2", "reward_model.gsm8k_pairs=16", "reward_model.mbpp_pairs=4",
    "reward_model.arithmetic_pairs=16", "reward_model.max_len=64", "reward_model.heldout_percent=30",
    "rl_general.steps=1", "rl_general.prompts_per_step=2", "rl_general.group_size=2", "rl_general.max_new_tokens=4",
    "rl_general.grm_max_new_tokens=1", "rl_general.minibatches=1",
    "distill.steps=1", "distill.prompts_per_teacher=1", "distill.max_new_tokens=4",
]


@dataclass
class TinyRun:
    home: Path            # GLMFORGE_HOME of the run (its store is home/store)
    run_id: str
    keys: dict[str, str]  # stage -> artifact key
    work_keys: dict[str, str]  # stage -> key of its working folder and mirrored checkpoint
    seconds: float


@pytest.fixture(scope="session")
def tracking_server(tmp_path_factory):
    """One MLflow tracking server for the session (tests/_mlflow.py); the tiny run reports to it."""
    from tests._mlflow import mlflow_server

    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


def tracked(uri: str, experiment: str) -> list[str]:
    return ["tracking.backend=mlflow", f"tracking.uri={uri}", f"tracking.experiment={experiment}"]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tracking_server) -> TinyRun:
    """Every registered stage run once with FAST, through the plain runner (no Prefect), tracked
    in MLflow (experiment `tiny-run`; tests/flows/test_tracking.py reads it back)."""
    from glmforge.config import load_config
    from glmforge.pipeline import STAGES
    from runtime.runner import Runner, RunRecord, execute
    from runtime.store import LocalStore

    home = tmp_path_factory.mktemp("tiny-run")
    overrides = [*FAST, *tracked(tracking_server.uri, "tiny-run")]
    cfg = load_config("tiny", None, overrides)
    runner = Runner(cfg, LocalStore(home / "store"), STAGES, home=home)
    record = RunRecord.new(cfg, {"preset": "tiny", "config_file": None, "overrides": overrides, "until": None},
                           [s.name for s in STAGES])
    start = time.monotonic()
    results = execute(runner, STAGES, record)
    took = time.monotonic() - start
    print(f"\ntiny_run: {len(results)} stages in {took:.0f} s")
    work_keys = {s.name: runner.work_key(s, {p: results[p].manifest for p in s.parents}) for s in STAGES}
    return TinyRun(home, record.id, {n: r.key for n, r in results.items()}, work_keys, took)


@dataclass
class Served:
    base: str             # the UI, http://127.0.0.1:PORT
    api: str              # PREFECT_API_URL
    env: dict[str, str]   # for `prefect` / `glmforge` commands against it
    home: Path            # GLMFORGE_HOME of its worker: a copy of tiny_run's
    log: Path             # serve's output: server, deployments, worker and flow runs
    pool: str
    pid: int              # the `glmforge serve` process (the worker and its flow runs are below it)

    def logs(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


# The zombie and abandoned-cancel automations of deployments/automations.yaml wait 90 and 120 s
# (heartbeats every 30 s, Prefect's shortest); `served` installs a copy that waits ZOMBIE_S and
# SETTLE_S.
ZOMBIE_S, SETTLE_S = 50, 20


def quick_automations(dest: Path) -> Path:
    import yaml

    from glmforge.serve import AUTOMATIONS

    spec = yaml.safe_load(AUTOMATIONS.read_text())
    within = {"glmforge-crash-zombie-runs": ZOMBIE_S, "glmforge-settle-abandoned-cancels": SETTLE_S}
    for a in spec["automations"]:
        if a["name"] in within:
            a["trigger"]["within"] = within.pop(a["name"])
    assert not within, f"not in {AUTOMATIONS}: {within}"
    dest.write_text(yaml.safe_dump(spec, sort_keys=False))
    return dest


@pytest.fixture(scope="package")
def served(tiny_run, tmp_path_factory) -> Served:
    """`glmforge serve --pool ops-pool` as a user starts it, its worker's GLMFORGE_HOME a copy of
    the tiny run's home (every stage published there: a pipeline deployment is cached, and a
    stage with parents finds them). Started once: a server, ~20 deployments and a worker take
    about 40 s on 2 cores. Short scheduler and worker polling for the schedule test; stopped
    when the tests of this folder are done (idle, it takes ~17% of a core). Its zombie and
    abandoned-cancel automations wait ZOMBIE_S and SETTLE_S (quick_automations)."""
    from tests.conftest import free_port

    root = tmp_path_factory.mktemp("served")
    home = root / "home"
    shutil.copytree(tiny_run.home, home, symlinks=True)
    (root / "prefect-home").mkdir()
    port, pool = free_port(), "ops-pool"
    env = {**os.environ, "PREFECT_HOME": str(root / "prefect-home"), "GLMFORGE_HOME": str(home),
           "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log = root / "serve.log"
    automations = quick_automations(root / "automations.yaml")
    proc = subprocess.Popen([sys.executable, "-m", "glmforge.cli", "serve", "--port", str(port), "--pool", pool,
                             "--automations", str(automations)],
                            env=env, cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while "Prefect UI:" not in log.read_text(errors="replace"):  # printed once the worker is started
            assert proc.poll() is None, f"glmforge serve exited {proc.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"glmforge serve not ready after 300 s:\n{log.read_text()[-4000:]}"
            time.sleep(1)
        yield Served(base, f"{base}/api", {**env, "PREFECT_API_URL": f"{base}/api"}, home, log, pool, proc.pid)
    except BaseException:
        proc.kill()
        raise
    # Stopped as a pod is (SIGTERM): serve stops its worker and server itself, and leaves no
    # process, no session and no open port behind (checked here rather than by a serve of its own)
    descendants = shutdown.descendants(proc.pid)
    sessions = {pid for pid in descendants if os.getsid(pid) == pid}   # the server's and the worker's
    assert len(sessions) >= 2 and port_open(port), descendants
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert rc == 0 and "stopping" in log.read_text(errors="replace"), log.read_text(errors="replace")[-3000:]
    assert [pid for pid in descendants if alive(pid)] == []
    assert all(session_members(s) == [] for s in sessions)
    assert not port_open(port)
