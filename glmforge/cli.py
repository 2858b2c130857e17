"""The `glmforge` command line."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from glmforge.cli_model import eval_app, model_app
from glmforge.config import ConfigError, load_config
from runtime.stage import resolve

app = typer.Typer(no_args_is_help=True, add_completion=False, help="The GLM-5 recipe as checkpointed Prefect flows.")
artifacts_app = typer.Typer(no_args_is_help=True, help="Inspect published artifacts.")
app.add_typer(artifacts_app, name="artifacts")
app.add_typer(model_app, name="model")
app.add_typer(eval_app, name="eval")
schedule_app = typer.Typer(
    no_args_is_help=True,
    help="Deployment schedules on the Prefect server of `glmforge serve` (or $PREFECT_API_URL). "
    "The nightly cron of the end-to-end deployment is off until `glmforge schedule on`.",
)
app.add_typer(schedule_app, name="schedule")
deploy_app = typer.Typer(no_args_is_help=True, help="Deployment files rendered from the pipeline config.")
app.add_typer(deploy_app, name="deploy")
envs_app = typer.Typer(no_args_is_help=True, help="Software-engineering environments from real repositories.")
app.add_typer(envs_app, name="envs")

# The CLI sits above the flows: it starts them by entrypoint, the strings prefect.yaml deploys.
PIPELINE_FLOW, STAGE_FLOW = "flows.end_to_end:pipeline", "flows.end_to_end:stage"

PresetOpt = typer.Option(None, "--preset", "-p", help="preset in configs/ (default: tiny)")
ConfigOpt = typer.Option(None, "--config", "-c", help="pipeline config YAML file")
SetOpt = typer.Option(None, "--set", help="override, e.g. --set ingest.shard_size=1000 (repeatable)")
StoreOpt = typer.Option(None, "--store", help="artifact store: a directory or s3://bucket/prefix")


def ensure_homes() -> None:
    """Create $GLMFORGE_HOME and $PREFECT_HOME when they name folders that do not exist yet:
    Prefect's SQLite database otherwise fails with "unable to open database file"."""
    for var in ("GLMFORGE_HOME", "PREFECT_HOME"):
        if os.environ.get(var):
            path = Path(os.environ[var]).expanduser()
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                _fail(f"${var}={os.environ[var]}: cannot create the folder: {e}")


_prefect_database_lock = None  # the flock on this process's Prefect database, held until it exits


