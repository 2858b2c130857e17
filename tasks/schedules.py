"""Deployment schedules on a Prefect server, through Prefect's client (`glmforge schedule ...`).

The end-to-end deployment in prefect.yaml carries a nightly cron that is inactive until turned on."""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import httpx
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.schedules import CronSchedule, IntervalSchedule
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings
from pydantic import ValidationError

DEFAULT_API = "http://127.0.0.1:4200/api"  # `glmforge serve`'s default
PIPELINE_DEPLOYMENT = "glmforge-pipeline/end-to-end"
TIMEOUT_S = 30.0
T = TypeVar("T")


class ScheduleError(RuntimeError):
    pass


def api_url(api: str | None = None) -> str:
    return (api or os.environ.get("PREFECT_API_URL") or DEFAULT_API).rstrip("/")


# a busy Prefect server answers 503 without acting on the request (seen under load in the tests)
RETRY_STATUSES, RETRY_DELAYS_S = (503,), (0.5, 1.0, 2.0, 4.0)


@contextmanager
def client(api: str) -> Iterator[SyncPrefectClient]:
    """Prefect's client of the server at `api`, its own retries off: retried() retries a busy server
    after RETRY_DELAYS_S, not after 2, 4, 8, 16 and 32 s (with retries off, Prefect 3.9 still waits
    about 2 s after a 503 before it hands the answer back)."""
    with temporary_settings({PREFECT_API_URL: api, PREFECT_CLIENT_MAX_RETRIES: 0}):
        with get_client(httpx_settings={"timeout": TIMEOUT_S}, sync_client=True) as c:
            yield c


def retried(api: str, request: Callable[[], T]) -> T:
    """One request of Prefect's client to the server at `api`; a busy server (503) is retried."""
    for delay in (*RETRY_DELAYS_S, None):
        try:
            return request()
        except (httpx.HTTPStatusError, ObjectNotFound) as e:
            err = e.http_exc if isinstance(e, ObjectNotFound) else e
            if not isinstance(err, httpx.HTTPStatusError):
                raise
            if err.response.status_code not in RETRY_STATUSES or delay is None:
                detail = err.response.content.decode(errors="replace")[:500]
                raise ScheduleError(f"{err.request.method} {err.request.url}: HTTP {err.response.status_code}: "
                                    f"{detail}") from None
        except (httpx.TransportError, OSError) as e:
            raise ScheduleError(
                f"no Prefect server at {api} ({e}); start one with `glmforge serve` or set PREFECT_API_URL"
            ) from None
        time.sleep(delay)
    raise AssertionError("unreachable")


def call(api: str, method: str, path: str, body: Any = None) -> Any:
    """One REST call to the Prefect server at `api` (its JSON answer); a busy server (503) is retried."""
    with client(api) as c:
        r = retried(api, lambda: c.request(method, path, json=body))
    return r.json() if r.content else None


def deployment(api: str, name: str) -> dict[str, Any]:
    """`FLOW/DEPLOYMENT` (e.g. glmforge-pipeline/end-to-end) -> the deployment object."""
    flow, sep, dep = name.partition("/")
    if not sep or not flow or not dep:
        raise ScheduleError(f"deployment {name!r}: expected FLOW/DEPLOYMENT, e.g. {PIPELINE_DEPLOYMENT}")
    missing = ScheduleError(f"no deployment {name!r} on {api}; `glmforge schedule ls` lists them")
    if "/" in dep:   # no deployment's name has one (the server answers 404)
        raise missing
    with client(api) as c:
        try:
            return retried(api, lambda: c.read_deployment_by_name(f"{flow}/{dep}")).model_dump(mode="json")
        except ScheduleError as e:
            if "HTTP 404" in str(e):
                raise missing from None
            raise


def describe(schedule: dict[str, Any]) -> str:
    s = schedule.get("schedule") or {}
    if "cron" in s:
        return f"cron {s['cron']!r} {s.get('timezone') or 'UTC'}"
    if "interval" in s:
        return f"every {s['interval']:g} s"
    if "rrule" in s:
        return f"rrule {s['rrule']!r}"
    return json.dumps(s)


def list_schedules(api: str) -> list[tuple[str, dict[str, Any]]]:
    """(FLOW/DEPLOYMENT, schedule) for every schedule of every deployment."""
    with client(api) as c:
        flows = {str(f.id): f.name for f in retried(api, c.read_flows)}
        deployments = [d.model_dump(mode="json") for d in retried(api, c.read_deployments)]
    out = []
    for d in sorted(deployments, key=lambda d: (flows.get(d["flow_id"], ""), d["name"])):
        name = f"{flows.get(d['flow_id'], '?')}/{d['name']}"
        for s in d.get("schedules") or []:
            out.append((name, s))
    return out


def set_active(api: str, name: str, active: bool) -> list[dict[str, Any]]:
    """Turn every schedule of deployment `name` on or off; returns them."""
    d = deployment(api, name)
    if not d.get("schedules"):
        raise ScheduleError(f"deployment {name!r} has no schedule; add one with `glmforge schedule add`")
    with client(api) as c:
        for s in d["schedules"]:
            retried(api, lambda: c.update_deployment_schedule(d["id"], s["id"], active=active))
        if active and d.get("paused"):  # a paused deployment ignores its schedules
            retried(api, lambda: c.resume_deployment(d["id"]))
        return [s.model_dump(mode="json") for s in retried(api, lambda: c.read_deployment_schedules(d["id"]))]


def add(api: str, name: str, every: float | None = None, cron: str | None = None,
        timezone: str = "UTC", parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """Add an active schedule (an interval in seconds, or a cron expression) to deployment `name`;
    `parameters` override the deployment's for the runs it creates."""
    if (every is None) == (cron is None):
        raise ScheduleError("give exactly one of --every SECONDS or --cron EXPR")
    if every is not None and every <= 0:
        raise ScheduleError(f"--every {every}: must be a positive number of seconds")
    try:
        sched = IntervalSchedule(interval=every) if every is not None else CronSchedule(cron=cron, timezone=timezone)
    except ValidationError as e:   # what the server would refuse (422)
        given = f"--every {every}" if every is not None else f"--cron {cron!r} --timezone {timezone!r}"
        raise ScheduleError(f"{given}: {e.errors()[0]['msg']}") from None
    d = deployment(api, name)
    with client(api) as c:
        created = retried(api, lambda: c.create_deployment_schedules(d["id"], [(sched, True)],
                                                                     parameters=dict(parameters or {})))
        if d.get("paused"):
            retried(api, lambda: c.resume_deployment(d["id"]))
    return created[0].model_dump(mode="json")
