"""Publishing a run's final model: a release folder with a model card, versions in MLflow's model
registry, and the Hugging Face Hub.

`write_release` copies the distill stage's two Hugging Face exports (export/full: the weights as
trained; export/int4: compressed-tensors pack-quantized INT4) into a folder, each with a README.md
model card (`model_card`: YAML front matter, then architecture and sizes, the curation funnel, the
training stages, the evaluation gates, the INT4 scheme and the run's lineage, all read from the
store). `register` makes both folders versions of one registered model in MLflow's registry,
checked first so that a refusal leaves nothing behind. `push_to_hub` uploads the folder with
huggingface_hub when a token and a repo id are given.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from runtime.runner import RunRecord
from runtime.store import Manifest, Store, artifact_prefix
from runtime.tracking import MLflowTracker, TrackingConfig, git_commit, masked

FINAL_STAGE = "distill"
VARIANTS = {"full": "export/full", "int4": "export/int4"}
CURATION = ("ingest", "quality", "dedup-exact", "dedup-minhash", "dedup-semantic", "decontaminate", "tokenize", "pack")
TRAINING = ("pretrain", "context-1", "context-2", "context-3", "dsa-warmup", "dsa-adapt", "sft", "rl-reasoning",
            "rl-agentic", "reward-model", "rl-general", "distill")


class PublishError(RuntimeError):
    """Why a run's model cannot be published (one line)."""


def manifests(store: Store, record: RunRecord) -> dict[str, Manifest]:
    """The published artifact of each stage of the run (by the keys its record holds)."""
    out = {}
    for s in record.stages:
        if s.get("key") and s["state"] in ("done", "cached"):
            m = store.manifest(s["name"], s["key"])
            if m is not None:
                out[s["name"]] = m
    return out


def _read(store: Store, m: Manifest, path: str) -> bytes | None:
    """A file of an artifact, None when it has none of that name."""
    try:
        return store.get_bytes(f"{artifact_prefix(m.stage, m.key)}/{m.data_prefix}/{path}")
    except FileNotFoundError:
        return None


def _read_json(store: Store, m: Manifest, path: str) -> Any:
    data = _read(store, m, path)
    return None if data is None else json.loads(data)


