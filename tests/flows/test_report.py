"""`glmforge report`: one self-contained HTML page of a run, checked against `status --json` on the
shared tiny run, in headless chromium, and as the pipeline flow's closing Prefect artifact."""
from __future__ import annotations

import asyncio
import html
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glmforge import effects
from glmforge.report import NOT_RECORDED, render
from runtime.runner import RunRecord
from runtime.store import LocalStore

GLMFORGE = [sys.executable, "-m", "glmforge.cli"]
CELL = re.compile(r'<td data-metric="([^"]+)"[^>]*>(.*?)</td>', re.S)


def cells(page: str) -> dict[str, str]:
    """data-metric -> the cell's text (tags stripped, entities decoded)."""
    return {html.unescape(k): html.unescape(re.sub(r"<[^>]+>", "", v)).strip() for k, v in CELL.findall(page)}


def value(text: str) -> float:
    """The number a cell shows first: "1,234", "0.4821", "479.5 ✓", "0 ± 0"."""
    return float(text.split()[0].replace(",", "").rstrip("†‡%"))


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([*GLMFORGE, *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "GLMFORGE_HOME": str(home)})
    assert out.returncode == 0, out.stderr
    return out


@pytest.fixture(scope="module")
def report_page(tiny_run, tmp_path_factory) -> tuple[Path, dict, float]:
    """The page `glmforge report` writes for the tiny run, status --json of that run, and the
    seconds the command took."""
    store = str(tiny_run.home / "store")
    out = tmp_path_factory.mktemp("report")
    start = time.monotonic()
    printed = _cli(tiny_run.home, "report", "--run", tiny_run.run_id, "--out", str(out), "--store", store)
    took = time.monotonic() - start
    path = Path(printed.stdout.strip())
    print(f"\nglmforge report: {path} ({path.stat().st_size / 1e6:.2f} MB) in {took:.1f} s")
    status = json.loads(_cli(tiny_run.home, "status", "--json", "--run", tiny_run.run_id, "--store", store).stdout)
    return path, status, took


def test_page_shows_the_numbers_of_status_json(tiny_run, report_page):
    path, status, _ = report_page
    assert path.parent.is_dir() and path.name.endswith(".html")
    page = path.read_text(encoding="utf-8")
    shown = cells(page)
    metrics = {s["name"]: s["metrics"] for s in status["stages"]}
    assert status["run"]["id"] in page and status["run"]["state"] == "completed"
    for s in status["stages"]:
        assert shown[f"{s['name']}.state"] == s["state"], s["name"]
        assert s["seconds"] is not None and value(shown[f"{s['name']}.seconds"]) == pytest.approx(s["seconds"], rel=1e-3)
    # curation: counts in and out, a drop reason per eval set
    for stage in ("quality", "dedup-exact", "dedup-minhash", "dedup-semantic", "decontaminate"):
        assert value(shown[f"{stage}.in"]) == metrics[stage]["documents_in"]
        assert value(shown[f"{stage}.out"]) == metrics[stage]["kept"]
        assert value(shown[f"{stage}.dropped"]) == metrics[stage]["removed"]
    assert value(shown["ingest.dropped"]) == metrics["ingest"]["quarantined"]
    assert value(shown["ingest.text_bytes"]) == metrics["ingest"]["text_bytes"]
    hits = metrics["decontaminate"]["hits"]
    assert hits and all(value(shown[f"decontaminate.hits.{e}"]) == n for e, n in hits.items())
    # training and SFT
    for stage in ("pretrain", "context-1", "dsa-adapt", "sft"):
        assert value(shown[f"{stage}.loss_last"]) == pytest.approx(metrics[stage]["loss_last"], rel=1e-3)
        assert value(shown[f"{stage}.val_ppl_after"]) == pytest.approx(metrics[stage]["val_ppl_after"], rel=1e-3)
    assert value(shown["sft.quantization.qat_int4.ppl"]) == pytest.approx(
        metrics["sft"]["quantization"]["qat_int4"]["ppl"], rel=1e-3)
    # post-training: rewards first / last, a gate of the chain, the reward model
    for stage in ("rl-reasoning", "rl-agentic", "rl-general"):
        for end in ("first", "last"):
            assert value(shown[f"{stage}.reward.{end}"]) == pytest.approx(metrics[stage]["reward"][end], rel=1e-3, abs=1e-9)
    gate = metrics["distill"]["gates"]["distill"]["heldout_ppl"]
    assert value(shown["gates.heldout_ppl.distill"]) == pytest.approx(gate["after"], rel=1e-3)
    assert shown["gate.distill.heldout_ppl.passed"] == ("yes" if gate["passed"] else "no")
    assert value(shown["reward-model.heldout_pairwise_accuracy.after"]) == pytest.approx(
        metrics["reward-model"]["heldout_pairwise_accuracy"]["after"], rel=1e-3)
    lags = metrics["rl-agentic"]["version_lag_histogram"]
    assert lags and all(value(shown[f"rl-agentic.version_lag_histogram.{k}"]) == n for k, n in lags.items())
    for stage in ("rl-reasoning", "rl-agentic", "rl-general"):  # a stage without reward re-checks says so
        recheck = metrics[stage].get("reward_recheck")
        want = NOT_RECORDED if recheck is None else f"{recheck['rechecked']:,}"
        assert shown[f"{stage}.reward_recheck.rechecked"] == want
    # environments from real repositories: each source's build and its instances
    swe = metrics["swe-envs"]["per_source"]
    assert swe and all(value(shown[f"swe-envs.per_source.{n}.instances"]) == r["instances"]
                       and value(shown[f"swe-envs.per_source.{n}.canaries"]) == r["canaries"] for n, r in swe.items())
    # effects: what glmforge.effects reads from the same metrics, and its verdict
    for name, e in effects.measure(metrics).items():
        if e["value"] is None:
            assert shown[f"effects.{name}"] == shown[f"effects.{name}.passed"] == NOT_RECORDED, name
        else:
            assert value(shown[f"effects.{name}"]) == pytest.approx(e["value"], rel=1e-3, abs=1e-9), name
            assert shown[f"effects.{name}.passed"] == ("yes" if e["passed"] else "no"), name
    # lineage: every published artifact's digest
    store = LocalStore(tiny_run.home / "store")
    for s in status["stages"]:
        assert shown[f"{s['name']}.digest"] == store.manifest(s["name"], s["key"]).digest[:16]


