"""Imports point down only, never up and never sideways:

    flows -> tasks -> glmforge (the application: stage registry, config, CLI, report, serve, k8s)
          -> posttrain (stage drivers) -> rl (the RL library) -> training
          -> domains (tasks, tools, prompt pools) -> chat, quant, evals -> data_processing
          -> runtime (the stage contract: stage, store, runner, shutdown, gpus, tracking)
          -> model -> kernels

A library imports itself and the ranks below it; two libraries of one rank (chat, quant, evals)
do not import each other. Libraries never import Prefect, the application or the flows; the
runtime knows no concrete stage. No modules import each other in a cycle, lazily or not. The CLI
starts flows by entrypoint (the strings prefect.yaml deploys) and reaches the schedule client
(tasks.schedules, Prefect's client) by module name, not by import: only flows/ and tasks/ import
Prefect."""
from __future__ import annotations

import ast
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
LIBRARIES = ("data_processing", "chat", "quant", "evals", "domains", "training", "rl", "posttrain")
RANK = {"kernels": 0, "model": 1, "runtime": 2, "data_processing": 3, "chat": 4, "quant": 4, "evals": 4,
        "domains": 5, "training": 6, "rl": 7, "posttrain": 8, "glmforge": 9, "tasks": 10, "flows": 11}


def _rank(module: str) -> int | None:
    return RANK.get(module.split(".")[0])


def _modules() -> dict[str, Path]:
    return {".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): path
            for top in RANK for path in sorted((REPO / top).rglob("*.py"))}


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from runtime import shutdown` imports runtime.shutdown, not the package
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                      for a in node.names}
    return found


def test_imports_point_down_only():
    upward = []
    for me, path in MODULES.items():
        top = me.split(".")[0]
        for name in sorted(_imports(path)):
            if _rank(name) is None:
                continue
            if _rank(name) > _rank(me):
                upward.append(f"{me} imports {name}")
            elif _rank(name) == _rank(me) and name.split(".")[0] != top:
                upward.append(f"{me} imports {name} (sideways)")
            if top not in ("flows", "tasks") and name.split(".")[0] == "prefect":
                upward.append(f"{me} imports {name} (library code does not import Prefect)")
    assert upward == []


def test_no_modules_import_each_other_in_a_cycle():
    """A cycle (even through an import inside a function) means neither module can be understood,
    tested or moved without the other; a package's __init__ that its own modules import counts."""
    graph = {me: {n for n in _imports(path) if n in MODULES and n != me} for me, path in MODULES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_cli_starts_the_flows_prefect_deploys():
    from glmforge.cli import PIPELINE_FLOW, STAGE_FLOW

    deployed = {d["entrypoint"] for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    for ref in (PIPELINE_FLOW, STAGE_FLOW):
        module, attr = ref.split(":")
        assert f"{module.replace('.', '/')}.py:{attr}" in deployed


def test_no_two_classes_share_a_name():
    """One name per thing: a class name names one class in the project's modules."""
    where: dict[str, list[str]] = {}
    for top in RANK:
        for path in sorted((REPO / top).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, []).append(str(path.relative_to(REPO)))
    assert {k: v for k, v in where.items() if len(v) > 1} == {}
