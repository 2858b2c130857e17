"""The Kubernetes templates rendered from the config (glmforge.k8s, `glmforge deploy k8s-templates`):
they pass the Kubernetes API schema (kubernetes-validate, offline, strict) and the Prefect
template shape, the real prefect-kubernetes worker accepts them, broken objects are refused
naming the field, and the shipped deployments/k8s files are what the command renders."""
from __future__ import annotations

import asyncio
import copy
import json
import socket
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from glmforge import k8s
from runtime import shutdown
from glmforge.cli import app
from glmforge.config import load_config
from glmforge.pipeline import iterations, stages_for

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "deployments" / "k8s"


@pytest.fixture(scope="module")
def rendered():
    return {p: k8s.render(load_config(p, None, None)) for p in ("glm5", "tiny")}


@pytest.mark.parametrize("preset", ["glm5", "tiny"])
def test_rendered_templates_pass_the_kubernetes_schema_and_the_prefect_shape(rendered, preset):
    files = rendered[preset]
    checks = k8s.check_rendered(files)
    templates = [r for r, o in files.items() if "job_configuration" in o]
    objects = [r for r, o in files.items() if "kind" in o]
    services = [r for r in objects if r.endswith("/service.json") and not r.startswith("prefect-server/")]
    assert len(checks) == 2 * len(templates) + len(objects) and len(templates) == len(services) + 1
    # every pod asks for its GPUs, on the GPU node group, tolerating its taint, and sends heartbeats
    for rel in templates:
        pod = k8s.job_from_template(files[rel])["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] >= 1, rel
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}, rel
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"], rel
        assert {"name": "PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "value": "30"} in c["env"], rel
    # the Prefect server on PostgreSQL: its database URL from a Secret, never in the file
    server = files["prefect-server/deployment.json"]["spec"]["template"]["spec"]["containers"][0]
    url = next(e for e in server["env"] if e["name"] == "PREFECT_SERVER_DATABASE_CONNECTION_URL")
    assert url == {"name": "PREFECT_SERVER_DATABASE_CONNECTION_URL",
                   "valueFrom": {"secretKeyRef": {"name": "glmforge-prefect-db", "key": "url"}}}
    assert "postgresql" not in json.dumps(files["prefect-server/deployment.json"])
    # every stage is in exactly one group
    groups = files["node-groups.json"]["groups"]
    stages = [s for g in groups.values() for s in g["stages"]]
    # every stage of every round (glm5 runs two rounds of post-training: sft@2 ...)
    assert len(stages) == len(set(stages)) == len(stages_for(iterations(load_config(preset, None, None))))


def test_glm5_groups_follow_the_launch_config(rendered):
    cfg = load_config("glm5", None, None)
    files = rendered["glm5"]
    groups = files["node-groups.json"]["groups"]
    # the RL stages join through their parallel.launch: the reward model trains on the same 128 x 8,
    # the stages with served rollouts on 64 x 8 (their vLLM pools run beside them)
    # (glm5 runs two rounds of post-training: a round's stages go where round 1's do)
    assert groups["train-128x8"]["stages"] == ["pretrain", "context-1", "context-2", "context-3", "dsa-adapt", "sft",
                                               "reward-model", "sft@2", "reward-model@2"]
    assert groups["train-64x8"]["stages"] == ["rl-reasoning", "rl-agentic", "rl-general", "distill", "rl-reasoning@2",
                                              "rl-agentic@2", "rl-general@2", "distill@2"]
    assert {"self-distill@2", "rl-prompts@2"} <= set(groups["single"]["stages"])
    assert groups["train-16x8"]["stages"] == ["dsa-warmup"]
    assert "rl-agentic" not in groups["single"]["stages"] and "ingest" in groups["single"]["stages"]
    t = files["train-128x8/base-job-template.json"]
    job = k8s.job_from_template(t, name="run")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["completions"], spec["parallelism"], spec["completionMode"]) == (128, 128, "Indexed")
    assert spec["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]} and spec["backoffLimit"] == 0
    svc = files["train-128x8/service.json"]
    assert pod["subdomain"] == svc["metadata"]["name"] == "glmforge-train-128x8"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == job["spec"]["template"]["metadata"]["labels"]
    c = pod["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["MASTER_ADDR"]["value"] == "$(GLMFORGE_JOB_NAME)-0.glmforge-train-128x8"
    assert list(env).index("GLMFORGE_JOB_NAME") < list(env).index("MASTER_ADDR")  # $(...) needs it first
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"].endswith("['batch.kubernetes.io/job-completion-index']")
    assert env["MASTER_PORT"]["value"] == str(cfg.pretrain.launch.master_port)
    assert env["GLMFORGE_HOSTFILE"]["value"] == cfg.pretrain.launch.hostfile
    assert env["NCCL_SOCKET_IFNAME"]["value"] and env["NCCL_DEBUG"]["value"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 8
    # the grace period is the config's, as for the single-pod template
    grace = shutdown.pod_grace_seconds(cfg)
    for rel in ("base-job-template.json", "train-128x8/base-job-template.json", "train-16x8/base-job-template.json"):
        assert k8s.job_from_template(files[rel])["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace
    # no secret in any template: credentials by Secret reference only
    assert c["envFrom"] == [{"secretRef": {"name": "glmforge-s3"}}]
    assert {"name": "ssh", "secret": {"secretName": "glmforge-ssh", "defaultMode": 0o600}} in pod["volumes"]
    text = json.dumps(files)
    for word in ("AWS_SECRET_ACCESS_KEY\": \"", "password", "BEGIN OPENSSH", "token\": \""):
        assert word not in text


def test_tiny_training_group_is_one_pod(rendered):
    launch = load_config("tiny", None, None).pretrain.launch
    group = f"train-1x{launch.nproc_per_node}"
    files = rendered["tiny"]
    assert set(files["node-groups.json"]["groups"]) == {"single", group}
    job = k8s.job_from_template(files[f"{group}/base-job-template.json"])
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert job["spec"]["completions"] == 1 and "command" not in c  # no hostfile, no sshd: the flow run alone
    assert c["resources"]["limits"]["nvidia.com/gpu"] == launch.nproc_per_node


def test_the_prefect_kubernetes_worker_accepts_the_templates(rendered):
    """The real worker's job configuration (prefect-kubernetes) builds and prepares each job, and
    what it would submit passes the schema; Prefect's server-side template check passes too."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.server.schemas.actions import validate_base_job_template
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    async def prepared(t):
        conf = await KubernetesWorkerJobConfiguration.from_template_and_values(
            t, {"env": {"EXTRA": "1"}}, client=object())
        conf.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="glowing-panda", flow_id=uuid.uuid4()))
        return conf.job_manifest

    for preset, files in rendered.items():
        for rel, t in files.items():
            if "job_configuration" in t:
                validate_base_job_template(t)
                job = asyncio.run(prepared(t))
                k8s.validate_object(job, f"{preset} {rel}")
                names = [e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]]
                assert "EXTRA" in names and "GLMFORGE_HOME" in names
    # and without the pod-level keys it requires, the worker refuses a template, as the shape check does
    t = copy.deepcopy(rendered["glm5"]["base-job-template.json"])
    del t["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["parallelism"]
    with pytest.raises(ValueError, match="missing required attributes.*parallelism"):
        asyncio.run(prepared(t))
    with pytest.raises(k8s.TemplateError, match="spec.template.spec.parallelism must be 1"):
        k8s.check_job_template(t)


def test_broken_objects_are_refused_naming_the_field(rendered):
    t = rendered["glm5"]["train-128x8/base-job-template.json"]
    job = k8s.job_from_template(t)
    job["spec"]["completions"] = "128"
    with pytest.raises(k8s.TemplateError, match=r"spec\.completions: '128' is not of type 'integer'"):
        k8s.validate_object(job, "broken")
    job = k8s.job_from_template(t)
    job["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # misspelled: strict refuses it
    with pytest.raises(k8s.TemplateError, match=r"spec\.template\.spec\.containers\.0: .*'resource'"):
        k8s.validate_object(job)
    svc = copy.deepcopy(rendered["glm5"]["train-128x8/service.json"])
    svc["spec"]["ports"][0]["port"] = "29500"
    with pytest.raises(k8s.TemplateError, match=r"spec\.ports\.0\.port"):
        k8s.validate_object(svc)
    bad = copy.deepcopy(t)
    bad["job_configuration"]["job_manifest"]["spec"]["activeDeadlineSeconds"] = "{{ deadline }}"
    bad["variables"]["properties"]["memory"]["default"] = 1000
    with pytest.raises(k8s.TemplateError, match="undeclared variable.*deadline.*variables.memory.default: 1000 is not of type 'string'"):
        k8s.check_job_template(bad)


def test_shipped_files_are_what_the_command_renders(tmp_path):
    out = tmp_path / "k8s"
    res = CliRunner().invoke(app, ["deploy", "k8s-templates", "--preset", "glm5", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "against the Kubernetes 1.33 schema" in res.output
    rendered = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.json"))
    shipped = sorted(p.relative_to(SHIPPED).as_posix() for p in SHIPPED.rglob("*.json"))
    assert shipped == rendered, "run: glmforge deploy k8s-templates --preset glm5 --out deployments/k8s"
    for rel in rendered:
        assert (SHIPPED / rel).read_text() == (out / rel).read_text(), \
            f"deployments/k8s/{rel} is stale: glmforge deploy k8s-templates --preset glm5 --out deployments/k8s"


def test_multi_node_groups_the_templates_cannot_run_are_refused():
    cfg = load_config("tiny", None, ["pretrain.launch.nnodes=2", "pretrain.launch.master_addr=10.0.0.1",
                                     "pretrain.launch.master_port=29500"])
    with pytest.raises(ValueError, match="node group train-2x2 \\(pretrain\\): multi-node launcher: torchrun"):
        k8s.render(cfg)
    res = CliRunner().invoke(app, ["deploy", "k8s-templates", "--preset", "tiny", "--out", "unused",
                                   "--set", "pretrain.launch={launcher: deepspeed, nnodes: 2, master_port: 29500, "
                                   "hostfile: /etc/h/hostfile, master_addr: 10.0.0.1}"])
    assert res.exit_code == 2 and "leave launch.master_addr unset" in res.output


def test_node_entry_writes_the_hostfile_and_runs_the_stage_on_pod_0(tmp_path, monkeypatch):
    runs, started = [], []

    def execvp(file, args):
        runs.append(args)
        raise SystemExit(0)

    monkeypatch.setattr(k8s.os, "execvp", execvp)
    monkeypatch.setattr(k8s.subprocess, "Popen", lambda cmd: started.append(cmd))
    waited = []
    monkeypatch.setattr(k8s, "wait_for_ports", lambda hosts, port, timeout: waited.append((hosts, port)))
    env = {"NODE_RANK": "1", "NNODES": "2", "GPUS_PER_NODE": "8", "GLMFORGE_JOB_NAME": "run-x",
           "GLMFORGE_SUBDOMAIN": "glmforge-train-2x8", "GLMFORGE_HOSTFILE": str(tmp_path / "hostfile"),
           "MASTER_PORT": "29500", "GLMFORGE_WORKER_COMMAND": "/usr/sbin/sshd -D -e"}
    with pytest.raises(SystemExit):
        k8s.node_main(["prefect", "flow-run", "execute"], env)
    assert runs == [["/usr/sbin/sshd", "-D", "-e"]] and not (tmp_path / "hostfile").exists()
    with pytest.raises(SystemExit):
        k8s.node_main(["prefect", "flow-run", "execute"], {**env, "NODE_RANK": "0"})
    hosts = ["run-x-0.glmforge-train-2x8", "run-x-1.glmforge-train-2x8"]
    assert (tmp_path / "hostfile").read_text() == "".join(f"{h} slots=8\n" for h in hosts)
    assert started == [["/usr/sbin/sshd", "-D", "-e"]] and waited == [(hosts, 22)]
    assert runs[-1] == ["prefect", "flow-run", "execute"]


def test_wait_for_ports_waits_for_a_listener_and_names_the_missing_host():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        k8s.wait_for_ports(["127.0.0.1"], port, timeout=5)
    with pytest.raises(SystemExit, match=f"127.0.0.1:{port} not reachable after 0 s"):
        k8s.wait_for_ports(["127.0.0.1"], port, timeout=0.3, every=0.1)
