"""Kubernetes job templates rendered from the pipeline config (`glmforge deploy k8s-templates`).

Node groups come from what the config already says. Every training stage names its `launch:`
(ranks per node, nodes, launcher, hostfile, master port); the training stages with the same
launch settings form one group, named after its shape (`train-128x8`). Everything else
(curation, the RL stages with their rollouts, the reward model, distillation) runs in one pod:
the group `single`, whose template is `base-job-template.json`.

What is rendered, all plain JSON:

- `base-job-template.json`: the single-pod Prefect work-pool template (work pool `glmforge`).
- `<group>/base-job-template.json` per training group: the same shape as a Prefect
  work-pool template, as an Indexed Job with completions = parallelism = the group's nodes.
  Pod i has the hostname `<job>-i` and `subdomain: glmforge-<group>`, so with the group's
  headless Service it resolves as `<job>-i.glmforge-<group>`; MASTER_ADDR is pod 0's name,
  NODE_RANK the completion index. The Job succeeds when pod 0 succeeds (`successPolicy`); pod 0
  runs the stage (the Prefect flow run), whose DeepSpeed launcher starts the ranks of every
  pod over ssh from the hostfile that pod 0 writes (`python -m glmforge.k8s`, below). The
  other pods only run sshd. GPUs per pod = launch.nproc_per_node.
- `<group>/service.json`: that headless Service (`kubectl apply` it once per namespace).
- `node-groups.json`: which stages go to which group, work pool and files.
- `prefect-server/{deployment,service}.json`: the Prefect server on PostgreSQL, its database URL
  from a Secret (`glmforge-prefect-db`, key `url`).

Every pod requests its GPUs (`nvidia.com/gpu`), lands on the GPU node group (`node_selector`,
default NVIDIA GPU feature discovery's label) and tolerates its taint (`tolerations`); its flow
run sends Prefect heartbeats, which the zombie automation of deployments/automations.yaml needs.

The pods' terminationGracePeriodSeconds is a job variable whose default is
`shutdown.pod_grace_seconds(cfg)` (what `glmforge grace-period` prints). No template holds a
secret: S3 credentials come from the Secret named by `store_secret` (envFrom), ssh keys from the
Secret named by `ssh_secret`.

`check_rendered` validates the Prefect template shape (no Prefect import) and, with the
`kubernetes-validate` package, every Kubernetes object against the Kubernetes API schema
(strict: unknown fields are refused too), the templates after filling in their defaults as
the Prefect worker does. Nothing here has run on a real cluster.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

K8S_VERSION = "1.33"  # the oldest release with Job successPolicy GA; the schema checked against
GROUP_LABEL = "glmforge.io/node-group"
SINGLE = "single"
SSH_PORT = 22
SCRATCH = "/scratch"  # GLMFORGE_HOME lives under it; a shared (ReadWriteMany) volume on multi-node pods
# prefect-kubernetes (0.8.0) refuses a job manifest whose *pod* spec lacks `parallelism: 1` and
# `completions: 1` ("Job is missing required attributes at the following paths: ..."), although
# these are Job fields, not PodSpec fields: the API server drops them from the pod template
# (with a warning; the default field validation is Warn). The templates carry them for the
# worker, and the strict schema check ignores them.
PREFECT_WORKER_POD_KEYS = {"parallelism": 1, "completions": 1}
# where the GPUs are: the label NVIDIA's GPU feature discovery puts on a GPU node, and the taint
# GPU node groups commonly carry (EKS, GKE and AKS GPU pools) so that only GPU pods land there
GPU_NODE_SELECTOR = {"nvidia.com/gpu.present": "true"}
GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
HEARTBEAT_S = 30          # Prefect's flow-run heartbeat period (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, 30 at least)
PREFECT_PORT = 4200
PLACEHOLDER = re.compile(r"{{\s*([\w\.\-\[\]$]+)\s*}}")  # as prefect.utilities.templating


class TemplateError(ValueError):
    """A rendered template or object is invalid; the message names the file and the field."""


@dataclass(frozen=True)
class NodeGroup:
    name: str
    stages: tuple[str, ...]
    gpus_per_node: int
    launch: Any = None  # training.config.LaunchConfig; None for the single-pod group

    @property
    def nodes(self) -> int:
        return self.launch.nnodes if self.launch is not None else 1

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    @property
    def work_pool(self) -> str:
        return "glmforge" if self.launch is None else f"glmforge-{self.name}"

    @property
    def service(self) -> str:
        return f"glmforge-{self.name}"

    @property
    def template_path(self) -> str:
        return "base-job-template.json" if self.launch is None else f"{self.name}/base-job-template.json"

    @property
    def master_port(self) -> int:
        return self.launch.master_port or 29500


def node_groups(cfg) -> list[NodeGroup]:
    """The single-pod group, then one group per distinct `launch:` of the training stages (and
    `parallel.launch:` of the RL stages that train on more than one rank)."""
    from glmforge.pipeline import iterations, stages_for
    from training.config import LaunchConfig

    single: list[str] = []
    training: dict[str, tuple[Any, list[str]]] = {}
    for spec in stages_for(iterations(cfg)):
        section = getattr(cfg, spec.section, None)
        launch = getattr(section, "launch", None)
        parallel = getattr(getattr(section, "parallel", None), "launch", None)
        if isinstance(parallel, LaunchConfig) and parallel.world_size > 1:
            launch = parallel           # an RL stage whose trainer runs on ranks (rl.launch)
        if not isinstance(launch, LaunchConfig):
            single.append(spec.name)
            continue
        key = launch.model_dump_json(exclude={"node_rank"})
        training.setdefault(key, (launch, []))[1].append(spec.name)
    plan = getattr(cfg, "plan", None)
    gpus = plan.gpus_per_node if plan is not None else max(
        (launch.nproc_per_node for launch, _ in training.values()), default=1)
    groups = [NodeGroup(SINGLE, tuple(single), gpus)]
    for launch, stages in training.values():
        name = base = f"train-{launch.nnodes}x{launch.nproc_per_node}"
        n = 2
        while any(g.name == name for g in groups):
            name, n = f"{base}-{n}", n + 1
        _check_launch(name, stages, launch)
        groups.append(NodeGroup(name, tuple(stages), launch.nproc_per_node, launch))
    return groups


def _check_launch(name: str, stages: list[str], launch) -> None:
    if launch.nnodes == 1:
        return
    where = f"node group {name} ({', '.join(stages)})"
    if launch.launcher != "deepspeed":
        raise ValueError(f"{where}: multi-node launcher: torchrun is not built for Kubernetes (every pod would "
                         "need its own launcher and the stage's rank spec); use launch.launcher: deepspeed, "
                         "whose launcher on pod 0 starts every pod's ranks over ssh")
    if not launch.hostfile:
        raise ValueError(f"{where}: launch.hostfile is needed: pod 0 writes the pods' names there for the "
                         "DeepSpeed launcher")
    if launch.master_addr:
        raise ValueError(f"{where}: leave launch.master_addr unset on Kubernetes: the master is pod 0 "
                         "(the hostfile's first host)")


# ---------------------------------------------------------------- rendering
def _variables(cfg, gpus: int | None, backend_nccl: bool) -> dict[str, Any]:
    from runtime.shutdown import pod_grace_seconds

    # heartbeats let the zombie automation (deployments/automations.yaml) mark a run whose pod died Crashed
    env = {"GLMFORGE_HOME": f"{SCRATCH}/glmforge", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)}
    if backend_nccl:
        # the pod network's interface; RDMA clusters set their own NCCL_* through job variables
        env.update({"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "eth0"})
    props: dict[str, Any] = {
        "name": {"type": "string", "title": "Name"},
        "namespace": {"type": "string", "default": "glmforge"},
        "image": {"type": "string", "description": "image with glmforge and a CUDA torch installed",
                  "default": "glmforge:latest"},
        "image_pull_policy": {"type": "string", "enum": ["IfNotPresent", "Always", "Never"],
                              "default": "IfNotPresent"},
        "service_account_name": {"type": "string", "default": "glmforge"},
        "command": {"type": "string"},
        "env": {"type": "object", "additionalProperties": {"type": "string"}, "default": env},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "store_secret": {"type": "string", "description": "Kubernetes Secret with AWS_ACCESS_KEY_ID, "
                         "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL", "default": "glmforge-s3"},
        "gpus": {"type": "integer", "default": gpus},
        "cpu": {"type": "string", "default": "64"},
        "memory": {"type": "string", "default": "1000Gi"},
        "node_selector": {"type": "object", "additionalProperties": {"type": "string"}, "default": GPU_NODE_SELECTOR,
                          "description": "labels of the GPU node group's nodes (default: NVIDIA GPU feature "
                                         "discovery's)"},
        "tolerations": {"type": "array", "items": {"type": "object"}, "default": GPU_TOLERATIONS,
                        "description": "taints of the GPU node group the pods tolerate"},
        "finished_job_ttl": {"type": "integer", "default": 86400},
        "termination_grace_period_seconds": {
            "type": "integer", "default": pod_grace_seconds(cfg),
            "description": "SIGTERM to SIGKILL on eviction: at least the config's largest preempt_grace_s plus "
                           "the launcher's teardown; `glmforge grace-period --preset NAME` prints it"},
        "job_watch_timeout_seconds": {"type": "integer"},
        "pod_watch_timeout_seconds": {"type": "integer", "default": 600},
        "stream_output": {"type": "boolean", "default": True},
        "cluster_config": {"type": "object", "title": "Cluster Config", "default": None},
    }
    if gpus is None:  # a node group: GPUs per pod are launch.nproc_per_node, not a knob
        del props["gpus"]
    return {"type": "object", "properties": props}


def base_job_template(cfg, gpus: int | None = None) -> dict[str, Any]:
    """The single-pod work-pool template (the `single` group's)."""
    gpus = gpus if gpus is not None else node_groups(cfg)[0].gpus_per_node
    manifest = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"generateName": "{{ name }}-", "labels": "{{ labels }}", "namespace": "{{ namespace }}"},
        "spec": {
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": "{{ finished_job_ttl }}",
            "template": {
                "spec": {
                    **PREFECT_WORKER_POD_KEYS,
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": "{{ termination_grace_period_seconds }}",
                    "serviceAccountName": "{{ service_account_name }}",
                    "nodeSelector": "{{ node_selector }}",
                    "tolerations": "{{ tolerations }}",
                    "containers": [{
                        "name": "prefect-job",
                        "image": "{{ image }}",
                        "imagePullPolicy": "{{ image_pull_policy }}",
                        "args": "{{ command }}",
                        "env": "{{ env }}",
                        "envFrom": [{"secretRef": {"name": "{{ store_secret }}"}}],
                        "resources": {
                            "limits": {"nvidia.com/gpu": "{{ gpus }}", "memory": "{{ memory }}"},
                            "requests": {"nvidia.com/gpu": "{{ gpus }}", "cpu": "{{ cpu }}", "memory": "{{ memory }}"},
                        },
                        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                    }],
                    "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                }
            },
        },
    }
    return {
        "job_configuration": {
            "command": "{{ command }}",
            "env": "{{ env }}",
            "labels": "{{ labels }}",
            "name": "{{ name }}",
            "namespace": "{{ namespace }}",
            "job_manifest": manifest,
            "cluster_config": "{{ cluster_config }}",
            "job_watch_timeout_seconds": "{{ job_watch_timeout_seconds }}",
            "pod_watch_timeout_seconds": "{{ pod_watch_timeout_seconds }}",
            "stream_output": "{{ stream_output }}",
        },
        "variables": _variables(cfg, gpus, backend_nccl=False),
    }


