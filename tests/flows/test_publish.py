"""`glmforge publish` on the session's tiny run: the release folder and its model card, both
variants registered in MLflow's registry (tests/_mlflow.py), and the refusals that leave nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _publish(tiny_run, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glmforge.cli", "publish", "--run", tiny_run.run_id, "--store",
                           str(tiny_run.home / "store"), *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_publish_writes_the_card_and_registers_both_variants(tiny_run, tracking_server, tmp_path):
    from huggingface_hub import ModelCard
    from mlflow.tracking import MlflowClient

    out = _publish(tiny_run, "--out", str(tmp_path / "release"), "--name", "glmforge-tiny")
    assert out.returncode == 0, out.stdout + out.stderr
    release = tmp_path / "release"
    full = json.loads((release / "full" / "config.json").read_text())
    int4 = json.loads((release / "int4" / "config.json").read_text())
    assert "quantization_config" not in full and int4["quantization_config"]["quant_method"] == "compressed-tensors"
    assert (release / "full" / "model.safetensors").stat().st_size > 0
    card = ModelCard((release / "README.md").read_text())         # parses as a Hugging Face model card
    assert card.data.library_name == "transformers" and "glmforge" in card.data.tags
    assert card.data.to_dict()["glmforge"]["run_id"] == tiny_run.run_id
    assert card.data.to_dict()["glmforge"]["keys"]["distill"] == tiny_run.keys["distill"]
    for section in ("## Model", "## Data", "## Training", "## Evaluation gates", "## INT4", "## Lineage"):
        assert section in card.text, section
    assert (release / "int4" / "README.md").read_text() == (release / "README.md").read_text()

    client = MlflowClient(tracking_uri=tracking_server.uri)
    versions = client.search_model_versions("name='glmforge-tiny'")
    assert sorted(v.tags["variant"] for v in versions) == ["full", "int4"]
    parent = next(r for r in client.search_runs(
        [client.get_experiment_by_name("tiny-run").experiment_id], f"tags.`glmforge.run_id` = '{tiny_run.run_id}'"))
    assert {v.run_id for v in versions} == {parent.info.run_id}
    int4_version = next(v for v in versions if v.tags["variant"] == "int4")
    got = client.download_artifacts(parent.info.run_id, "model/int4/config.json")
    assert json.loads(Path(got).read_text()) == int4 and int4_version.source.endswith("/model/int4")
    # publishing the same model again adds versions to it
    again = _publish(tiny_run, "--out", str(tmp_path / "again"), "--name", "glmforge-tiny")
    assert again.returncode == 0, again.stderr
    assert len(client.search_model_versions("name='glmforge-tiny'")) == 4


def test_a_registry_name_held_by_another_model_is_refused_and_nothing_is_registered(tiny_run, tracking_server,
                                                                                    tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_server.uri)
    client.create_registered_model("someone-elses")
    out = _publish(tiny_run, "--out", str(tmp_path / "release"), "--name", "someone-elses")
    lines = [x for x in (out.stdout + out.stderr).splitlines() if x.strip()]
    assert out.returncode == 1 and lines[-1].startswith("error: registered model 'someone-elses' already holds "
                                                        "another model (not a glmforge model"), lines
    assert client.search_model_versions("name='someone-elses'") == []


def test_a_hub_upload_without_a_token_is_refused_before_anything_is_written(tiny_run, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "glmforge.cli", "publish", "--run", tiny_run.run_id, "--store",
                          str(tiny_run.home / "store"), "--out", str(tmp_path / "release"), "--hf-repo", "me/tiny"],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1 and "needs a Hugging Face token in $HF_TOKEN" in out.stderr, out.stderr
    assert not (tmp_path / "release").exists()
