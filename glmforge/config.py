"""Typed pipeline config: one pydantic section per stage, presets as YAML, `--set` overrides.

The config is resolved and validated once, at the CLI or flow entry, before any work starts.
An invalid config raises ConfigError naming the file, the line (for YAML files), the field and
the reason. Secrets never live here: store credentials come from the environment or a Prefect
block, so a resolved config can be written into run records, manifests and Prefect parameters.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """Invalid configuration; the message names file, line, field and reason."""


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(0, description=(
        "the run seed: the training and RL stages read it (and it joins their cache keys); the curation "
        "stages take their seeds from their own sections"))


_MiB = 1024 * 1024
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": _MiB,
               "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def _byte_size(value: Any) -> Any:
    """An int of bytes, or a string with a unit: "64MiB", "8 MB", "1GiB" (other values: pydantic says why)."""
    if isinstance(value, str):
        import re

        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if m is None or m.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f"{value!r} is not a size: bytes, or a number with a unit (e.g. 64MiB, 8MB, 1GiB)")
        return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    return value


ByteSize = Annotated[int, BeforeValidator(_byte_size)]


class S3TransferConfig(BaseModel):
    """boto3 TransferConfig knobs for every file the S3 store uploads or downloads (artifacts,
    mirrored checkpoints). Sizes are bytes, or strings such as "64MiB". Ignored by a local store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    multipart_threshold: ByteSize = Field(default=64 * _MiB, ge=5 * _MiB, description=(
        "files of at least this size go up (and down) in parts; default 64 MiB (boto3's: 8 MiB)"))
    multipart_chunksize: ByteSize = Field(default=64 * _MiB, ge=5 * _MiB, le=5 * 1024 * _MiB, description=(
        "part size, 5 MiB to 5 GiB (S3's limits; boto3 raises it for files over 10,000 parts); "
        "default 64 MiB (boto3's: 8 MiB)"))
    max_concurrency: int = Field(default=10, ge=1, le=256, description=(
        "parts (or whole small files) in flight at once: per file, and for all of an artifact's "
        "files together when it is published; default 10 (boto3's)"))
    use_threads: bool = Field(default=True, description=(
        "False: parts go one at a time in the calling thread (max_concurrency unused); default True"))


class StoreConfig(BaseModel):
    """Where artifacts live. Holds no secrets (S3 credentials: environment or a Prefect Secret block),
    so it may be dumped into run records and logs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str | None = Field(default=None, description="local dir or s3://bucket/prefix; default $GLMFORGE_HOME/store")
    credentials_block: str | None = Field(
        default=None, description="name of a Prefect Secret block holding S3 credentials as JSON"
    )
    transfer: S3TransferConfig = Field(default_factory=S3TransferConfig, description=(
        "S3 multipart transfer settings (boto3 TransferConfig)"))


class RetryConfig(BaseModel):
    """How often a stage's Prefect task is retried after a failure and rerun after a preemption."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    retries: int = Field(default=2, ge=0, description="times a stage's Prefect task is retried after a failure")
    retry_delay_seconds: float = Field(default=5.0, ge=0, description="seconds between a failed try and the next")
    max_preemptions: int = Field(default=10, ge=0, description=(
        "automatic reruns of a preempted deployment run in a row (deployments/automations.yaml); "
        "past it the run is left for `glmforge resume`"))


def check_preemptions(preemptions: int, tasks: RetryConfig) -> None:
    """Refuse an automatic rerun past tasks.max_preemptions: a run preempted before its first
    step would otherwise be rerun forever. The message must not read as a preemption itself."""
    if preemptions > tasks.max_preemptions:
        raise RuntimeError(f"preempted {preemptions} times in a row, more than tasks.max_preemptions="
                           f"{tasks.max_preemptions}: not rerun automatically again; `glmforge resume STAGE` "
                           "continues it")


@lru_cache(maxsize=1)
def pipeline_model() -> type[BaseModel]:
    """The PipelineConfig model, built from the stage registry so each stage owns its section."""
    from glmforge.pipeline import SECTIONS
    from runtime.tracking import TrackingConfig
    from model.info import PlanConfig

    fields: dict[str, Any] = {
        "run": (RunConfig, RunConfig()),
        "store": (StoreConfig, StoreConfig()),
        "tasks": (RetryConfig, RetryConfig()),
        # experiment tracking (runtime.tracking): operational, in no stage's key
        "tracking": (TrackingConfig, TrackingConfig()),
        # the cluster layout the training stages are sized for (model.info; checked to fit)
        "plan": (PlanConfig | None, None),
    }
    for spec in SECTIONS:
        fields[spec.section] = (spec.config_cls, _default_or_required(spec.config_cls))
    return create_model(
        "PipelineConfig", __config__=ConfigDict(extra="forbid", frozen=True), **fields
    )


def _default_or_required(cls: type[BaseModel]) -> Any:
    """A section whose fields all have defaults may be left out of a config file."""
    try:
        return cls()
    except ValidationError:
        return ...


def preset_path(name: str) -> Path:
    path = CONFIGS_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(known)}")
    return path


# libyaml's loader where PyYAML was built with it: the pure-Python one took 0.12 s to read a preset
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _yaml_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map each key path in a YAML document to its 1-based line, for error messages."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                p = path + (str(k.value),)
                lines[p] = k.start_mark.line + 1
                walk(v, p)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                p = path + (str(i),)
                lines[p] = v.start_mark.line + 1
                walk(v, p)

    root = yaml.compose(text, Loader=_LOADER)
    if root is not None:
        walk(root, ())
    return lines