def own_prefect_database() -> None:
    """Before Prefect is imported: point this run's ephemeral Prefect server at a database no
    concurrent run uses (claim_prefect_database), and start it without block registration. Left
    alone: a run reporting to a server ($PREFECT_API_URL) and a database chosen in the environment."""
    global _prefect_database_lock
    if not os.environ.get("PREFECT_API_URL"):
        # The ephemeral server registers Prefect's block types (and imports every installed
        # Prefect collection to find them) at each start: 1 s on a database that has them, 4-5 s
        # on a new one, of a 13-24 s `run --until ingest`. A run needs none: a Secret block
        # (store.credentials_block) registers its type when it is saved.
        os.environ.setdefault("PREFECT_SERVER_REGISTER_BLOCKS_ON_START", "false")
        os.environ.setdefault("PREFECT_SERVER_MEMOIZE_BLOCK_AUTO_REGISTRATION", "false")
    chosen = ("PREFECT_API_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")
    if _prefect_database_lock is not None or any(os.environ.get(v) for v in chosen):
        return
    from glmforge.serve import claim_prefect_database

    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    try:
        database, _prefect_database_lock = claim_prefect_database(home)
    except OSError as e:
        _fail(f"Prefect home {home}: cannot lock a database there: {e}")
    if database.name != "prefect.db":
        os.environ["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{database}"


def _fail(msg: str, code: int = 2) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def _store(uri: str | None):
    from runtime.store import open_store

    try:
        return open_store(uri or os.environ.get("GLMFORGE_STORE"))
    except ValueError as e:
        _fail(str(e))


def _stopped_anyway(what: str, result: dict) -> None:
    """A stop signal arrived but its exception was lost on the way (runtime.shutdown.note): the
    flow returned. The run record says how far it got; the exit status still says it was stopped."""
    from runtime.shutdown import received

    if received():
        _print_stages(result)
        _stopped(what, KeyboardInterrupt(f"a stop signal arrived; run {result['run']['id']} "
                                         f"{result['run']['state']}"))


def _stopped(what: str, e: BaseException, again: str = "`glmforge resume STAGE` continues from the last "
                                                          "checkpoint") -> None:
    """A stop signal (SIGTERM, Ctrl-C) or a preempted stage: exit 128+signal, not a failure."""
    from runtime.shutdown import exit_code

    typer.echo(f"{what} interrupted ({type(e).__name__}: {e}); {again}", err=True)
    raise typer.Exit(exit_code())


def _print_stages(record: dict) -> None:
    for s in record["stages"]:
        extra = f"  {s['error']}" if s.get("error") else ""
        if s["state"] in ("running", "interrupted"):
            reached = [f"step {s['step']}" if s.get("step") is not None else "",
                       f"checkpoint at step {s['checkpoint_step']}" if s.get("checkpoint_step") is not None
                       else f"checkpoint after chunk {s['checkpoint_chunks']}" if s.get("checkpoint_chunks")
                       else "no checkpoint yet" if "checkpoint_step" in s else ""]
            extra += "  " + ", ".join(x for x in reached if x) if any(reached) else ""
            if s.get("resume"):
                extra += f"; continue it with `{s['resume']}`"
        audit = (s.get("metrics") or {}).get("reward_recheck") or {}
        if audit.get("alert_steps"):        # rl.reward_audit: the policy may be exploiting its reward
            extra += f"  reward re-check disagreed at steps {', '.join(map(str, audit['alert_steps'][:10]))}"
        if audit.get("canary_alert_steps"):  # a canary's contradicting tests passed: a cheat
            extra += f"  canaries cheated at steps {', '.join(map(str, audit['canary_alert_steps'][:10]))}"
        typer.echo(f"  {s['name']:<16} {s['state']:<8} {s['key'] or '-':<26} {s['artifact'] or ''}{extra}")


@app.command()
def run(
    preset: Optional[str] = PresetOpt,
    config: Optional[Path] = ConfigOpt,
    until: Optional[str] = typer.Option(None, "--until", help="stop after this stage"),
    set_: Optional[list[str]] = SetOpt,
    store: Optional[str] = StoreOpt,
    flow: bool = typer.Option(
        False, "--flow", help="run through the Prefect flow even when every stage is already published"
    ),
) -> None:
    """Run the pipeline (stages already published for this config are reused)."""
    from glmforge.pipeline import get_stage, iterations, stages_until
    from runtime.tracking import TrackerUnavailable, check_tracking

    try:
        cfg = load_config(preset, config, set_)  # validated before any work (and before Prefect starts)
        if until:
            get_stage(until, iterations(cfg))
        check_tracking(cfg.tracking)
    except (ConfigError, ValueError, TrackerUnavailable) as e:
        _fail(str(e))
    args = dict(
        preset=None if config else (preset or "tiny"),
        config_file=str(config) if config else None,
        overrides=list(set_ or []),
        store=store or os.environ.get("GLMFORGE_STORE"),
        until=until,
    )
    # Nothing to run: record the run from the store's manifests, without starting Prefect.
    # (A store whose credentials live in a Prefect Secret block needs Prefect to open it.)
    if not flow and cfg.store.credentials_block is None:
        from glmforge.cached_run import record_if_cached
        from runtime.store import StoreUnavailableError

        source = {k: args[k] for k in ("preset", "config_file", "overrides", "until")}
        try:
            record = record_if_cached(cfg, _store(args["store"] or cfg.store.uri),
                                      stages_until(until, iterations(cfg)), source)
        except StoreUnavailableError as e:
            _fail(str(e), code=1)
        if record is not None:
            typer.echo(f"run {record.id}: {record.state} (every stage already published; Prefect not started)")
            _print_stages(record.public())
            return
    ensure_homes()      # only now: a refused config or an unreachable store leaves nothing behind
    own_prefect_database()
    pipeline = resolve(PIPELINE_FLOW)

    from runtime.shutdown import Preempted

    try:
        result = pipeline(**args)
    except (KeyboardInterrupt, Preempted) as e:
        _stopped("pipeline", e)
    except Exception as e:  # the run record already holds the failure; say it plainly
        _fail(f"pipeline failed: {type(e).__name__}: {e}", code=1)
    _stopped_anyway("pipeline", result)
    typer.echo(f"run {result['run']['id']}: {result['run']['state']}")
    _print_stages(result)


@app.command()
def resume(
    stage: str = typer.Argument(..., help="stage to re-run from its last checkpoint"),
    store: Optional[str] = StoreOpt,
    run_id: Optional[str] = typer.Option(None, "--run", help="run id (default: the latest run)"),
) -> None:
    """Re-run one stage of a run from its last checkpoint, reusing the artifacts upstream."""
    from glmforge.pipeline import get_stage
    from runtime.runner import RunRecord

    try:
        get_stage(stage)
    except ValueError as e:
        _fail(str(e))
    ensure_homes()
    st = _store(store)
    record = RunRecord.load(st, run_id)
    if record is None:
        _fail(f"no run recorded in {st.uri}; start one with `glmforge run`")
    own_prefect_database()
    stage_flow = resolve(STAGE_FLOW)
    from runtime.shutdown import Preempted

    try:
        result = stage_flow(
            stage=stage,
            preset=record.source.get("preset"),
            config_file=record.source.get("config_file"),
            overrides=record.source.get("overrides"),
            store=store or os.environ.get("GLMFORGE_STORE") or st.uri,
            run_id=record.id,
        )
    except (KeyboardInterrupt, Preempted) as e:
        _stopped(f"stage {stage}", e)
    except Exception as e:
        _fail(f"stage {stage} failed: {type(e).__name__}: {e}", code=1)
    _stopped_anyway(f"stage {stage}", result)
    typer.echo(f"run {result['run']['id']}: {result['run']['state']}")
    _print_stages(result)


@app.command("grace-period")
def grace_period(preset: Optional[str] = PresetOpt, config: Optional[Path] = ConfigOpt,
                 set_: Optional[list[str]] = SetOpt) -> None:
    """Print terminationGracePeriodSeconds for the config's pods (the Kubernetes work pool's
    termination_grace_period_seconds): its largest preempt_grace_s plus the teardown margins."""
    from runtime.shutdown import pod_grace_seconds

    try:
        cfg = load_config(preset, config, set_)
    except ConfigError as e:
        _fail(str(e))
    typer.echo(pod_grace_seconds(cfg))


@deploy_app.command("k8s-templates")
def deploy_k8s_templates(
    out: Path = typer.Option(..., "--out", "-o", help="folder to write (the shipped ones: deployments/k8s, --preset glm5)"),
    preset: Optional[str] = PresetOpt,
    config: Optional[Path] = ConfigOpt,
    set_: Optional[list[str]] = SetOpt,
) -> None:
    """Write the Kubernetes work-pool templates: one single-pod template, and per node group of
    the training stages (same `launch:`) an Indexed Job template and its headless Service;
    node-groups.json says which stage goes where. Checked before writing: the Prefect template
    shape, and with kubernetes-validate installed every object against the Kubernetes schema."""
    from glmforge import k8s

    try:
        cfg = load_config(preset, config, set_)
        files = k8s.render(cfg)
    except (ConfigError, ValueError) as e:
        _fail(str(e))
    try:
        import kubernetes_validate  # noqa: F401
        schema = True
    except ImportError:
        schema = False
    try:
        checks = k8s.check_rendered(files, kubernetes=schema)
    except k8s.TemplateError as e:
        _fail(f"rendered template refused: {e}", code=1)
    for path in k8s.write(files, out):
        typer.echo(f"wrote {path}")
    for line in checks:
        typer.echo(f"checked {line}")
    if not schema:
        typer.echo("Kubernetes schema not checked: pip install kubernetes-validate", err=True)


@app.command()
def status(
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    store: Optional[str] = StoreOpt,
    run_id: Optional[str] = typer.Option(None, "--run", help="run id (default: the latest run)"),
) -> None:
    """Stages of the latest run: key, state, metrics, artifact."""
    from runtime.runner import RunRecord

    st = _store(store)
    record = RunRecord.load(st, run_id)
    if record is None:
        _fail(f"no run recorded in {st.uri}")
    public = record.public(st)
    if as_json:
        typer.echo(json.dumps(public, indent=2, sort_keys=True))
        return
    run_info = public["run"]
    typer.echo(f"run {run_info['id']} ({run_info['state']}, started {run_info['started']}) store {st.uri}")
    _print_stages(public)


@app.command("effects")
def effects_cmd(
    run_ids: Optional[list[str]] = typer.Option(None, "--run", help="run id, repeatable (default: the latest run)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    store: Optional[str] = StoreOpt,
) -> None:
    """The recipe's effects (glmforge.effects) measured in one or more runs, each against its
    target; with several runs, their mean and std and how many runs met the target."""
    from glmforge import effects
    from runtime.runner import RunRecord

    st = _store(store)
    runs = {}
    for rid in run_ids or [None]:
        record = RunRecord.load(st, rid)
        if record is None:
            _fail(f"no run {rid!r} in {st.uri}" if rid else f"no run recorded in {st.uri}")
        runs[record.id] = effects.measure_record(record.public())
    if as_json:
        typer.echo(json.dumps({"runs": runs, "spread": effects.spread(runs)}, indent=2, sort_keys=True))
    else:
        typer.echo(effects.markdown(runs), nl=False)


@app.command()
def sweep(
    seeds: str = typer.Option(..., "--seeds", help="run seeds, e.g. 0,1,2"),
    preset: Optional[str] = PresetOpt,
    config: Optional[Path] = ConfigOpt,
    until: Optional[str] = typer.Option(None, "--until", help="stop each run after this stage"),
    set_: Optional[list[str]] = SetOpt,
    store: Optional[str] = StoreOpt,
    out: Optional[Path] = typer.Option(None, "--out", help="folder for the table (default: $GLMFORGE_HOME/reports)"),
) -> None:
    """Run the pipeline once per seed (`glmforge run --set run.seed=N`, one after the other; the
    curation stages do not read the seed and are reused) and print the effects table: each
    run's value, the mean and std over the seeds, how many met the target. A run in which a
    stage failed is a result: its row shows what it measured, the sweep goes on and exits
    non-zero at the end. Re-running the same sweep reuses every published stage, so an
    interrupted sweep continues where it stopped."""
    import subprocess
    import time

    from glmforge import effects
    from glmforge.pipeline import get_stage
    from runtime.runner import RunRecord

    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    except ValueError:
        _fail(f"--seeds {seeds!r}: expected integers separated by commas, e.g. 0,1,2")
    if len(set(seed_list)) != len(seed_list) or not seed_list:
        _fail(f"--seeds {seeds!r}: give each seed once")
    base = list(set_ or [])
    if any(s.split("=", 1)[0].strip() == "run.seed" for s in base):
        _fail("--set run.seed: the sweep sets it; give the seeds with --seeds")
    try:
        for seed in seed_list:          # every seed's config, validated before the first run starts
            load_config(preset, config, [*base, f"run.seed={seed}"])
        if until:
            get_stage(until)
    except (ConfigError, ValueError) as e:
        _fail(str(e))
    st = _store(store)
    runs, walls, run_ids, failures = {}, {}, {}, {}
    for seed in seed_list:
        argv = [sys.executable, "-m", "glmforge.cli", "run"] + (["--config", str(config)] if config else
                                                             ["--preset", preset or "tiny"])
        argv += [a for s in [*base, f"run.seed={seed}"] for a in ("--set", s)]
        argv += (["--until", until] if until else []) + (["--store", store] if store else [])
        typer.echo(f"sweep: seed {seed}: {' '.join(argv[2:])}")
        t0 = time.monotonic()
        code = subprocess.call(argv)
        walls[seed] = time.monotonic() - t0
        record = RunRecord.load(st)
        if record is None or record.config.get("run", {}).get("seed") != seed:
            if code != 0:
                _fail(f"sweep: the run with seed {seed} ended with exit status {code} before it recorded a run",
                      code=code)
            _fail(f"sweep: the latest run in {st.uri} is not seed {seed}'s (another run in the same store?)", code=1)
        # A stage that failed (a gate tripped, a crash) is a result of that seed: its run goes in
        # the table with what it measured and the sweep goes on. A run stopped before any stage
        # failed (interrupted, preempted) is not: rerun the sweep to continue it.
        failed = effects.failed_stages(record.stages)
        if code != 0 and not failed:
            _fail(f"sweep: the run with seed {seed} ended with exit status {code}; rerun the sweep to continue "
                  "from its published stages", code=code)
        label = f"seed {seed} ({record.id}" + (f", {failed[0]} failed" if failed else "") + ")"
        if code != 0:
            failures[seed] = (code, f"{failed[0]} failed in run {record.id}")
        runs[label] = effects.measure_record(record.public())
        run_ids[str(seed)] = record.id
        typer.echo(f"sweep: seed {seed}: run {record.id} {record.state} in {walls[seed] / 60:.1f} min")
    from glmforge.report import default_out_dir

    folder = out or default_out_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"sweep-{preset or (config.stem if config else 'tiny')}-seeds-{'-'.join(map(str, seed_list))}"
    saved = {"seeds": seed_list, "until": until, "overrides": base, "run_ids": run_ids,
             "failed": {str(k): why for k, (_, why) in failures.items()},
             "wall_s": {str(k): round(v, 1) for k, v in walls.items()}, "runs": runs, "spread": effects.spread(runs)}
    (folder / f"{stem}.json").write_text(json.dumps(saved, indent=1))
    st.put_json(f"{effects.SWEEPS}{stem}.json", saved)   # where each run's report finds its sweep
    md, table = folder / f"{stem}.md", effects.markdown(runs)
    md.write_text(table)
    typer.echo(table, nl=False)
    typer.echo(f"wall time per seed (min): {', '.join(f'{k}: {v / 60:.1f}' for k, v in walls.items())}")
    typer.echo(md)
    if failures:
        _fail("sweep: " + "; ".join(f"seed {k}: {why}" for k, (_, why) in failures.items())
              + " (their rows are in the table, from the stages that finished)", code=next(iter(failures.values()))[0])


@app.command()
def publish(
    out: Path = typer.Option(..., "--out", help="folder for the release: full/ and int4/, each with README.md (the model card)"),
    run_id: Optional[str] = typer.Option(None, "--run", help="run id (default: the latest run)"),
    store: Optional[str] = StoreOpt,
    name: Optional[str] = typer.Option(None, "--name", help="registered model name in MLflow's registry (the run's "
                                       "tracking: section, or --tracking-uri); without it nothing is registered"),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow tracking URI for --name "
                                               "(default: the run's tracking.uri, or $MLFLOW_TRACKING_URI)"),
    hf_repo: Optional[str] = typer.Option(None, "--hf-repo", help="Hugging Face Hub repo id (org/name): upload the "
                                          "folder there, with the token in $HF_TOKEN"),
) -> None:
    """Publish a run's final model: the distill stage's exports with a model card, as versions of a
    registered model in MLflow (--name) and on the Hugging Face Hub (--hf-repo)."""
    from glmforge.publish import PublishError, push_to_hub, register, write_release
    from runtime.runner import RunRecord
    from runtime.tracking import TrackingConfig, check_tracking

    st = _store(store)
    record = RunRecord.load(st, run_id)
    if record is None:
        _fail(f"no run {run_id!r} in {st.uri}" if run_id else f"no run recorded in {st.uri}")
    tracking = TrackingConfig(**(record.config.get("tracking") or {}))
    if name:
        tracking = tracking.model_copy(update={"backend": "mlflow", "uri": tracking_uri or tracking.uri})
    token = os.environ.get("HF_TOKEN")
    try:
        if name:
            check_tracking(tracking)
        if hf_repo and not token:
            raise PublishError("--hf-repo needs a Hugging Face token in $HF_TOKEN")
        folder, _ = write_release(st, record, out)
        typer.echo(f"release: {folder}")
        if name:
            versions = register(tracking, record, folder, name)
            typer.echo(f"registered {name}: versions {', '.join(versions)} (full, int4)")
        if hf_repo:
            typer.echo(f"uploaded: {push_to_hub(folder, hf_repo, token)}")
    except (PublishError, ValueError, RuntimeError) as e:
        _fail(str(e), 1)


@app.command()
def report(
    run_id: Optional[str] = typer.Option(None, "--run", help="run id (default: the latest run)"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for run-ID.html (default: $GLMFORGE_HOME/reports)"),
    store: Optional[str] = StoreOpt,
) -> None:
    """Write one self-contained HTML page of a run (stages, curation funnel, loss and reward
    curves, quantization, gates, lineage) from the store alone; print its path."""
    from glmforge.report import write_report
    from runtime.runner import RunRecord

    st = _store(store)
    record = RunRecord.load(st, run_id)
    if record is None:
        _fail(f"no run {run_id!r} in {st.uri}" if run_id else f"no run recorded in {st.uri}")
    try:
        path = write_report(st, record, out)
    except OSError as e:
        _fail(f"cannot write the report: {e}")
    typer.echo(path)


def _resolve_ref(st, ref: str):
    from glmforge.artifacts import resolve

    try:
        return resolve(ref, st)[1]
    except ValueError as e:
        _fail(str(e))


@artifacts_app.command("ls")
def artifacts_ls(stage: Optional[str] = typer.Option(None, "--stage"), store: Optional[str] = StoreOpt) -> None:
    """List published artifacts."""
    st = _store(store)
    for m in st.artifacts():
        if stage is None or m.stage == stage:
            size = sum(f.size for f in m.files)
            typer.echo(f"{m.stage}/{m.key}  {len(m.files)} files  {size} bytes  digest {m.digest[:16]}")


@artifacts_app.command("show")
def artifacts_show(ref: str = typer.Argument(..., help="STAGE/KEY or STAGE"), store: Optional[str] = StoreOpt) -> None:
    """Print an artifact's manifest (files, metrics, lineage)."""
    st = _store(store)
    typer.echo(_resolve_ref(st, ref).to_json())


@artifacts_app.command("verify")
def artifacts_verify(
    ref: Optional[str] = typer.Argument(None, help="STAGE/KEY or STAGE (default: every artifact)"),
    store: Optional[str] = StoreOpt,
) -> None:
    """Check every file of an artifact (or of all) against its manifest digests."""
    from runtime.store import CorruptArtifactError

    st = _store(store)
    manifests = [_resolve_ref(st, ref)] if ref else list(st.artifacts())
    bad = 0
    for m in manifests:
        try:
            st.verify(m)
            typer.echo(f"ok       {m.stage}/{m.key}")
        except CorruptArtifactError as e:
            bad += 1
            typer.echo(f"CORRUPT  {m.stage}/{m.key}: {e}")
    if bad:
        raise typer.Exit(1)


@artifacts_app.command("gc")
def artifacts_gc(store: Optional[str] = StoreOpt) -> None:
    """Delete half-published uploads that no manifest references."""
    for p in _store(store).gc():
        typer.echo(f"removed {p}")


@app.command()
def curate(
    step: str = typer.Argument(..., help="quality, dedup-exact, dedup-minhash, dedup-semantic, issue-pr, decontaminate, tokenize, pack"),
    input_path: str = typer.Option(..., "--input", "-i", help="JSONL, Parquet or a folder of them (local or s3://)"),
    output: str = typer.Option(..., "--output", "-o", help="directory, s3:// prefix, or a .jsonl/.parquet file"),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="override within the step's section, e.g. --set threshold=0.8"),
    with_: Optional[list[str]] = typer.Option(None, "--with", help="another input the step needs, PARENT=DIR (e.g. tokenize=out/tok)"),
    preset: str = typer.Option("tiny", "--preset", help="preset whose section gives the step's defaults"),
    seed: int = typer.Option(0, "--seed"),
    text_field: str = typer.Option("text", "--text-field", help="input field holding the text"),
    text_template: Optional[str] = typer.Option(None, "--text-template", help='build text from fields, e.g. "{title}\\n{body}"'),
) -> None:
    """Run one curation step on its own, outside the pipeline."""
    from glmforge.curate import curate as run_curate

    extra = {}
    for item in with_ or []:
        parent, sep, path = item.partition("=")
        if not sep:
            _fail(f"--with {item!r}: expected PARENT=DIR")
        extra[parent] = path
    from runtime import shutdown

    try:
        # a stop signal also ends the step's worker processes, not only their queue
        with shutdown.on_stop(shutdown.terminate_children):
            result = run_curate(step, input_path, output, list(set_ or []), extra, preset=preset, seed=seed,
                                text_field=text_field, text_template=text_template)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        _fail(str(e))
    except KeyboardInterrupt as e:
        _stopped(f"curate {step}", e)
    typer.echo(json.dumps(result, indent=2, sort_keys=True, default=str))


@envs_app.command("build")
def envs_build(
    out: Path = typer.Option(..., "--out", "-o", help="folder to build in (a killed build resumes there)"),
    source: Optional[list[str]] = typer.Option(None, "--source", help="a local folder or git checkout (its name: the "
                                               "folder's); repeat. Default: the preset's swe_envs.sources"),
    preset: str = typer.Option("tiny", "--preset", help="preset whose swe_envs section gives the defaults"),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="override within swe_envs, e.g. --set workers=4"),
    pairs: Optional[Path] = typer.Option(None, "--pairs", help="the issue-pr stage's pairs.jsonl: pairs of a source's "
                                         "`github` repository become instances at their base commits"),
) -> None:
    """Build environments (the swe-envs stage's work) outside the pipeline: per source a report,
    and the instances its tests verify; the summary is printed as JSON."""
    from posttrain.swe_envs import SWEEnvsConfig, build_all, summary
    from rl.swe.sources import Source

    try:
        section = load_config(preset, overrides=[f"swe_envs.{x}" for x in set_ or []]).swe_envs
        if source:
            section = SWEEnvsConfig(**{**section.model_dump(), "sources": [
                Source(name=Path(s).resolve().name, kind="path", path=str(Path(s).resolve())).model_dump()
                for s in source]})
        if pairs is not None and not pairs.is_file():
            raise ValueError(f"--pairs {pairs}: no such file")
        from posttrain.swe_envs import read_pairs

        read_pairs(pairs, None)          # a malformed line is named before anything is built
    except (ConfigError, ValueError) as e:
        _fail(str(e))
    from runtime import shutdown

    t0 = time.perf_counter()
    try:
        with shutdown.on_stop(shutdown.terminate_children):
            reports = build_all(section, out, lambda i, n, what: typer.echo(f"[{i}/{n}] {what}", err=True), pairs)
    except ValueError as e:
        _fail(str(e))
    except KeyboardInterrupt as e:
        _stopped("envs build", e, "the same command goes on where it stopped")
    for r in reports:
        if not r["built"]:
            typer.echo(f"{r['source']}: not built ({r['reason']}): {r.get('detail', '')}", err=True)
    total = sum(r.get("instances", 0) for r in reports)
    typer.echo(json.dumps(summary(reports, total, time.perf_counter() - t0), indent=2))