def node_group_template(cfg, group: NodeGroup) -> dict[str, Any]:
    """A training group's work-pool template: the single-pod one made an Indexed Job of
    `group.nodes` pods, each with `group.gpus_per_node` GPUs, that find pod 0 through the
    group's headless Service."""
    launch = group.launch
    t = copy.deepcopy(base_job_template(cfg, gpus=group.gpus_per_node))
    t["variables"] = _variables(cfg, None, backend_nccl=launch.backend != "gloo")
    job = t["job_configuration"]["job_manifest"]
    job["spec"].update({
        "completions": group.nodes,
        "parallelism": group.nodes,
        "completionMode": "Indexed",
        # pod 0 runs the stage; the others serve its launcher and are stopped when it is done
        "successPolicy": {"rules": [{"succeededIndexes": "0"}]},
    })
    job["spec"]["template"]["metadata"] = {"labels": {GROUP_LABEL: group.name}}
    pod = job["spec"]["template"]["spec"]
    pod["subdomain"] = group.service
    c = pod["containers"][0]
    gpus = {"nvidia.com/gpu": group.gpus_per_node}
    c["resources"] = {"limits": {**gpus, "memory": "{{ memory }}"},
                      "requests": {**gpus, "cpu": "{{ cpu }}", "memory": "{{ memory }}"}}
    # A list: the worker puts the `env` variable in front of it. $(VAR) refers to an earlier entry.
    c["env"] = [
        {"name": "GLMFORGE_NODE_GROUP", "value": group.name},
        {"name": "GLMFORGE_JOB_NAME",
         "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/job-name']"}}},
        {"name": "GLMFORGE_SUBDOMAIN", "value": group.service},
        {"name": "NODE_RANK",
         "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        {"name": "NNODES", "value": str(group.nodes)},
        {"name": "GPUS_PER_NODE", "value": str(group.gpus_per_node)},
        {"name": "MASTER_ADDR", "value": f"$(GLMFORGE_JOB_NAME)-0.{group.service}"},
        {"name": "MASTER_PORT", "value": str(group.master_port)},
    ]
    if group.multi_node:
        t["variables"]["properties"].update({
            "scratch_claim": {"type": "string", "default": "glmforge-scratch", "description":
                              f"ReadWriteMany PersistentVolumeClaim mounted at {SCRATCH} on every pod: the rank "
                              "spec and the DeepSpeed checkpoints must be seen by all nodes"},
            "ssh_secret": {"type": "string", "default": "glmforge-ssh", "description":
                           "Kubernetes Secret with id_ed25519, authorized_keys and config (ssh keys of the "
                           "DeepSpeed launcher's pdsh), mounted at /root/.ssh"},
            "worker_command": {"type": "string", "default": "/usr/sbin/sshd -D -e", "description":
                               "what every pod runs for the launcher on pod 0 to reach it (pod 0 too, in the "
                               "background)"},
        })
        c["command"] = ["python", "-m", "glmforge.k8s"]
        c["env"] += [{"name": "GLMFORGE_HOSTFILE", "value": launch.hostfile},
                     {"name": "GLMFORGE_WORKER_COMMAND", "value": "{{ worker_command }}"}]
        c["volumeMounts"] += [{"name": "hostfile", "mountPath": os.path.dirname(launch.hostfile)},
                              {"name": "ssh", "mountPath": "/root/.ssh", "readOnly": True},
                              {"name": "scratch", "mountPath": SCRATCH}]
        pod["volumes"] += [{"name": "hostfile", "emptyDir": {}},
                           {"name": "ssh", "secret": {"secretName": "{{ ssh_secret }}", "defaultMode": 0o600}},
                           {"name": "scratch", "persistentVolumeClaim": {"claimName": "{{ scratch_claim }}"}}]
        c["ports"] = [{"name": "ssh", "containerPort": SSH_PORT}]
    return t


