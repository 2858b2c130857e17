"""The Prefect UI in a real browser: `glmforge serve` (the session's, tests/flows/conftest.served),
the pipeline and one stage deployment run by its worker, then Debian's chromium (headless,
driven over the DevTools protocol) loads the pages a user looks at and reads what they show.

The test is `slow` (still part of `make test`). It runs the `tiny` preset cut to a few steps per
stage (tests/flows/conftest.FAST) through sft, which the served home already holds (a copy of the
session's tiny run): every stage is then cached, which still creates each task run with its
artifacts (the quality histogram, the training stages' loss curves). Real work through the worker
is test_deployments' (a stage trained, a preempted one rerun by the automation)."""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")
STAGE_DEPLOYMENT = "stage-dedup-exact"  # a stage with parents: it must take them from the store
TRAINING = ("pretrain", "context-1", "context-2", "context-3", "dsa-warmup", "dsa-adapt", "sft")


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    pytest.skip("no chromium on PATH: `apt-get install chromium` (.ci/run installs it when it can)")


class Chromium:
    """Headless chromium with one page, driven over the DevTools protocol (a websocket)."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 1000):
        from websockets.sync.client import connect

        profile.mkdir(parents=True)
        self.log = profile / "chromium.log"
        self.proc = subprocess.Popen(
            # no software WebGL: the flow-run graph (a canvas) would redraw on 1-2 cores for as
            # long as its page is open; the pages' text, tabs and images do not need it
            [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-software-rasterizer",
             "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--remote-debugging-port=0", f"--window-size={width},{height}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"), start_new_session=True,
        )
        port_file = profile / "DevToolsActivePort"  # chromium writes the port it picked here
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"chromium did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self._id = 0
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:  # events arrive in between; we only wait for our answer
            msg = json.loads(self.ws.recv(timeout=120))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"DevTools {method}: {msg['error']}")
                return msg["result"]

    def js(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page JS failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        return self.js("document.body ? document.body.innerText : ''") or ""

    def wait_for(self, check, what: str, timeout: float = 90):
        """Poll the page until `check(text)` is truthy; the UI renders after its API calls return."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            if result := check(text):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"the page at {self.js('location.href')} never showed {what}; it shows:\n{text[:4000]}")
            time.sleep(0.5)

    def click(self, label: str) -> None:
        """Click the innermost element whose whole text is `label` (a tab, a link)."""
        found = self.js(
            "(l => { const e = Array.from(document.querySelectorAll('li, button, a, [role=tab]'))"
            ".filter(e => e.innerText && e.innerText.trim() === l).pop(); if (e) e.click(); return !!e; })"
            f"({json.dumps(label)})"
        )
        assert found, f"no {label!r} on {self.js('location.href')}"

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _run_deployment(served, name: str, params: dict, timeout: int) -> str:
    """`prefect deployment run NAME --watch` as a user types it; returns the flow run id."""
    run = subprocess.run([PREFECT, "deployment", "run", name, "--params", json.dumps(params), "--watch",
                          "--watch-timeout", str(timeout)], env=served.env, cwd=REPO, capture_output=True, text=True,
                         timeout=timeout + 120)
    detail = f"{run.stdout[-3000:]}{run.stderr[-3000:]}\n--- serve.log ---\n{served.logs()}"
    assert run.returncode == 0 and "Completed" in run.stdout, detail
    return re.search(r"UUID: ([0-9a-f-]{36})", run.stdout).group(1)


def _api(api: str, path: str, body: dict) -> list[dict]:
    from tasks.schedules import call

    return call(api, "POST", path, body)


def _task_rows(text: str) -> dict[str, str]:
    """Stage task runs (named stage + '-' + 3 hex) and the state shown under each, from the Task Runs tab."""
    from glmforge.pipeline import stages_until

    registry = {s.name for s in stages_until(None)}
    lines = [ln.strip() for ln in text.splitlines()]
    return {m.group(1): lines[i + 1] for i, ln in enumerate(lines[:-1])
            if (m := re.fullmatch(r"(.+)-[0-9a-f]{3}", ln)) and m.group(1) in registry}


