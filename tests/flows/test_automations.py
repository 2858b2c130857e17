"""deployments/automations.yaml: the rerun of a preempted (or crashed: its machine died) flow run
gets that run's own parameters, with their types, and preemptions + 1 — rendered by Prefect's own
action code (the end-to-end reruns are in test_deployments.py) — and every automation is one
Prefect's schema takes."""
from __future__ import annotations

import copy
import inspect
import uuid

import pytest
import yaml

from glmforge.serve import AUTOMATIONS


def _render(action: dict, parameters: dict) -> dict:
    from prefect.server.events.actions import RunDeployment
    from prefect.server.schemas.responses import FlowRunResponse
    from prefect.utilities.schema_tools.hydration import HydrationContext, hydrate

    act = RunDeployment(**action)
    params = copy.deepcopy(act.parameters)
    act._upgrade_v1_templates(params)   # what render_parameters does first
    run = FlowRunResponse(id=uuid.uuid4(), name="preempted", flow_id=uuid.uuid4(), parameters=parameters)
    return hydrate(params, HydrationContext(render_jinja=True, jinja_context={"flow_run": run}, raise_on_error=True))


def test_every_automation_is_valid_for_prefect():
    from prefect.events.schemas.automations import AutomationCore

    automations = yaml.safe_load(AUTOMATIONS.read_text())["automations"]
    assert len({a["name"] for a in automations}) == len(automations) == 6
    for a in automations:
        AutomationCore.model_validate(a)


@pytest.mark.parametrize("why", ["preempted", "crashed"])
@pytest.mark.parametrize("flow_name", ["glmforge-pipeline", "glmforge-stage"])
def test_the_rerun_carries_the_flow_runs_parameters_and_counts_preemptions(flow_name, why):
    from flows.end_to_end import pipeline, stage

    fn = {"glmforge-pipeline": pipeline, "glmforge-stage": stage}[flow_name].fn
    [automation] = [a for a in yaml.safe_load(AUTOMATIONS.read_text())["automations"]
                    if a["name"] == f"glmforge-rerun-{why}-{flow_name.split('-')[1]}"]
    assert automation["trigger"]["match_related"]["prefect.resource.name"] == flow_name
    assert automation["actions"][0]["source"] == "inferred"       # the same deployment
    # every parameter of the flow is passed on, nothing else (the deployment validates them)
    assert set(automation["actions"][0]["parameters"]) == set(inspect.signature(fn).parameters)

    given = {"stage": "pretrain", "preset": None, "config_file": "my.yaml", "overrides": ["pretrain.lr=0.01"],
             "store": "s3://bucket/run", "until": "sft", "run_id": "20261201-x"}
    first = _render(automation["actions"][0], given)
    assert first == {**{k: given.get(k) for k in first if k != "preemptions"}, "preemptions": 1}
    assert _render(automation["actions"][0], {**given, "preemptions": 4})["preemptions"] == 5