ApiOpt = typer.Option(None, "--api", help="Prefect API URL (default: $PREFECT_API_URL, else http://127.0.0.1:4200/api)")


SCHEDULES = "tasks.schedules"   # the Prefect client's side, reached by name like the flows (tests/test_layers.py)


def _schedules():
    import importlib

    return importlib.import_module(SCHEDULES)


@schedule_app.command("ls")
def schedule_ls(api: Optional[str] = ApiOpt) -> None:
    """Every schedule of every deployment: deployment, on/off, when, id."""
    sch = _schedules()
    try:
        rows = sch.list_schedules(sch.api_url(api))
    except sch.ScheduleError as e:
        _fail(str(e))
    if not rows:
        typer.echo("no schedules")
    for name, s in rows:
        typer.echo(f"{name:<40} {'on' if s['active'] else 'off':<4} {sch.describe(s):<30} {s['id']}")


def _set_active(deployment: str, api: str | None, active: bool) -> None:
    sch = _schedules()
    try:
        for s in sch.set_active(sch.api_url(api), deployment, active):
            typer.echo(f"{deployment:<40} {'on' if s['active'] else 'off':<4} {sch.describe(s)}")
    except sch.ScheduleError as e:
        _fail(str(e))


DeploymentArg = typer.Argument("glmforge-pipeline/end-to-end", help="FLOW/DEPLOYMENT (`glmforge schedule ls`)")