def headless_service(group: NodeGroup) -> dict[str, Any]:
    """The Service that gives every pod of the group a DNS name (<job>-<index>.<service>)."""
    ports = [{"name": "rendezvous", "port": group.master_port}]
    if group.multi_node:
        ports.append({"name": "ssh", "port": SSH_PORT})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": group.service, "labels": {GROUP_LABEL: group.name}},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # names resolve as soon as the pods have addresses
            "selector": {GROUP_LABEL: group.name},
            "ports": ports,
        },
    }


def prefect_server(database_secret: str = "glmforge-prefect-db") -> dict[str, Any]:
    """The Prefect server for the cluster (a Deployment and its Service) on PostgreSQL: the
    database URL (postgresql+asyncpg://...) comes from the Secret `database_secret` (key `url`),
    never from this file."""
    labels = {"app.kubernetes.io/name": "glmforge-prefect-server"}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "glmforge-prefect-server", "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{
                    "name": "prefect-server",
                    "image": "glmforge:latest",
                    "command": ["prefect", "server", "start", "--host", "0.0.0.0", "--port", str(PREFECT_PORT)],
                    "env": [
                        {"name": "PREFECT_SERVER_DATABASE_CONNECTION_URL",
                         "valueFrom": {"secretKeyRef": {"name": database_secret, "key": "url"}}},
                        {"name": "PREFECT_SERVER_ANALYTICS_ENABLED", "value": "false"},
                    ],
                    "ports": [{"name": "api", "containerPort": PREFECT_PORT}],
                    "readinessProbe": {"httpGet": {"path": "/api/health", "port": PREFECT_PORT},
                                       "periodSeconds": 10},
                    "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
                }]},
            },
        },
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "glmforge-prefect-server", "labels": labels},
               "spec": {"selector": labels, "ports": [{"name": "api", "port": PREFECT_PORT}]}}
    return {"prefect-server/deployment.json": deployment, "prefect-server/service.json": service}


