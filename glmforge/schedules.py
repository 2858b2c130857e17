"""Deployment schedules on a Prefect server, through its REST API (`glmforge schedule ...`).

The REST API keeps this module free of Prefect imports (and `glmforge schedule ls` fast). The
end-to-end deployment in prefect.yaml carries a nightly cron that is inactive until turned on."""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

DEFAULT_API = "http://127.0.0.1:4200/api"  # `glmforge serve`'s default
PIPELINE_DEPLOYMENT = "glmforge-pipeline/end-to-end"


class ScheduleError(RuntimeError):
    pass


def api_url(api: str | None = None) -> str:
    return (api or os.environ.get("PREFECT_API_URL") or DEFAULT_API).rstrip("/")


# a busy Prefect server answers 503 without acting on the request (seen under load in the tests)
RETRY_STATUSES, RETRY_DELAYS_S = (503,), (0.5, 1.0, 2.0, 4.0)


def call(api: str, method: str, path: str, body: Any = None) -> Any:
    """One REST call to the Prefect server at `api`; a busy server (503) is retried."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{api}{path}", data=data, method=method, headers={"Content-Type": "application/json"})
    for delay in (*RETRY_DELAYS_S, None):
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read()
            return json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            if e.code not in RETRY_STATUSES or delay is None:
                raise ScheduleError(f"{method} {api}{path}: HTTP {e.code}: {detail}") from None
        except OSError as e:
            raise ScheduleError(
                f"no Prefect server at {api} ({e}); start one with `glmforge serve` or set PREFECT_API_URL"
            ) from None
        time.sleep(delay)


def deployment(api: str, name: str) -> dict[str, Any]:
    """`FLOW/DEPLOYMENT` (e.g. glmforge-pipeline/end-to-end) -> the deployment object."""
    flow, sep, dep = name.partition("/")
    if not sep or not flow or not dep:
        raise ScheduleError(f"deployment {name!r}: expected FLOW/DEPLOYMENT, e.g. {PIPELINE_DEPLOYMENT}")
    try:
        return call(api, "GET", f"/deployments/name/{flow}/{dep}")
    except ScheduleError as e:
        if "HTTP 404" in str(e):
            raise ScheduleError(f"no deployment {name!r} on {api}; `glmforge schedule ls` lists them") from None
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
    flows = {f["id"]: f["name"] for f in call(api, "POST", "/flows/filter", {})}
    out = []
    for d in sorted(call(api, "POST", "/deployments/filter", {}), key=lambda d: (flows.get(d["flow_id"], ""), d["name"])):
        name = f"{flows.get(d['flow_id'], '?')}/{d['name']}"
        for s in d.get("schedules") or []:
            out.append((name, s))
    return out


def set_active(api: str, name: str, active: bool) -> list[dict[str, Any]]:
    """Turn every schedule of deployment `name` on or off; returns them."""
    d = deployment(api, name)
    if not d.get("schedules"):
        raise ScheduleError(f"deployment {name!r} has no schedule; add one with `glmforge schedule add`")
    for s in d["schedules"]:
        call(api, "PATCH", f"/deployments/{d['id']}/schedules/{s['id']}", {"active": active})
    if active and d.get("paused"):  # a paused deployment ignores its schedules
        call(api, "PATCH", f"/deployments/{d['id']}", {"paused": False})
    return call(api, "GET", f"/deployments/{d['id']}/schedules")


def add(api: str, name: str, every: float | None = None, cron: str | None = None,
        timezone: str = "UTC", parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """Add an active schedule (an interval in seconds, or a cron expression) to deployment `name`;
    `parameters` override the deployment's for the runs it creates."""
    if (every is None) == (cron is None):
        raise ScheduleError("give exactly one of --every SECONDS or --cron EXPR")
    if every is not None and every <= 0:
        raise ScheduleError(f"--every {every}: must be a positive number of seconds")
    d = deployment(api, name)
    sched = {"interval": every} if every is not None else {"cron": cron, "timezone": timezone}
    created = call(api, "POST", f"/deployments/{d['id']}/schedules",
                    [{"schedule": sched, "active": True, "parameters": dict(parameters or {})}])
    if d.get("paused"):
        call(api, "PATCH", f"/deployments/{d['id']}", {"paused": False})
    return created[0]