def _set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur: Any = d
    for i, part in enumerate(parts[:-1]):
        if isinstance(cur, list):
            cur = cur[int(part)]
            continue
        nxt = cur.get(part)
        if nxt is None:
            nxt = cur[part] = {}
        elif not isinstance(nxt, (dict, list)):
            raise ConfigError(f"--set {dotted}: {'.'.join(parts[: i + 1])} is a value, not a section")
        cur = nxt
    if isinstance(cur, list):
        cur[int(parts[-1])] = value
    else:
        cur[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. ingest.shard_size=1000")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text!r}: value is not valid YAML ({e})") from e
    return key.strip(), value


def _read_layer(path: Path) -> tuple[dict[str, Any], dict[tuple[str, ...], int]]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at byte offset "
                          f"{e.start}); save the file as UTF-8") from None
    try:
        data = yaml.load(text, Loader=_LOADER) or {}
        lines = _yaml_lines(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML ({getattr(e, 'problem', e)})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return _unshared(data), lines


def _unshared(node: Any) -> Any:
    """A copy in which no mapping or list is reached twice: a YAML alias (`*anchor`) loads as the
    anchored object itself, so `--set` on one stage would change every stage sharing it."""
    if isinstance(node, dict):
        return {k: _unshared(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_unshared(v) for v in node]
    return node


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`: mappings merge key by key, anything else is replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _layers(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any], dict]]:
    """The file and the presets it `extends`, base first. `extends: NAME` names a preset in
    configs/ (or a path relative to the file): the file holds only what differs from it."""
    if path.resolve() in seen:
        raise ConfigError(f"{path}: `extends` loops back to {path.name} ({' -> '.join(p.name for p in seen)})")
    data, lines = _read_layer(path)
    parent = data.pop("extends", None)
    if parent is None:
        return [(path, data, lines)]
    if not isinstance(parent, str):
        raise ConfigError(f"{path}:{lines.get(('extends',), 1)}: extends must be a preset name, got {parent!r}")
    local = path.parent / parent
    base = local if local.suffix in (".yaml", ".yml") and local.is_file() else preset_path(parent)
    return [*_layers(base, (*seen, path.resolve())), (path, data, lines)]


def load_config(
    preset: str | None = None,
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
) -> BaseModel:
    """Resolve preset or file (and the presets it extends) plus overrides into a validated
    PipelineConfig."""
    if preset and config_file:
        raise ConfigError("give either a preset or a config file, not both")
    path = Path(config_file) if config_file else preset_path(preset or "tiny")
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    layers = _layers(path)
    data: dict[str, Any] = {}
    for _, layer, _ in layers:
        data = _merge(data, layer)
    overridden: dict[tuple[str, ...], str] = {}  # key path -> the --set text that set it
    for item in overrides or []:
        key, value = parse_override(item)
        try:
            _set_dotted(data, key, value)
        except (IndexError, ValueError, TypeError) as e:
            raise ConfigError(f"--set {item!r}: {e}") from e
        overridden[tuple(key.split("."))] = item
    in_files = {p for _, _, ln in layers for p in ln}
    try:
        config = pipeline_model().model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = tuple(str(x) for x in err["loc"])
            field = ".".join(loc) or "(top level)"
            # the --set whose value holds the error, or that made the failing key (an unknown
            # section `--set nosuch.key=1` fails at `nosuch`, which no file sets)
            blamed = next((item for o, item in overridden.items()
                           if loc[: len(o)] == o or (loc and o[: len(loc)] == loc and loc not in in_files)), None)
            if blamed is not None:
                where = f"--set {blamed}"
            else:
                where = str(path)
                # the most specific key path, in the topmost file that sets it
                for i in range(len(loc), 0, -1):
                    hit = next(((p, ln[loc[:i]]) for p, _, ln in reversed(layers) if loc[:i] in ln), None)
                    if hit:
                        where = f"{hit[0]}:{hit[1]}"
                        break
            problems.append(f"{where}: field {field}: {err['msg']}")
        if len(problems) == 1:  # one problem, one line
            raise ConfigError(f"invalid config: {problems[0]}") from None
        raise ConfigError("invalid config\n  " + "\n  ".join(problems)) from None
    check_rl_pools(config, str(path))
    return config


def preset_section(preset: str, section: str) -> dict[str, Any]:
    """One section of a preset (the presets it extends merged), unvalidated: for a command that
    runs one stage and need not import every stage's config (the whole pipeline's model loads
    the training stack)."""
    data: dict[str, Any] = {}
    for _, layer, _ in _layers(preset_path(preset)):
        data = _merge(data, layer)
    return dict(data.get(section) or {})


def check_rl_pools(config: BaseModel, where: str) -> None:
    """With a `plan:`, every RL-side stage's trainer and server pools must fit its GPUs
    (rl.placement): a layout that cannot run is refused before anything starts."""
    from rl.placement import config_pools, not_fitting

    if getattr(config, "plan", None) is None:
        return
    lines = not_fitting(config_pools(config), config.plan.gpu_mem_gb, config.plan.nodes * config.plan.gpus_per_node,
                        config.plan.gpus_per_node)
    if lines:
        raise ConfigError(f"invalid config: {where}: RL placement under plan {config.plan.nodes}x"
                          f"{config.plan.gpus_per_node} does not fit (glmforge model info --preset NAME --plan ...):\n  "
                          + "\n  ".join(lines))
