"""Memory per GPU of a training layout (model.info.memory_plan), the `plan:` config section and
`glmforge model info --plan`. Expected numbers are worked out by hand for a tiny config
(D=32, V=512, 2 layers + MTP, 4 routed experts of width 32) in the comments."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from glmforge.cli import app
from glmforge.config import ConfigError, load_config
from model.config import preset
from model.info import GB, Plan, activation_values_per_token, adam_params, expert_params, memory_plan, parse_plan
from model.model import GLMModel
from tests.training.conftest import MODEL_OVERRIDES

EXPERTS = 2 * 4 * 3 * 32 * 32        # 2 MoE blocks (layer 1, MTP) x 4 experts x gate/up/down 32x32
ADAM = 2 * 512 * 32 + 32 + 2 * 144 + (3 * 32 + 144)   # embed + head, final norm, 2 blocks' vectors, MTP's
# a block's vectors: two norms 2x32, q latent norm 32, kv latent norm 16, indexer k LayerNorm 2x16 = 144


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny", vocab_size=512, **MODEL_OVERRIDES)
    model = GLMModel(cfg)
    return cfg, model


def test_expert_and_adam_counts_match_the_built_model(tiny):
    cfg, model = tiny
    named = dict(model.named_parameters())
    assert expert_params(cfg) == EXPERTS == sum(p.numel() for n, p in named.items() if ".experts." in n)
    assert adam_params(cfg) == ADAM == sum(p.numel() for n, p in named.items()
                                           if p.dim() < 2 or n in ("embed_tokens.weight", "lm_head.weight"))


def test_activation_values_per_token_by_hand(tiny):
    cfg, _ = tiny
    # attention: 2D 64 + 2Cq 64 + H(N+R) 48 + (C+R) 24 + C 16 + H(N+V) 64 + H(N+R) 48 + H*V 32 = 360,
    # + sparse DSA indexer Hi*Di 32 + Di 16 + Hi 2 = 410; residual D 32
    assert activation_values_per_token(cfg, 0) == 410 + (32 + 3 * 64) + 32           # dense MLP: D + 3I
    # MoE: D 32 + router 2E 8 + K(D + 3I) 2*(32+96) + K 2 + shared 3I 96 + output D 32 = 426
    assert activation_values_per_token(cfg, 1) == 410 + 426 + 32


def test_memory_plan_by_hand(tiny):
    cfg, model = tiny
    total = sum(p.numel() for p in model.parameters())
    dense = total - EXPERTS
    p = Plan(nodes=2, gpus_per_node=2, zero_stage=2, ep=2, micro_batch_size=2, seq_len=64,
             activation_checkpointing=False, optimizer="muon", gpu_mem_gb=80, rollout_tokens=1000)
    r = memory_plan(cfg, p)
    b = r["bytes"]
    local = EXPERTS / 2                                   # ep 2: each GPU holds half the experts
    assert (r["dp_dense"], r["dp_expert"]) == (4, 2)
    assert b["parameters"] == 2 * (dense + local)         # ZeRO 2 keeps whole bf16 weights
    assert b["gradients"] == 2 * (dense / 4 + local / 2)  # ... and partitions gradients over each dp group
    assert b["master_weights"] == 4 * (dense / 4 + local / 2)
    assert b["optimizer_states"] == 4 * ((dense - ADAM) / 4 + local / 2) + 8 * ADAM / 4   # Muon 1, AdamW 2
    # no checkpointing: layers 666 + 868, MTP block 868 + 3D = 964 -> 2498 values; logits 6 B x 512 x (1 + 1 MTP)
    assert b["activations"] == 2 * 64 * (2 * 2498 + 6 * 512 * 2)
    assert b["rollout_kv_cache"] == 1000 * 2 * 2 * (16 + 8 + 16)   # bf16 x 2 layers x (latent + rope + index key)
    assert b["training_total"] == sum(b[k] for k in ("parameters", "gradients", "master_weights",
                                                      "optimizer_states", "activations")) + 6 * GB
    assert r["fits_training"] and r["fits_rollout"]
    # the RL trainer: AdamW's two fp32 moments instead of Muon's one
    assert b["rl_training_total"] == b["training_total"] - b["optimizer_states"] + 8 * (dense / 4 + local / 2)
    # one bf16 version; 4 trainer GPUs send a quarter each, a rollout GPU receives its own weights
    w = r["weight_sync"]
    assert w["version_bytes"] == 2 * total and w["send_bytes_per_trainer_gpu"] == 2 * total / 4
    assert w["receive_bytes_per_rollout_gpu"] == 2 * (dense + local)
    assert w["seconds"] == 2 * (dense + local) / 50e9
    ckpt = memory_plan(cfg, Plan(**{**p.__dict__, "activation_checkpointing": True}))
    # checkpointing: block inputs 2 x 32, the largest block 868 live again, MTP 32 + 964
    assert ckpt["activation_values_per_token"] == 64 + 868 + 996
    z3 = memory_plan(cfg, Plan(**{**p.__dict__, "zero_stage": 3}))["bytes"]
    assert z3["parameters"] == 2 * (dense / 4 + local / 2)
    adam = memory_plan(cfg, Plan(**{**p.__dict__, "optimizer": "adamw", "zero_stage": 0}))["bytes"]
    assert adam["optimizer_states"] == 8 * (dense + local) and adam["gradients"] == 2 * (dense + local)


def test_impossible_layouts_are_named():
    cfg = preset("tiny", vocab_size=512, **MODEL_OVERRIDES)
    with pytest.raises(ValueError, match="ep 3 must divide the 4 GPUs"):
        memory_plan(cfg, Plan(nodes=2, gpus_per_node=2, ep=3))
    with pytest.raises(ValueError, match="ep 8 must divide the model's 4 routed experts"):
        memory_plan(cfg, Plan(nodes=4, gpus_per_node=2, ep=8))
    assert parse_plan("128x8") == parse_plan("128×8") == (128, 8)
    with pytest.raises(ValueError, match="NODESxGPUS"):
        parse_plan("128-8")


def test_glm5_preset_ships_a_plan_that_fits_and_80gb_is_refused():
    plan = load_config("glm5").plan
    r = memory_plan(plan.model(), plan.plan())
    assert r["fits_training"] and r["fits_rollout"] and r["world"] == 1024
    assert r["bytes"]["training_total"] < 141 * GB
    with pytest.raises(ConfigError, match=r"glm5.yaml:\d+: field plan: .*does not fit a 80 GB GPU.*--gpu-mem 141"):
        load_config("glm5", overrides=["plan.gpu_mem_gb=80"])


def test_cli_prints_the_plan_and_refuses_what_does_not_fit():
    runner = CliRunner()
    ok = runner.invoke(app, ["model", "info", "--preset", "glm5", "--plan", "128×8"])
    assert ok.exit_code == 0, ok.output
    for line in ("parameters (bf16)", "gradients (bf16)", "optimizer states", "activations", "rollout KV cache",
                 "ZeRO-2, ep 64", "fits a 141 GB GPU"):
        assert line in ok.output
    small_ep = runner.invoke(app, ["model", "info", "--preset", "glm5", "--plan", "128x8", "--ep", "8"])
    assert small_ep.exit_code == 1 and "raise --ep to 32" in small_ep.output
    small_gpu = runner.invoke(app, ["model", "info", "--preset", "glm5", "--plan", "128x8", "--gpu-mem", "80"])
    assert small_gpu.exit_code == 1 and "does not fit a 80 GB GPU" in small_gpu.output
    assert "use 141 GB GPUs" in small_gpu.output
    bad = runner.invoke(app, ["model", "info", "--preset", "glm5", "--plan", "128x8", "--gpu-mem", "40"])
    assert bad.exit_code == 2 and "choose 80 or 141" in bad.output
    js = runner.invoke(app, ["model", "info", "--preset", "glm5", "--plan", "64x8", "--ep", "128", "--json"])
    assert js.exit_code in (0, 1) and '"memory_plan"' in js.output


def test_rl_pools_size_ranks_that_only_train_beside_servers():
    """glm5 on the shipped plan's GPUs: its RL trainer fits a 141 GB GPU with the experts sharded
    over 64 ranks when rollouts are served (105 GB on 1024 ranks: AdamW's two moments), not when
    every rank also holds a whole model to generate with; a one-GPU server replica (the whole
    model) does not fit, a 64-GPU expert-parallel replica does, and the CLI lists every RL-side
    stage as the preset places it, each pool within the GPU."""
    from model.info import ServerPool, rl_pools

    plan = load_config("glm5").plan
    cfg, p = plan.model(), plan.plan()
    whole = rl_pools(cfg, p, 1024, 2, 64, {"rollouts": ServerPool(16)}, generates=False)
    assert whole["trainer"]["fits"] and 100 * GB < whole["trainer"]["bytes_per_gpu"] < 110 * GB
    assert not whole["servers"]["rollouts"]["fits"] and whole["servers"]["rollouts"]["bytes_per_gpu"] > 1400 * GB
    sharded = rl_pools(cfg, p, 512, 2, 64, {"rollouts": ServerPool(8, 64, 8, 64)}, generates=False)
    pool = sharded["servers"]["rollouts"]
    assert pool["fits"] and pool["gpus"] == 512 and sharded["gpus"] == 1024
    assert pool["bytes"]["kv_cache"] == p.rollout_tokens * 109824          # glm5's latent + indexer key
    fp8 = rl_pools(cfg, p, 512, 2, 64, {"rollouts": ServerPool(8, 64, 8, 64, weight_bytes=1.0)}, generates=False)
    assert fp8["servers"]["rollouts"]["bytes"]["weights"] == pool["bytes"]["weights"] / 2
    # a server GPU receives the dense weights and its own experts' shards, not the whole version
    assert sharded["weight_sync"]["receive_bytes_per_server_gpu"] < sharded["weight_sync"]["version_bytes"] / 20
    in_ranks = rl_pools(cfg, p, 1024, 2, 1, {}, generates=True, models_in_ranks=3)
    assert not in_ranks["trainer"]["fits"]
    assert in_ranks["trainer"]["bytes_per_gpu"] > rl_pools(cfg, p, 1024, 2, 1, {}, generates=True)["trainer"]["bytes_per_gpu"]
    assert whole["weight_sync"]["send_bytes_per_trainer_gpu"] * 1024 == whole["weight_sync"]["version_bytes"]
    out = CliRunner().invoke(app, ["model", "info", "--preset", "glm5", "--plan", "128x8"]).output
    for stage in ("rl-reasoning", "rl-agentic", "reward-model", "rl-general", "distill"):
        assert f"    {stage}" in out
    assert "DOES NOT FIT" not in out and "ranks that only train" in out and "teacher rl-agentic: 1 replica" in out


def test_an_rl_layout_that_does_not_fit_is_refused_at_load_naming_the_pool():
    from glmforge.config import ConfigError

    with pytest.raises(ConfigError, match=r"rl-reasoning: the rollouts pool \(8 x 8 GPUs, ep 8\) needs 2.?\d\d\.\d "
                                          r"GB per GPU .*> 141 GB"):
        load_config("glm5", overrides=["rl_reasoning.rollout.servers.gpus_per_replica=8",
                                       "rl_reasoning.rollout.servers.expert_parallel=8"])
    with pytest.raises(ConfigError, match=r"rl-agentic: the trainer pool \(512 GPUs, ZeRO-2, ep 8\) needs"):
        load_config("glm5", overrides=["rl_agentic.parallel.expert_parallel=8"])
    urls = [f"http://rollouts-{i}.glmforge-vllm:8000" for i in range(6)]
    with pytest.raises(ConfigError, match="distill: its pools need 1088 GPUs .*the plan has 1024"):
        load_config("glm5", overrides=[f"distill.rollout.servers.urls={urls}"])
    with pytest.raises(ConfigError, match="expert_parallel=24 does not divide gpus_per_replica=64"):
        load_config("glm5", overrides=["rl_general.judge_servers.expert_parallel=24"])
    with pytest.raises(ConfigError, match="the ORM .* is served by native servers only"):
        load_config("glm5", overrides=["rl_general.weights.orm=1.0"])