def render(cfg) -> dict[str, Any]:
    """Every file of deployments/k8s for this config: relative path -> JSON object."""
    groups = node_groups(cfg)
    files: dict[str, Any] = {}
    index: dict[str, Any] = {}
    for g in groups:
        entry = {"stages": list(g.stages), "nodes": g.nodes, "gpus_per_node": g.gpus_per_node,
                 "work_pool": g.work_pool, "base_job_template": g.template_path}
        if g.launch is None:
            files[g.template_path] = base_job_template(cfg, g.gpus_per_node)
        else:
            files[g.template_path] = node_group_template(cfg, g)
            files[f"{g.name}/service.json"] = headless_service(g)
            entry.update(launcher=g.launch.launcher, service=f"{g.name}/service.json")
        index[g.name] = entry
    files.update(prefect_server())
    files["node-groups.json"] = {"generated_by": "glmforge deploy k8s-templates", "kubernetes": K8S_VERSION,
                                 "groups": index}
    return files


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2) + "\n"


def write(files: dict[str, Any], out: Path) -> list[Path]:
    written = []
    for rel, obj in files.items():
        path = Path(out) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps(obj))
        written.append(path)
    return written


# ---------------------------------------------------------------- checks
def _placeholders(obj: Any) -> set[str]:
    return set(PLACEHOLDER.findall(json.dumps(obj)))


