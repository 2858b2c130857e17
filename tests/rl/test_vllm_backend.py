"""rollout.backend=vllm: the export vLLM loads, the refusals, the server's guard and environment, the
response parsing (no vLLM needed); then, opt-in (make test-vllm), the engine and the rl-reasoning
stage against real vLLM servers: token ids, weight versions, log-prob parity, weight updates,
a restarted server, and no server left behind after the stage ends or is killed with -9."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from model.config import tiny
from model.hf import from_hf_state_dict, save_dense_mla
from model.model import GLMModel
from rl import vllm_server
from rl.rollout import RolloutConfig, RolloutEngine, SamplingParams, open_engine
from rl.sample import Sample, Status
from rl.vllm_engine import VLLMEngine, check_servable
from rl.vllm_server import EngineFailed, VLLMConfig, VLLMServer
from tests.posttrain._chain import make_tokenizer

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def servable_model(vocab: int, seed: int = 0) -> GLMModel:
    """The smallest model of this family vLLM serves on CPU: GLM-5's latent (512 + 64), dense MLA,
    one dense and one MoE layer."""
    torch.manual_seed(seed)
    return GLMModel(tiny().replace(vocab_size=vocab, num_layers=2, kv_lora_rank=512, qk_rope_head_dim=64,
                                   index_head_dim=64, dense_attention=True, mtp_depth=0, rms_norm_eps=1e-6))


# ---------------------------------------------------------------- without vLLM
def test_dense_mla_export_is_deepseek_v3_without_indexer_or_mtp(tmp_path):
    model = GLMModel(tiny().replace(vocab_size=64, num_layers=2, mtp_depth=1))
    save_dense_mla(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["num_nextn_predict_layers"] == 0
    assert cfg["scoring_func"] == "sigmoid" and cfg["topk_method"] == "noaux_tc"
    assert not any(k.startswith("index") for k in cfg) and "glmforge" not in cfg
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    assert not any(".indexer." in k or k.startswith("model.layers.2.") for k in sd)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in sd          # one tensor per expert
    ours = from_hf_state_dict(sd, model.config.replace(mtp_depth=0))
    own = model.state_dict()
    assert {k for k in own if ".indexer." not in k and not k.startswith("mtp.")} == set(ours)
    assert all(torch.equal(own[k], v) for k, v in ours.items())


def test_models_vllm_cannot_serve_are_refused_before_a_server_starts():
    cfg = VLLMConfig()
    with pytest.raises(ValueError, match=r"512 \+ 64.*32 \+ 16.*docs/guides/vllm.md"):
        check_servable(tiny().replace(vocab_size=64, num_layers=2), cfg, on_gpu=False)
    check_servable(tiny().replace(vocab_size=64, num_layers=2), cfg, on_gpu=True)
    with pytest.raises(ValueError, match="multiple of 32.*has 48"):
        check_servable(servable_model(64).config.replace(moe_intermediate_size=48),
                       cfg, on_gpu=False)
    with pytest.raises(ValueError, match="sparse-attention backend"):
        check_servable(servable_model(64).config, VLLMConfig(checkpoint="glm_moe_dsa"), on_gpu=False)
    from posttrain.rl_reasoning import RLReasoningConfig
    with pytest.raises(ValueError, match="routing_replay needs rollout.backend=native"):
        RLReasoningConfig(routing_replay=True, rollout={"backend": "vllm"})


def test_native_backend_is_the_default_and_a_context_manager(tmp_path):
    tok = make_tokenizer()
    with open_engine(RolloutConfig(), GLMModel(tiny().replace(vocab_size=tok.get_vocab_size(), num_layers=2)),
                     tok, [1], 0, tmp_path) as engine:
        assert isinstance(engine, RolloutEngine) and engine.metrics() == {}


def test_server_environment_carries_no_credentials(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("GLMFORGE_RL_AUTHKEY", "abcd")
    env = vllm_server.server_env(VLLMConfig())
    assert "s3cr3t" not in json.dumps(env) and "GLMFORGE_RL_AUTHKEY" not in env
    assert env["PYTHONPATH"] == str(vllm_server.EXTENSION_DIR) and env["VLLM_SERVER_DEV_MODE"] == "1"
    cmd = VLLMServer(VLLMConfig(), Path("/m"), Path("/l")).command(1234)
    assert "--tokens-only" in cmd and vllm_server.EXTENSION_CLS in cmd and "processed_logprobs" in cmd


def test_float32_on_cpu_asks_for_the_reference_mla_backend():
    """vLLM picks AMX_MLA on CPUs with AMX, and AMX_MLA refuses float32 weights at start-up."""
    from rl.vllm_engine import serving_config
    cmd = VLLMServer(serving_config(VLLMConfig(), on_gpu=False), Path("/m"), Path("/l")).command(1234)
    assert cmd[cmd.index("--attention-backend") + 1] == "CPU_MLA"
    for cfg, on_gpu in ((VLLMConfig(), True), (VLLMConfig(dtype="bfloat16"), False)):
        assert "--attention-backend" not in VLLMServer(serving_config(cfg, on_gpu), Path("/m"), Path("/l")).command(1)
    chosen = VLLMConfig(attention_backend="AMX_MLA", dtype="bfloat16")
    assert serving_config(chosen, on_gpu=False).attention_backend == "AMX_MLA"


def test_a_missing_vllm_environment_is_named(tmp_path):
    server = VLLMServer(VLLMConfig(python=str(tmp_path / "nope" / "python")), tmp_path, tmp_path / "log")
    with pytest.raises(EngineFailed, match="make vllm-setup"):
        server.start()


def test_guard_takes_the_server_group_down_when_the_stage_is_killed(tmp_path):
    """kill -9 of the process that started the guard: the server and its child go too, even when
    the server ignores SIGTERM (vLLM's graceful shutdown can hang on an open connection)."""
    pids = tmp_path / "pids"
    server = (f"import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}'); time.sleep(600)")
    stage = textwrap.dedent(f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, {str(vllm_server.GUARD)!r}, str(os.getpid()), "--", sys.executable,
                          "-c", {server!r}], start_new_session=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", stage])
    deadline = time.monotonic() + 30
    while not (pids.exists() and len(pids.read_text().split()) == 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    children = [int(p) for p in pids.read_text().split()]
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + vllm_server_grace() + 10
    while any(_running(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(p) for p in children)


def vllm_server_grace() -> float:
    import rl.server_guard as guard
    return guard.GRACE_S


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


class _CannedServer:
    """Answers /inference/v1/generate like vLLM does, from a script."""

    def __init__(self, reply):
        self.reply, self.calls, self.owned, self.url = reply, [], True, "canned"

    def call(self, path, body=None, method="POST", timeout=None):
        self.calls.append(body)
        return self.reply(body)


def _engine_over(servers) -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)   # no server start: the parsing and routing alone
    from rl.orchestrator import HashRing
    engine.cfg, engine.stop_ids, engine.version, engine.servers = VLLMConfig(max_model_len=64), [7], 4, servers
    engine.tokenizer = make_tokenizer()
    engine.ring = HashRing()
    for i in range(len(servers)):
        engine.ring.add(str(i))
    return engine


def test_responses_become_samples_with_the_servers_versions():
    def reply(body):
        stop = body["sampling_params"]["seed"] % 2 == 0
        toks = [5, 6, 7] if stop else [5, 6, 8]
        return {"choices": [{"token_ids": toks, "finish_reason": "stop" if stop else "length",
                             "logprobs": {"content": [{"token_id": t, "logprob": -0.5 * t} for t in toks]},
                             "weight_versions": [{"version": "3", "start": 0, "end": 1},
                                                 {"version": "4", "start": 1, "end": 3}]}]}
    servers = [_CannedServer(reply), _CannedServer(reply)]
    engine = _engine_over(servers)
    from domains.task import Task
    samples = [Sample(Task("arithmetic", "1+1", "2"), g, [1, 2, 3]) for g in range(6) for _ in range(3)]
    engine.generate(samples, SamplingParams(1.0, 1.0, 8), torch.Generator().manual_seed(0))
    for s in samples:
        assert s.versions == [3, 4, 4] and s.rollout_logprobs == [-0.5 * t for t in s.response_ids]
        assert s.status == (Status.OK if s.response_ids[-1] == 7 else Status.TRUNCATED)
    # a group's samples all went to one server; both servers got groups
    by_prompt = [{c["sampling_params"]["seed"] for c in srv.calls} for srv in servers]
    assert all(by_prompt) and sum(len(c) for c in by_prompt) == len(samples)
    assert [len(s.calls) % 3 for s in servers] == [0, 0]
    # the same generator state sends the same seeds (a resumed stage sends the same requests)
    again = _engine_over([_CannedServer(reply)])
    again.generate(samples, SamplingParams(1.0, 1.0, 8), torch.Generator().manual_seed(0))
    assert sorted(c["sampling_params"]["seed"] for c in again.servers[0].calls) == \
        sorted(c["sampling_params"]["seed"] for srv in servers for c in srv.calls)
    bad = _engine_over([_CannedServer(lambda b: {"choices": [{"token_ids": [1, 2], "logprobs": {"content": []}}]})])
    with pytest.raises(EngineFailed, match="2 tokens but 0 log-probs"):
        bad.complete([[1]], SamplingParams(0.0, 1.0, 4), torch.Generator())
    with pytest.raises(EngineFailed, match="max_model_len=64"):
        engine.complete([list(range(64))], SamplingParams(0.0, 1.0, 4), torch.Generator())


# ---------------------------------------------------------------- against real vLLM (opt-in)
def _vllm_cfg(**kw) -> VLLMConfig:
    return VLLMConfig(python=str(VLLM_PYTHON), max_model_len=256, max_num_seqs=16, **kw)


def _parity(model: GLMModel, samples: list[Sample], temperature: float = 1.0) -> tuple[float, float]:
    from rl.update import recompute_old_logprobs
    recompute_old_logprobs(model, samples, 0, temperature)
    d = [abs(a - b) for s in samples for a, b in zip(s.rollout_logprobs, s.train_logprobs)]
    return sum(d) / len(d), max(d)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    from runtime.shutdown import _group_alive as alive
    return alive(pgid)


@pytest.mark.vllm
def test_engine_against_vllm_tokens_versions_parity_updates_and_a_restart(tmp_path):
    from domains.task import Task
    tok = make_tokenizer()
    model = servable_model(tok.get_vocab_size())
    stops = [tok.token_to_id("7")]
    task = Task("arithmetic", "1+1", "2")
    engine = VLLMEngine(model, tok, stops, _vllm_cfg(), tmp_path)
    try:
        gen = torch.Generator().manual_seed(0)
        samples = [Sample(task, g, list(range(5, 20 + g))) for g in range(4) for _ in range(4)]
        engine.generate(samples, SamplingParams(1.0, 1.0, 12), gen)
        assert all(1 <= len(s.response_ids) <= 12 and s.versions == [0] * len(s.response_ids) for s in samples)
        assert all(s.status == Status.OK for s in samples if s.response_ids[-1] in stops)
        mean, worst = _parity(model, samples)
        assert mean < 0.01 and worst < 0.15, (mean, worst)       # measured 0.002-0.003 / 0.06
        greedy = [engine.complete([list(range(5, 20))], SamplingParams(0.0, 1.0, 8), gen)[0][0] for _ in range(2)]
        assert greedy[0] == greedy[1]

        # a weight update: served as version 3, log-probs of the new weights (vLLM's own reload
        # leaves the CPU MoE kernel on stale packing: 0.038 mean instead of 0.003)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        engine.sync(model, 3)
        after = [Sample(task, g, list(range(5, 20 + g))) for g in range(4) for _ in range(4)]
        engine.generate(after, SamplingParams(1.0, 1.0, 12), gen)
        assert all(s.versions == [3] * len(s.response_ids) for s in after)
        mean, worst = _parity(model, after)
        assert mean < 0.015, (mean, worst)                            # measured 0.008 (fresh server: 0.008)
        assert engine.metrics()["vllm/weight_update_s"] > 0

        # the server dies: the next request restarts it on version 3
        server = engine.servers[0]
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        again = [Sample(task, 0, list(range(5, 20)))]
        engine.generate(again, SamplingParams(1.0, 1.0, 6), gen)
        assert engine.restarts == 1 and again[0].versions == [3] * len(again[0].response_ids)
        assert _parity(model, again)[0] < 0.015

        # a model whose attention depends on position (its rope parts scaled up): vLLM's CPU rotary
        # op got these wrong (probe gap ~0.08, on a trained model up to 5 per token) until the
        # worker extension switched it to forward_native
        c = model.config
        with torch.no_grad():
            for layer in model.layers:
                layer.self_attn.kv_a_proj_with_mqa.weight[c.kv_lora_rank:].mul_(30)
                layer.self_attn.q_b_proj.weight.view(c.num_heads, c.qk_head_dim, -1)[:, c.qk_nope_head_dim:].mul_(30)
        engine.sync(model, 4)
        assert engine.parity_gap < 0.01, engine.parity_gap
        pgid = server.proc.pid
    finally:
        engine.close()
    assert not _group_alive(pgid)


def _stage_inputs(root: Path) -> dict[str, Path]:
    from model.hf import save_state
    tok = make_tokenizer()
    (root / "tokenize").mkdir(parents=True)
    tok.save(str(root / "tokenize" / "tokenizer.json"))
    save_state(servable_model(tok.get_vocab_size()), root / "sft" / "consolidated.safetensors")
    return {"tokenize": root / "tokenize", "sft": root / "sft"}


STAGE_CFG = dict(steps=3, prompts_per_step=2, group_size=4, optim={"lr": 1e-3}, max_new_tokens=4, heldout=8,
                 gsm8k_test=2, gsm8k_max_new_tokens=4, checkpoint_every=1, reward_timeout_s=30,
                 gates={"evals": {"arithmetic": 4, "gsm8k": 2, "gsm8k_max_new_tokens": 4, "tool": 2,
                                  "tool_max_new_tokens": 4}})


def _servers_of(workdir: Path) -> list[int]:
    """Processes whose command line names this workdir's engine (the guard, vLLM and its children
    carry the weights path, or are in their group)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if str(workdir) in (p / "cmdline").read_bytes().decode(errors="replace") and _running(int(p.name)):
                    out.append(int(p.name))
            except OSError:
                continue
    return out


@pytest.mark.vllm
def test_rl_reasoning_on_vllm_then_kill_9_leaves_no_server(tmp_path):
    from runtime.stage import Workdir
    from posttrain.rl_reasoning import RLReasoningConfig, run_rl_reasoning
    inputs = _stage_inputs(tmp_path / "in")
    vllm = _vllm_cfg().model_copy(update={"max_model_len": 512})      # GSM8K test prompts: ~280 tokens
    cfg = RLReasoningConfig(**STAGE_CFG, rollout={"backend": "vllm", "vllm": vllm.model_dump()})
    result = run_rl_reasoning(cfg, inputs, Workdir.at(tmp_path / "wd", seed=3))
    assert result["steps"] == 3 and result["mismatch"]
    recs = [json.loads(x) for x in (tmp_path / "wd" / "out" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["vllm/restarts"] == 0 and r["mismatch/abs_logp"] < 0.02 for r in recs)
    assert not _servers_of(tmp_path / "wd")

    # the same stage in its own process, killed with -9 once its server answers
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from runtime.stage import Workdir
        from posttrain.rl_reasoning import RLReasoningConfig, run_rl_reasoning
        cfg = RLReasoningConfig.model_validate_json({cfg.model_copy(update={"steps": 50}).model_dump_json()!r})
        run_rl_reasoning(cfg, {{k: Path(v) for k, v in {json.dumps({k: str(v) for k, v in inputs.items()})}.items()}},
                         Workdir.at(Path({str(tmp_path / "killed")!r}), seed=3))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    log = tmp_path / "killed" / "checkpoint" / "engine-rank0" / "server-0.log"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and "/inference/v1/generate" in log.read_text(errors="replace").split("startup complete")[-1]:
            break
        time.sleep(0.5)
    assert proc.poll() is None, "the stage ended before its server answered"
    assert _servers_of(tmp_path / "killed")
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + vllm_server_grace() + 20
    while _servers_of(tmp_path / "killed") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _servers_of(tmp_path / "killed")



@pytest.mark.vllm
def test_rl_agentic_workers_roll_out_on_the_stages_vllm_server(tmp_path):
    """The asynchronous stage on vLLM: the worker process sends its turns to the stage's server, the
    versions on the trained tokens are the server's, each sync a weight update on the server."""
    from runtime.stage import Workdir
    from posttrain.rl_agentic import RLAgenticConfig, run_rl_agentic
    inputs = _stage_inputs(tmp_path / "in")
    inputs["rl-reasoning"] = inputs.pop("sft")
    cfg = RLAgenticConfig(steps=3, prompts_per_step=2, group_size=3, optim={"lr": 1e-3}, max_new_tokens=6,
                          max_turns=2, heldout=2, workers=1, eta=1, tau=1, sync_every=1, checkpoint_every=1,
                          environments={"calc_arith": 1.0},          # tool schemas: ~600-token prompts
                          rollout={"backend": "vllm", "vllm": {**_vllm_cfg().model_dump(), "max_model_len": 1024}},
                          gates={"evals": {"arithmetic": 4, "gsm8k": 2, "gsm8k_max_new_tokens": 4, "tool": 2,
                                           "tool_max_new_tokens": 4}})
    result = run_rl_agentic(cfg, inputs, Workdir.at(tmp_path / "wd", seed=5))
    recs = [json.loads(x) for x in (tmp_path / "wd" / "out" / "metrics.jsonl").read_text().splitlines()]
    assert result["steps"] == 3 and [r["version"] for r in recs] == [1, 2, 3]
    assert all(r["vllm/restarts"] == 0 and r["mismatch/abs_logp"] < 0.02 for r in recs)
    # samples were generated by versions the server served (eta 1: up to one behind the trainer)
    assert set(result["version_lag_histogram"]) <= {"0", "1"}
    assert not _servers_of(tmp_path / "wd")
    with pytest.raises(ValueError, match="trains on one rank"):
        RLAgenticConfig(rollout={"backend": "vllm"}, parallel={"launch": {"nproc_per_node": 2}})


def test_a_server_that_computes_other_log_probs_stops_the_stage():
    """The probe after every start and update: the server's prefill log-probs against the trainer's
    forward on the weights it was given (here a server that answers -1 for every token)."""
    model = GLMModel(tiny().replace(vocab_size=64, num_layers=2))

    def reply(body):
        n = len(body["token_ids"])
        return {"prompt_logprobs": [None] + [{str(t): {"logprob": -1.0}} for t in body["token_ids"][1:]],
                "choices": [{"token_ids": [1], "logprobs": None}]} if n else {}
    engine = _engine_over([_CannedServer(reply)])
    with pytest.raises(EngineFailed, match="computes other log-probs than the trainer"):
        engine.check_parity(model)

    def honest(body):
        ids = body["token_ids"]
        with torch.no_grad():
            lp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        return {"prompt_logprobs": [None] + [{str(t): {"logprob": float(lp[i, t])}} for i, t in enumerate(ids[1:])]}
    engine = _engine_over([_CannedServer(honest)])
    engine.check_parity(model)
    assert engine.parity_gap < 1e-5