@schedule_app.command("on")
def schedule_on(deployment: str = DeploymentArg, api: Optional[str] = ApiOpt) -> None:
    """Turn a deployment's schedules on (default: the nightly end-to-end run)."""
    _set_active(deployment, api, True)


@schedule_app.command("off")
def schedule_off(deployment: str = DeploymentArg, api: Optional[str] = ApiOpt) -> None:
    """Turn a deployment's schedules off."""
    _set_active(deployment, api, False)


@schedule_app.command("add")
def schedule_add(
    deployment: str = DeploymentArg,
    every: Optional[float] = typer.Option(None, "--every", help="interval in seconds"),
    cron: Optional[str] = typer.Option(None, "--cron", help='cron expression, e.g. "0 2 * * *"'),
    timezone: str = typer.Option("UTC", "--timezone"),
    param: Optional[list[str]] = typer.Option(None, "--param", help="flow parameter for these runs, NAME=VALUE (YAML value; repeatable)"),
    api: Optional[str] = ApiOpt,
) -> None:
    """Add an active schedule to a deployment."""
    from glmforge.config import parse_override

    sch = _schedules()
    try:
        params = dict(parse_override(p) for p in param or [])
        s = sch.add(sch.api_url(api), deployment, every=every, cron=cron, timezone=timezone, parameters=params)
    except (sch.ScheduleError, ConfigError, ValueError) as e:
        _fail(str(e).replace("--set", "--param", 1))
    typer.echo(f"{deployment:<40} on   {sch.describe(s):<30} {s['id']}")


