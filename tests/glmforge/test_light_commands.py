"""The commands that only read the store never load the training stack: `status`, `artifacts`,
`report` and `--help` run without importing torch, DeepSpeed, Prefect, transformers or datasets (which
is what keeps them near 0.3 s instead of several seconds)."""
from __future__ import annotations

import json
import subprocess
import sys

from glmforge.config import load_config
from glmforge.pipeline import STAGES, stages_until
from runtime.runner import Runner, RunRecord, execute
from runtime.store import LocalStore

PROBE = """
import json, sys, time
t0 = time.perf_counter()
from glmforge.cli import app
try:
    app(sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "deepspeed", "prefect", "transformers", "datasets") if m in sys.modules)
print("PROBE " + json.dumps({"heavy": heavy, "seconds": time.perf_counter() - t0, "code": code}))
"""


def _probe(*args: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, timeout=120)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("PROBE "))
    return {**json.loads(line[6:]), "stdout": out.stdout}


def test_status_artifacts_and_help_do_not_import_torch(tmp_path, monkeypatch):
    jsonl = tmp_path / "raw.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(30)))
    cfg = load_config("tiny", overrides=[f"ingest.sources=[{{name: raw, path: '{jsonl}'}}]"])
    store = LocalStore(tmp_path / "store")
    execute(Runner(cfg, store, STAGES, home=tmp_path / "home"), stages_until("ingest"),
            RunRecord.new(cfg, {"preset": "tiny"}, ["ingest"]))
    env = {"GLMFORGE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    for args in (["status", "--json"], ["artifacts", "ls"], ["--help"], ["report", "--out", str(tmp_path / "pages")]):
        got = _probe(*args, env=env)
        assert got["code"] in (0, None), got["stdout"]
        assert got["heavy"] == [], f"glmforge {' '.join(args)} imported {got['heavy']}"
    assert len(list((tmp_path / "pages").glob("run-*.html"))) == 1
    status = _probe("status", "--json", env=env)
    assert '"name": "ingest"' in status["stdout"] and '"state": "done"' in status["stdout"]
