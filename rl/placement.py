"""Where an RL-side stage's work runs, sized: its trainer pool (the ranks of `parallel`) and its
server pools (the rollouts' `rollout.servers`, rl-general's `judge_servers` per judge, distill's
`teacher_servers` per teacher), by model.info.rl_pools under a cluster plan (a config's `plan:`).
A config with a plan is refused at load when a pool of one of its stages does not fit a GPU
(glmforge.config), so a layout that cannot run never starts."""
from __future__ import annotations

from typing import Any

from model.config import ModelConfig
from model.info import GB, Plan, ServerPool, rl_pools

RL_STAGES = ("rl_reasoning", "rl_agentic", "reward_model", "rl_general", "distill")


def _pool(cfg: Any) -> ServerPool:
    return ServerPool(replicas=len(cfg.urls) or cfg.replicas, gpus_per_replica=cfg.gpus_per_replica,
                      data_parallel=cfg.data_parallel, expert_parallel=cfg.expert_parallel,
                      weight_bytes=1.0 if cfg.weights == "fp8" else 2.0, external=bool(cfg.urls))


def started_pools(section: Any) -> tuple[dict[str, Any], int]:
    """The server pools a stage's section has running while its ranks train, by name (their
    ServerPoolConfig: `rollouts`, `judge NAME`, `teacher NAME`), and how many judge or teacher
    models each rank holds itself instead (rollouts not served)."""
    rollout = getattr(section, "rollout", None)
    judges = [j for j in ("grm", "orm") if getattr(section, "weights", {}).get(j, 0) > 0] \
        if hasattr(section, "judge_servers") else []
    teachers = list(getattr(section, "teachers", []) or [])
    if rollout is None or rollout.backend != "served":
        return {}, len(judges) + len(teachers)
    pools = {"rollouts": rollout.servers}
    pools.update({f"judge {j}": section.judge_servers for j in judges})
    pools.update({f"teacher {t}": section.teacher_servers for t in teachers})
    return pools, 0


def local_gpus(section: Any) -> int:
    """GPUs an RL-side stage takes on its node (runtime.gpus): its ranks there, and every
    replica of the pools it starts itself (pools given as urls run elsewhere). A stage without
    `parallel` (rl-prompts: it only samples) runs in its own process, one device."""
    ranks = section.parallel.launch.nproc_per_node if hasattr(section, "parallel") else 1
    pools, _ = started_pools(section)
    return ranks + sum(p.replicas * p.gpus_per_replica for p in pools.values() if not p.urls)


def stage_pools(section: Any, model: ModelConfig, plan: Plan) -> dict:
    """rl_pools for one stage's config section, as the section places its work."""
    rollout = getattr(section, "rollout", None)
    pools, held = started_pools(section)
    servers = {name: _pool(cfg) for name, cfg in pools.items()}
    par = section.parallel
    out = rl_pools(model, plan, par.launch.world_size, par.zero_stage, par.expert_parallel, servers,
                   generates=rollout is not None and rollout.backend == "native", models_in_ranks=held)
    if rollout is not None and rollout.backend == "vllm":
        out["note"] = "rollouts on vLLM servers reloaded from a whole-model export (sized by vLLM, not here)"
    return out


def config_pools(config: Any, plan: Plan | None = None) -> dict[str, dict]:
    """stage_pools of every RL-side stage of a pipeline config with a `plan:` ({} without one),
    under that plan or `plan` (another cluster for the same model)."""
    if getattr(config, "plan", None) is None:
        return {}
    model, plan = config.plan.model(), plan or config.plan.plan()
    out = {}
    for stage in RL_STAGES:
        section = getattr(config, stage, None)
        if section is None:
            continue
        try:
            out[stage.replace("_", "-")] = stage_pools(section, model, plan)
        except ValueError as e:          # a trainer layout the model cannot take (ep vs experts)
            out[stage.replace("_", "-")] = {"error": str(e)}
    return out


def not_fitting(pools: dict[str, dict], gpu_mem_gb: int, gpus: int, gpus_per_node: int) -> list[str]:
    """One line per pool that does not fit a `gpu_mem_gb` GPU, naming the stage, the pool and its
    GB per GPU; per stage whose pools together need more than the plan's `gpus`; and per pool the
    stage would start (no urls) whose replicas span more GPUs than a node has: the stage starts
    its servers on its first rank's node, so larger replicas run in the cluster, given as urls."""
    lines = []
    for stage, pl in pools.items():
        if "error" in pl:
            lines.append(f"{stage}: {pl['error']}")
            continue
        if pl["gpus"] > gpus:
            lines.append(f"{stage}: its pools need {pl['gpus']} GPUs (trainer {pl['trainer']['gpus']}"
                         + "".join(f", {n} {sv['gpus']}" for n, sv in pl["servers"].items())
                         + f"), the plan has {gpus}")
        t = pl["trainer"]
        if not t["fits"]:
            why = ", ".join(f"{k.replace('_', ' ')} {v / GB:,.1f}" for k, v in t["bytes"].items() if v)
            lines.append(f"{stage}: the trainer pool ({t['gpus']} GPUs, ZeRO-{t['zero_stage']}, ep {t['ep']}) needs "
                         f"{t['bytes_per_gpu'] / GB:,.1f} GB per GPU ({why}) > {gpu_mem_gb} GB")
        for name, sv in pl["servers"].items():
            if not sv["external"] and sv["gpus_per_replica"] > gpus_per_node:
                lines.append(f"{stage}: the {name} pool's replicas span {sv['gpus_per_replica']} GPUs, more than a "
                             f"node's {gpus_per_node}; the stage starts servers on its first node only, so run them "
                             "in the cluster and give their urls")
            if not sv["fits"]:
                why = ", ".join(f"{k.replace('_', ' ')} {v / GB:,.1f}" for k, v in sv["bytes"].items())
                lines.append(f"{stage}: the {name} pool ({sv['replicas']} x {sv['gpus_per_replica']} GPUs, ep "
                             f"{sv['expert_parallel']}) needs {sv['bytes_per_gpu'] / GB:,.1f} GB per GPU ({why}) > "
                             f"{gpu_mem_gb} GB")
    return lines
