"""Imports point down only, never up and never sideways:

    flows -> tasks -> glmforge (the application: registry, config, CLI, curate, serve)
          -> posttrain (stage drivers) -> rl (the RL library) -> training
          -> domains (tasks, tools, prompt pools) -> chat, quant, evals -> data_processing
          -> the glmforge contract (stage, store, runner, shutdown, gpus, tracking) -> model -> kernels

A library imports itself and the ranks below it; two libraries of one rank (chat, quant, evals)
do not import each other. Libraries never import Prefect, the application or the flows; the
contract knows no concrete stage. The CLI starts flows by entrypoint (the strings prefect.yaml
deploys), not by import."""
from __future__ import annotations

import ast
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
LIBRARIES = ("data_processing", "chat", "quant", "evals", "domains", "training", "rl", "posttrain")
CONTRACT = ("glmforge.stage", "glmforge.store", "glmforge.runner", "glmforge.shutdown", "glmforge.gpus",
            "glmforge.tracking")
RANK = {"kernels": 0, "model": 1, "data_processing": 2, "chat": 3, "quant": 3, "evals": 3, "domains": 4,
        "training": 5, "rl": 6, "posttrain": 7, "glmforge": 8, "tasks": 9, "flows": 10}


def _rank(module: str) -> float | None:
    if any(module == c or module.startswith(c + ".") for c in CONTRACT):
        return 1.5
    return RANK.get(module.split(".")[0])


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from glmforge import shutdown` imports glmforge.shutdown, not the package
            found |= {f"{node.module}.{a.name}" if node.module == "glmforge" else node.module for a in node.names}
    return found


def test_imports_point_down_only():
    upward = []
    for top in RANK:
        for path in sorted((REPO / top).rglob("*.py")):
            me = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            for name in sorted(_imports(path)):
                if _rank(name) is None:
                    continue
                if _rank(name) > _rank(me):
                    upward.append(f"{me} imports {name}")
                elif _rank(name) == _rank(me) and name.split(".")[0] != top and _rank(me) != 1.5:
                    upward.append(f"{me} imports {name} (sideways)")
                if top in LIBRARIES + ("model", "kernels") and name.split(".")[0] == "prefect":
                    upward.append(f"{me} imports {name} (library code does not import Prefect)")
    assert upward == []


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