def check_job_template(t: dict[str, Any], where: str = "template") -> None:
    """The Prefect base-job-template shape, as Prefect's server and the Kubernetes worker check
    it (without importing Prefect): both keys; every {{ placeholder }} a declared variable; the
    variables a valid JSON Schema whose defaults fit it; a batch/v1 Job whose first container
    is `prefect-job` and whose pod spec has what the worker requires."""
    import jsonschema

    problems = []
    if set(t) != {"job_configuration", "variables"}:
        problems.append(f"top-level keys are {sorted(t)}, expected job_configuration and variables")
    conf, variables = t.get("job_configuration") or {}, t.get("variables") or {}
    props = variables.get("properties", {})
    missing = sorted(_placeholders(conf) - set(props))
    if missing:
        problems.append(f"job_configuration uses undeclared variable(s) {', '.join(missing)}")
    try:
        jsonschema.Draft202012Validator.check_schema(variables)
    except jsonschema.SchemaError as e:
        problems.append(f"variables is not a JSON Schema: {e.message}")
    else:
        for name, schema in props.items():
            if schema.get("default") is not None:
                errs = list(jsonschema.Draft202012Validator(schema).iter_errors(schema["default"]))
                if errs:
                    problems.append(f"variables.{name}.default: {errs[0].message}")
    job = conf.get("job_manifest", {})
    if (job.get("apiVersion"), job.get("kind")) != ("batch/v1", "Job"):
        problems.append("job_manifest is not a batch/v1 Job")
    pod = job.get("spec", {}).get("template", {}).get("spec", {})
    if [c.get("name") for c in pod.get("containers", [])][:1] != ["prefect-job"]:
        problems.append("job_manifest's first container must be named prefect-job")
    if pod.get("restartPolicy") != "Never":
        problems.append("job_manifest's pod restartPolicy must be Never")
    for k, v in PREFECT_WORKER_POD_KEYS.items():
        if pod.get(k) != v:
            problems.append(f"spec.template.spec.{k} must be {v} (prefect-kubernetes refuses the job otherwise)")
    if problems:
        raise TemplateError(f"{where}: " + "; ".join(problems))


_NOT_SET = object()


def _fill(obj: Any, values: dict[str, Any]) -> Any:
    """Prefect's apply_values: a string that is one placeholder becomes the value (the key or
    item is dropped when there is none), placeholders inside text are substituted."""
    drop = _NOT_SET
    if isinstance(obj, dict):
        out = {k: _fill(v, values) for k, v in obj.items()}
        return {k: v for k, v in out.items() if v is not drop}
    if isinstance(obj, list):
        return [v for v in (_fill(x, values) for x in obj) if v is not drop]
    if isinstance(obj, str):
        m = PLACEHOLDER.fullmatch(obj.strip())
        if m:
            v = values.get(m.group(1))
            return drop if v is None else v
        return PLACEHOLDER.sub(lambda m: str(values.get(m.group(1), "")), obj)
    return obj


