"""Imports point down only:

    flows -> tasks -> glmforge (the application: registry, config, CLI, curate, serve)
          -> libraries (data_processing, training, posttrain, rl, evals)
          -> the glmforge contract (stage, store, runner, shutdown) and model -> kernels

Libraries never import Prefect, the application or the flows; the contract knows no concrete
stage. The CLI starts flows by entrypoint (the strings prefect.yaml deploys), not by import."""
from __future__ import annotations

import ast
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
LIBRARIES = ("data_processing", "training", "posttrain", "rl", "evals")
CONTRACT = ("glmforge.stage", "glmforge.store", "glmforge.runner", "glmforge.shutdown")
RANK = {"kernels": 0, "model": 1, **{lib: 2 for lib in LIBRARIES}, "glmforge": 3, "tasks": 4, "flows": 5}


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
                if _rank(name) is not None and _rank(name) > _rank(me):
                    upward.append(f"{me} imports {name}")
                if top in LIBRARIES + ("model", "kernels") and name.split(".")[0] == "prefect":
                    upward.append(f"{me} imports {name} (library code does not import Prefect)")
    assert upward == []


def test_the_cli_starts_the_flows_prefect_deploys():
    from glmforge.cli import PIPELINE_FLOW, STAGE_FLOW

    deployed = {d["entrypoint"] for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    for ref in (PIPELINE_FLOW, STAGE_FLOW):
        module, attr = ref.split(":")
        assert f"{module.replace('.', '/')}.py:{attr}" in deployed