def _check_flow_run(chrome: Chromium, base: str, api: str, flow_run_id: str, stages: list[str],
                    images: set[str], shots: Path, tag: str, states=("Completed", "Cached")) -> None:
    """The flow-run page shows one finished task per stage, each stage's metrics table and images."""
    chrome.goto(f"{base}/runs/flow-run/{flow_run_id}")
    chrome.wait_for(lambda t: "Completed" in t and f"{len(stages)} Task run" in t, f"{len(stages)} task runs, Completed")
    chrome.screenshot(shots / f"{tag}-flow-run.png")

    chrome.click("Task Runs")
    rows = chrome.wait_for(lambda t: (r := _task_rows(t)) and set(stages) <= set(r) and r, f"task runs {stages}")
    assert sorted(rows) == sorted(stages), rows
    assert {s for s, state in rows.items() if state not in states} == set(), rows
    chrome.screenshot(shots / f"{tag}-task-runs.png")

    chrome.click("Artifacts")
    keys = {f"{s}-metrics" for s in stages} | images
    chrome.wait_for(lambda t: keys <= set(t.splitlines()), f"artifact cards {sorted(keys)}")
    chrome.screenshot(shots / f"{tag}-artifacts.png")

    # An artifact's own page: a table of the stage's metrics, or the PNG itself, decoded by the
    # browser. Every card is listed above; one page of each kind (a curation stage's, a training
    # stage's, the last stage's) is opened, as every stage's page is the same UI on its own data.
    artifacts = {a["key"]: a for a in _api(api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})}
    opened = [s for s in stages if s in (stages[0], TRAINING[0], stages[-1])]
    for stage in opened:
        art = artifacts[f"{stage}-metrics"]
        table = art["data"] if isinstance(art["data"], list) else json.loads(art["data"])
        chrome.goto(f"{base}/artifacts/artifact/{art['id']}")
        shown = [row for row in table if len(row["value"]) < 40][:3]  # long JSON values wrap in the cell
        expect = ["metric", "value", f"{len(table)} Item"] + [v for row in shown for v in (row["metric"], row["value"])]
        chrome.wait_for(lambda t: all(e in t for e in expect), f"the {stage} metrics table ({expect})")
    for key in sorted(k for k in images if not k.endswith("-loss") or k.removesuffix("-loss") in opened):
        chrome.goto(f"{base}/artifacts/artifact/{artifacts[key]['id']}")
        size = chrome.wait_for(lambda t: chrome.js(
            "(() => { const i = Array.from(document.images).find(i => i.src.startsWith('data:image/png;base64,'));"
            " return i && i.complete && i.naturalWidth > 0 ? [i.naturalWidth, i.naturalHeight] : null; })()"),
            f"the {key} image, decoded")
        assert min(size) >= 100, (key, size)
        chrome.screenshot(shots / f"{tag}-{key}.png")


def _check_deployments(chrome: Chromium, base: str, shots: Path) -> None:
    names = [d["name"] for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]]
    chrome.goto(f"{base}/deployments")
    chrome.wait_for(lambda t: f"{len(names)} Deployments" in t and "end-to-end" in t and STAGE_DEPLOYMENT in t,
                    f"{len(names)} deployments with end-to-end and {STAGE_DEPLOYMENT}")
    chrome.screenshot(shots / "deployments.png")


def _check_ui(tmp_path: Path, served, pipeline_run: str, stages: list[str], images: set[str],
              stage_params: dict) -> None:
    """Run the stage deployment after the pipeline (same store), then check every page in chromium."""
    base = served.base
    stage_run = _run_deployment(served, f"glmforge-stage/{STAGE_DEPLOYMENT}", stage_params, 600)
    shots = tmp_path / "screenshots"
    shots.mkdir()
    chrome = Chromium(tmp_path / "chromium-profile")
    try:
        _check_flow_run(chrome, base, served.api, pipeline_run, stages, images, shots, "pipeline")
        # The pipeline published this stage in the same store: its deployment reports it cached.
        _check_flow_run(chrome, base, served.api, stage_run, [STAGE_DEPLOYMENT.removeprefix("stage-")], set(), shots, "stage",
                        states=("Cached",))
        _check_deployments(chrome, base, shots)
    finally:
        chrome.close()
    for png in shots.iterdir():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, png


@pytest.mark.timeout(1200)
def test_ui_shows_every_stage_of_the_tiny_pipeline(served, tmp_path):
    """The 16 stages through sft of the session's tiny run (FAST), cached in the served home: one
    task each with its metrics table, the loss curves of the training stages. (Past sft the
    post-training stages add more artifact cards than the Artifacts tab lists on one page.)"""
    from glmforge.pipeline import stages_until
    from tests.flows.conftest import FAST

    _chromium()
    stages = [s.name for s in stages_until("sft")]
    assert len(stages) >= 16, stages
    run = _run_deployment(served, "glmforge-pipeline/end-to-end", {"preset": "tiny", "overrides": FAST, "until": "sft"},
                          900)
    _check_ui(tmp_path, served, run, stages, {"quality-quality-histogram"} | {f"{s}-loss" for s in TRAINING},
              {"preset": "tiny", "overrides": FAST})