def job_from_template(t: dict[str, Any], name: str = "glmforge-check",
                      command: str = "prefect flow-run execute", **values: Any) -> dict[str, Any]:
    """The Job a Kubernetes worker would submit from this template with its defaults (and
    `values`): placeholders filled, `env` as a list in front of the manifest's own entries,
    the command split into args."""
    defaults = {k: s["default"] for k, s in t["variables"]["properties"].items() if s.get("default") is not None}
    vals = {**defaults, "name": name, "command": command, **values}
    job = _fill(copy.deepcopy(t["job_configuration"]["job_manifest"]), vals)
    c = job["spec"]["template"]["spec"]["containers"][0]
    env = [{"name": k, "value": v} for k, v in (vals.get("env") or {}).items()]
    c["env"] = env + (c["env"] if isinstance(c.get("env"), list) else [])
    if isinstance(c.get("args"), str):
        c["args"] = shlex.split(c["args"])
    return job


def validate_object(obj: dict[str, Any], where: str = "", version: str = K8S_VERSION) -> None:
    """Check a Kubernetes object against the API schema of `version` (kubernetes-validate,
    strict: unknown fields are refused). Raises TemplateError naming the field."""
    import kubernetes_validate

    obj = copy.deepcopy(obj)
    if obj.get("kind") == "Job":
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for k, v in PREFECT_WORKER_POD_KEYS.items():
            if pod.get(k) == v:
                del pod[k]
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        field = ".".join(str(p) for p in e.path) or "(top level)"
        raise TemplateError(f"{where or obj.get('kind')}: {field}: {e.message} "
                            f"(Kubernetes {e.version} schema)") from None
    except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
        raise TemplateError(f"{where}: {e.message}") from None


def check_rendered(files: dict[str, Any], kubernetes: bool = True) -> list[str]:
    """Check every rendered file (see the module docstring); returns one line per check made."""
    done = []
    for rel, obj in files.items():
        if "job_configuration" in obj:
            check_job_template(obj, rel)
            done.append(f"{rel}: Prefect base job template shape")
            if kubernetes:
                validate_object(job_from_template(obj), f"{rel} (filled with its defaults)")
                done.append(f"{rel}: its Job, filled with the defaults, against the Kubernetes {K8S_VERSION} schema")
        elif "kind" in obj and kubernetes:
            validate_object(obj, rel)
            done.append(f"{rel}: {obj['kind']} against the Kubernetes {K8S_VERSION} schema")
    return done


# ---------------------------------------------------------------- in the pod
def wait_for_ports(hosts: list[str], port: int, timeout: float, every: float = 2.0) -> None:
    """Until every host accepts a TCP connection on port (the pods start in any order)."""
    deadline = time.monotonic() + timeout
    for h in hosts:
        while True:
            try:
                socket.create_connection((h, port), timeout=min(5.0, every)).close()
                break
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise SystemExit(f"glmforge.k8s: {h}:{port} not reachable after {timeout:.0f} s ({e})")
                time.sleep(every)


def node_main(argv: list[str], env=os.environ, wait_s: float = 600.0) -> None:
    """`python -m glmforge.k8s CMD...`, the entry of a multi-node group's pods. Pods 1..N-1 run
    the worker command (sshd). Pod 0 writes the DeepSpeed hostfile of the group's pods, starts
    the worker command too (the launcher reaches every host of the hostfile over ssh, its own
    included), waits until every pod accepts ssh, then runs CMD (the Prefect flow run)."""
    worker = shlex.split(env.get("GLMFORGE_WORKER_COMMAND", ""))
    if int(env["NODE_RANK"]) != 0:
        if not worker:
            raise SystemExit("glmforge.k8s: no GLMFORGE_WORKER_COMMAND for this node")
        os.execvp(worker[0], worker)
    from training.config import LaunchConfig
    from training.launch import hostfile_text

    nnodes, gpus = int(env["NNODES"]), int(env["GPUS_PER_NODE"])
    hosts = [f"{env['GLMFORGE_JOB_NAME']}-{i}.{env['GLMFORGE_SUBDOMAIN']}" for i in range(nnodes)]
    launch = LaunchConfig(launcher="deepspeed", nproc_per_node=gpus, nnodes=nnodes,
                          hostfile=env["GLMFORGE_HOSTFILE"], master_port=int(env.get("MASTER_PORT", 29500)))
    Path(launch.hostfile).write_text(hostfile_text(hosts, launch))
    if worker:
        subprocess.Popen(worker)
    wait_for_ports(hosts, SSH_PORT, wait_s)
    if not argv:
        raise SystemExit("glmforge.k8s: no command to run on node 0")
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    node_main(sys.argv[1:])
