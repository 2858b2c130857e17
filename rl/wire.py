"""Samples and tasks as plain dicts, for the rollout workers' socket and for checkpoints."""
from __future__ import annotations

import dataclasses
from typing import Any

from domains.task import Task
from rl.sample import Sample, Status


def task_to_dict(t: Task) -> dict[str, Any]:
    return dataclasses.asdict(t)


def task_from_dict(d: dict[str, Any]) -> Task:
    return Task(**d)


def sample_to_dict(s: Sample) -> dict[str, Any]:
    d = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
    d["task"] = task_to_dict(s.task)
    d["status"] = s.status.value
    return d


def sample_from_dict(d: dict[str, Any]) -> Sample:
    d = dict(d)
    d["task"] = task_from_dict(d["task"])
    d["status"] = Status(d["status"])
    return Sample(**d)