def model_identity(hf_config: dict[str, Any]) -> str:
    """What makes two releases versions of one model: the architecture (the HF config without its
    quantization and glmforge blocks), hashed."""
    arch = {k: v for k, v in hf_config.items() if k not in ("quantization_config", "glmforge", "dtype", "torch_dtype")}
    return hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:16]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def model_card(store: Store, record: RunRecord, found: dict[str, Manifest]) -> str:
    final = found[FINAL_STAGE]
    hf = _read_json(store, final, f"{VARIANTS['full']}/config.json") or {}
    int4 = (_read_json(store, final, f"{VARIANTS['int4']}/config.json") or {}).get("quantization_config") or {}
    preset = record.source.get("preset") or record.source.get("config_file") or "a config file"
    pre = found.get("pretrain")
    params = pre.metrics.get("params") if pre else None
    active = pre.metrics.get("params_active") if pre else None
    front = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "license": "other",
        "tags": ["glmforge", "glm-5-recipe", "moe", "mla", "dsa", "mtp"],
        "model_name": f"glmforge-{record.id}",
        "glmforge": {"run_id": record.id, "preset": preset, "identity": model_identity(hf),
                     "keys": {n: m.key for n, m in found.items()}},
    }
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
             f"# glmforge-{record.id}", "",
             f"A GLM-5-style model trained by glmforge's pipeline (`{preset}`), run `{record.id}`, "
             f"finished {record.finished or 'not yet'}. Two variants: `full/` (the weights as trained, "
             "Hugging Face layout) and `int4/` (INT4 weights from quantization-aware training, compressed-tensors "
             "pack-quantized: vLLM and SGLang load it).", "", "## Model", "",
             "| | |", "|---|---|"]
    rows = [("parameters (total / active per token)", f"{_fmt(params)} / {_fmt(active)}" if params else None),
            ("layers", hf.get("num_hidden_layers")), ("hidden size", hf.get("hidden_size")),
            ("attention heads", hf.get("num_attention_heads")),
            ("MLA (kv / q LoRA rank)", f"{hf.get('kv_lora_rank')} / {hf.get('q_lora_rank')}" if "kv_lora_rank" in hf else None),
            ("routed experts (per token) + shared", f"{hf.get('n_routed_experts')} ({hf.get('num_experts_per_tok')}) + "
             f"{hf.get('n_shared_experts')}" if "n_routed_experts" in hf else None),
            ("dense layers first", hf.get("first_k_dense_replace")),
            ("MTP layers", hf.get("num_nextn_predict_layers")),
            ("DSA indexer top-k", hf.get("index_topk")),
            ("vocabulary", hf.get("vocab_size")), ("context length", hf.get("max_position_embeddings"))]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in rows if v is not None]
    lines += ["", "## Data", "", "The curation funnel, from the stages' own counts:", "", "| stage | figures |", "|---|---|"]
    for name in CURATION:
        m = found.get(name)
        if m is None:
            continue
        shown = {k: v for k, v in m.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        lines.append(f"| {name} | " + ", ".join(f"{k} {_fmt(v)}" for k, v in list(shown.items())[:6]) + " |")
    lines += ["", "## Training", "", "| stage | steps | tokens | first → last | key |", "|---|---|---|---|---|"]
    for name in TRAINING:
        m = found.get(name)
        if m is None:
            continue
        got = m.metrics
        reward = got.get("reward") if isinstance(got.get("reward"), dict) else {}
        if got.get("loss_first") is not None and got.get("loss_last") is not None:
            moved = f"loss {_fmt(got['loss_first'])} → {_fmt(got['loss_last'])}"
        elif reward.get("first") is not None and reward.get("last") is not None:
            moved = f"reward {_fmt(reward['first'])} → {_fmt(reward['last'])}"
        else:
            moved = ""
        lines.append(f"| {name} | {_fmt(got.get('steps', ''))} | {_fmt(got.get('tokens', ''))} | {moved} | `{m.key}` |")
    gates = (_read(store, final, "gates.md") or b"").decode()
    if gates:
        body = [g for g in gates.splitlines() if not g.startswith("# ")]
        lines += ["", "## Evaluation gates", "", *body]
    if int4:
        w = next(iter((int4.get("config_groups") or {}).values()), {}).get("weights") or {}
        lines += ["", "## INT4", "", f"{int4.get('quant_method')} `{int4.get('format')}`: {w.get('num_bits')}-bit "
                  f"{w.get('type')}, {'symmetric' if w.get('symmetric') else 'asymmetric'}, {w.get('strategy')} of "
                  f"{w.get('group_size')}; {len(int4.get('ignore') or [])} modules kept in full precision "
                  "(the output head, the DSA indexer and MLA's low-rank projections)."]
    commit = git_commit()
    lines += ["", "## Lineage", "", f"- run `{record.id}`, preset `{preset}`, store `{masked(str(store.uri))}`"
              + (f", code `{commit}`" if commit else ""),
              "- each stage's artifact key is in the front matter (`glmforge.keys`): `glmforge artifacts` and "
              "`glmforge report --run " + record.id + "` show them", ""]
    if record.tracking:
        lines.insert(-1, f"- tracked in MLflow: {record.tracking.get('link')}")
    return "\n".join(lines)


def write_release(store: Store, record: RunRecord, out: Path) -> tuple[Path, str]:
    """out/full and out/int4 (each with the model card as README.md) and out/README.md; returns
    the folder and the card."""
    found = manifests(store, record)
    if FINAL_STAGE not in found:
        raise PublishError(f"run {record.id} has no published {FINAL_STAGE} artifact in {store.uri}: nothing to "
                           "publish (`glmforge status` shows how far it got)")
    final = found[FINAL_STAGE]
    paths = {f.path for f in final.files}
    missing = [v for v, p in VARIANTS.items() if f"{p}/config.json" not in paths]
    if missing:
        raise PublishError(f"the {FINAL_STAGE} artifact {final.key} has no {', '.join(missing)} export "
                           f"(distill.export_hf: true writes them)")
    card = model_card(store, record, found)
    out.mkdir(parents=True, exist_ok=True)
    base = f"{artifact_prefix(final.stage, final.key)}/{final.data_prefix}"
    for variant, prefix in VARIANTS.items():
        dest = out / variant
        shutil.rmtree(dest, ignore_errors=True)
        for f in final.files:
            if f.path.startswith(prefix + "/"):
                target = dest / f.path[len(prefix) + 1:]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(store.get_bytes(f"{base}/{f.path}"))
        (dest / "README.md").write_text(card)
    (out / "README.md").write_text(card)
    return out, card


def register(tracking: TrackingConfig, record: RunRecord, release: Path, name: str) -> list[str]:
    """Both variants as versions of registered model `name`; their version numbers. Refused before
    anything is uploaded when `name` holds another model (another architecture, or not
    glmforge's); a failure half-way removes what this call registered."""
    from mlflow.exceptions import MlflowException

    identity = model_identity(json.loads((release / "full" / "config.json").read_text()))
    tracker = MLflowTracker(tracking)
    client = tracker.client
    try:
        existing = client.get_registered_model(name)
    except MlflowException as e:
        if getattr(e, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
            raise PublishError(f"MLflow at {masked(tracker.uri)}: {str(e).splitlines()[0][:200]}") from None
        existing = None
    if existing is not None and existing.tags.get("glmforge.identity") != identity:
        other = existing.tags.get("glmforge.identity") or "not a glmforge model"
        raise PublishError(f"registered model {name!r} already holds another model ({other}; this one is "
                           f"{identity}): choose another --name")
    tracker.experiment_id = tracker._experiment()
    run = (record.tracking or {}).get("run_id") if (record.tracking or {}).get("backend") == "mlflow" else None
    if run is None:
        run = client.create_run(tracker.experiment_id, run_name=f"publish {record.id}",
                                tags={"glmforge.run_id": record.id, "glmforge.kind": "publish"}).info.run_id
    created_model, versions = existing is None, []
    try:
        if created_model:
            client.create_registered_model(name, tags={"glmforge.identity": identity},
                                           description=f"glmforge model ({identity}), card in each version")
        for variant in VARIANTS:
            client.log_artifacts(run, str(release / variant), f"model/{variant}")
            source = f"{client.get_run(run).info.artifact_uri}/model/{variant}"
            v = client.create_model_version(name, source, run_id=run,
                                            tags={"variant": variant, "glmforge.run_id": record.id},
                                            description=(release / variant / "README.md").read_text()[:5000])
            versions.append(v.version)
    except Exception:
        for v in versions:
            try:
                client.delete_model_version(name, v)
            except Exception:
                pass
        if created_model:
            try:
                client.delete_registered_model(name)
            except Exception:
                pass
        raise
    return versions


def push_to_hub(release: Path, repo_id: str, token: str) -> str:
    """Upload the release folder to the Hugging Face Hub (a model repo, created when missing)."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, repo_type="model", exist_ok=True, private=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(release), repo_type="model",
                                 commit_message="glmforge publish")
    except Exception as e:
        raise PublishError(f"Hugging Face Hub upload to {repo_id} failed: {type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
    return str(getattr(info, "commit_url", info))