def test_page_is_self_contained(report_page):
    page = report_page[0].read_text(encoding="utf-8")
    # links stay in the page, but for one a reader may follow (not a load): the run's MLflow run
    # (runtime.tracking); URLs elsewhere are text (the run's --set tracking.uri=...)
    links = re.findall(r'\bhref="([^"]*)"', page)
    outside = [h for h in links if not h.startswith("#")]
    assert len(outside) == 1 and re.fullmatch(r"http://127\.0\.0\.1:\d+/#/experiments/\d+/runs/[0-9a-f]+", outside[0])
    assert not re.search(r"\b(?:src|href|action)=\W*https?://", page.replace(f'href="{outside[0]}"', ""))
    assert "<script" not in page.lower() and "<link" not in page.lower()
    sources = re.findall(r'\bsrc="([^"]*)"', page)
    assert len(sources) >= 8 and all(s.startswith("data:image/png;base64,") for s in sources)
    assert "default-src 'none'" in page  # the browser is told to fetch nothing


def test_a_missing_metric_shows_not_recorded_never_zero(tiny_run):
    store = LocalStore(tiny_run.home / "store")
    record = RunRecord.load(store, tiny_run.run_id)
    for s in record.stages:  # what an older stage version or an interrupted stage leaves out
        if s["name"] == "dedup-exact":
            del s["metrics"]["kept"]
        if s["name"] == "rl-reasoning":
            del s["metrics"]["heldout_accuracy"], s["metrics"]["reward"]
        if s["name"] == "pretrain":
            s["seconds"] = None
    shown = cells(render(store, record))
    for metric in ("dedup-exact.out", "rl-reasoning.heldout_accuracy.before", "rl-reasoning.heldout_accuracy.after",
                   "rl-reasoning.reward.first", "rl-reasoning.reward.last", "pretrain.seconds"):
        assert shown[metric] == NOT_RECORDED, metric
    assert shown["dedup-exact.in"] != NOT_RECORDED  # only what is missing


def test_failed_run_page_gives_the_resume_command(tiny_run):
    store = LocalStore(tiny_run.home / "store")
    record = RunRecord.load(store, tiny_run.run_id)
    record.state = "failed"
    for s in record.stages:
        if s["name"] == "rl-general":
            s.update(state="failed", error="GateError: tool_call_validity <fell> 0.5 -> 0.1", metrics={})
        elif s["name"] == "distill":
            s.update(state="not run", key=None, metrics={}, artifact=None, seconds=None)
    page = render(store, record)
    shown = cells(page)
    assert shown["rl-general.state"] == "failed" and shown["distill.state"] == "not run"
    assert f"glmforge resume rl-general --run {record.id} --store {store.uri}" in html.unescape(page)
    assert "&lt;fell&gt;" in page and "<fell>" not in page  # the error is escaped
    assert shown["rl-general.reward.first"] == NOT_RECORDED


def _chromium() -> str:
    from tests.flows.test_browser_ui import _chromium as find

    return find()  # skips the test when no chromium is installed


def test_page_renders_in_headless_chromium(report_page, tmp_path):
    """Debian's chromium opens the file:// page: every chart decodes, and a screenshot is not blank."""
    from PIL import Image

    from tests.flows.test_browser_ui import Chromium

    chromium, page = _chromium(), report_page[0]
    shot = tmp_path / "report.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile-shot'}", f"--screenshot={shot}", "--window-size=1400,4000",
                    page.as_uri()], capture_output=True, timeout=180, check=True)
    assert shot.exists() and shot.stat().st_size > 50_000
    with Image.open(shot) as im:
        assert im.size == (1400, 4000)
        colours = im.convert("RGB").resize((350, 1000)).getcolors(maxcolors=1_000_000)
    assert len(colours) > 200  # charts and tables, not a blank or an error page
    browser = Chromium(tmp_path / "profile-dom")
    try:
        browser.goto(page.as_uri())
        browser.wait_for(lambda text: "Lineage" in text, "the lineage section")
        images = browser.js("Array.from(document.images).map(i => i.complete && i.naturalWidth > 0)")
        assert len(images) >= 8 and all(images), images
        text = browser.text()
        for heading in ("Curation funnel", "Training", "SFT and INT4", "Post-training", "Evaluation gates"):
            assert heading in text
    finally:
        browser.close()


def test_pipeline_flow_ends_with_the_report_artifact(prefect_server, tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from flows.end_to_end import pipeline

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(20)))
    monkeypatch.setenv("GLMFORGE_HOME", str(tmp_path / "home"))
    state = pipeline(preset="tiny", overrides=[f"ingest.sources=[{{name: raw, path: '{src}'}}]"], until="ingest",
                     return_state=True)
    run_id = state.result()["run"]["id"]
    page = tmp_path / "home" / "reports" / f"run-{run_id}.html"
    assert page.exists() and cells(page.read_text())["ingest.out"] == "20"

    async def artifacts():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["run-report"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))

    (artifact,) = asyncio.run(artifacts())
    assert str(page) in artifact.data and "| ingest | done |" in artifact.data