@app.command()
def serve(
    port: int = typer.Option(4200, help="Prefect server port (127.0.0.1)"),
    pool: str = typer.Option("glmforge", help="process work pool name"),
    database: Optional[str] = typer.Option(
        None, "--database", envvar="GLMFORGE_PREFECT_DATABASE", show_envvar=True,  # serve.DATABASE_ENV
        help="the Prefect server's database: postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DB (several "
             "pipelines and workers at once), or sqlite+aiosqlite:///PATH. Default: $PREFECT_HOME/prefect.db "
             "(SQLite). Give a password through the environment variable, not the command line"),
    automations: Optional[Path] = typer.Option(
        None, exists=True, dir_okay=False, help="Prefect automations to install (default: "
        "deployments/automations.yaml: reruns of preempted and crashed runs, zombie runs Crashed after 90 s "
        "without a heartbeat, abandoned cancels settled after 120 s)"),
) -> None:
    """Local Prefect server + process work pool + deployments from prefect.yaml + a worker; a
    server or worker that exits is started again, and everything stops on Ctrl-C or SIGTERM."""
    from glmforge.serve import AUTOMATIONS, DATABASE_SETTINGS, serve_forever

    ensure_homes()
    database = database or next((os.environ[v] for v in DATABASE_SETTINGS if os.environ.get(v)), None)
    try:
        serve_forever(port=port, pool=pool, database=database, automations=automations or AUTOMATIONS)
    except (ValueError, RuntimeError) as e:
        _fail(str(e), 2 if isinstance(e, ValueError) else 1)


def main() -> None:
    from runtime import shutdown

    shutdown.install()  # SIGTERM (docker stop, a pod eviction) takes Ctrl-C's path everywhere
    from runtime.store import StoreUnavailableError

    try:
        app()
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except StoreUnavailableError as e:  # any command that reads an S3 store whose server is down
        typer.echo(f"error: {e}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
