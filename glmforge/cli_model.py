"""`glmforge model ...` and `glmforge eval ...`: model statistics, export, perplexity.

Two typer apps; the main CLI mounts them. Everything heavy lives in model/.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer

model_app = typer.Typer(help="Model presets: statistics and export.", no_args_is_help=True)
eval_app = typer.Typer(help="Evaluate models.", no_args_is_help=True)


@eval_app.callback()
def _eval() -> None:
    """Evaluate models."""


def resolve_model_dir(ref: str | Path) -> Path:
    """A model reference -> a local HF-format checkpoint directory: an existing directory, or a
    store artifact (`STAGE/KEY`, `STAGE` = its key in the latest run, or a full artifact URI)
    whose files hold the model at the top or under `hf/`."""
    from glmforge.artifacts import materialize, parse_uri

    p = Path(ref)
    if parse_uri(str(ref)) is None:
        if p.is_dir():
            return p
        from glmforge.pipeline import get_stage

        try:
            get_stage(str(ref).partition("/")[0])
            named_a_stage = True
        except ValueError:
            named_a_stage = False
        # a path, not STAGE[/KEY]: refused here, before a store is opened (and created)
        if not named_a_stage:
            if p.exists():
                raise ValueError(f"model {ref} is not a folder: give the folder holding config.json")
            raise ValueError(f"model folder {ref} does not exist (a store artifact is named STAGE or "
                             "STAGE/KEY, e.g. sft)")

    local = materialize(str(ref))
    for candidate in (local, local / "hf"):
        if (candidate / "config.json").is_file():
            return candidate
    raise ValueError(f"artifact {ref!r} holds no model (no config.json at its top or under hf/)")


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code=2)


@model_app.command("info")
def info(preset: str = typer.Option(..., help="tiny | small | glm5"),
         context: int = typer.Option(4096, help="context length for the attention FLOPs"),
         kv_bytes: int = typer.Option(2, help="bytes per cached value (2 = bf16)"),
         plan: str | None = typer.Option(None, "--plan", help="NODESxGPUS (e.g. 128x8): memory per GPU for this "
                                         "layout; other fields from the preset config's `plan:` section"),
         zero: int | None = typer.Option(None, "--zero", help="ZeRO stage 0-3"),
         ep: int | None = typer.Option(None, "--ep", help="expert-parallel group size"),
         gpu_mem: int | None = typer.Option(None, "--gpu-mem", help="GPU memory in GB: 80 or 141"),
         micro_batch: int | None = typer.Option(None, "--micro-batch", help="sequences per GPU per micro-step"),
         seq_len: int | None = typer.Option(None, "--seq-len", help="training sequence length"),
         checkpointing: bool | None = typer.Option(None, "--checkpointing/--no-checkpointing",
                                                   help="activation checkpointing (recompute each block)"),
         optimizer: str | None = typer.Option(None, "--optimizer", help="muon | adamw"),
         rollout_tokens: int | None = typer.Option(None, "--rollout-tokens", help="KV-cache tokens per GPU in RL rollouts"),
         as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Parameters (total/activated), FLOPs per token, KV-cache bytes per token; with --plan, the
    memory per GPU of a training layout (exit 1 when it does not fit, naming what to change)."""
    from model.config import preset as get_preset
    from model.info import summary
    try:
        s = summary(get_preset(preset), context=context, bytes_per_value=kv_bytes)
    except ValueError as e:
        _fail(str(e))
    s["preset"] = preset
    if plan is not None:
        given = {"zero_stage": zero, "ep": ep, "gpu_mem_gb": gpu_mem, "micro_batch_size": micro_batch,
                 "seq_len": seq_len, "activation_checkpointing": checkpointing, "optimizer": optimizer,
                 "rollout_tokens": rollout_tokens}
        _plan_info(preset, plan, {k: v for k, v in given.items() if v is not None}, s, as_json)
        return
    if as_json:
        typer.echo(json.dumps(s, indent=2))
        return
    typer.echo(f"preset {preset}")
    typer.echo(f"  total params (no MTP, with input embedding):   {s['total_params'] / 1e9:10.3f} B")
    typer.echo(f"  active params (no MTP, no input embedding):    {s['active_params'] / 1e9:10.3f} B")
    typer.echo(f"  total params (no MTP, no input embedding):     {s['total_params_without_embedding'] / 1e9:10.3f} B")
    typer.echo(f"  total params with MTP layer:                   {s['total_params_with_mtp'] / 1e9:10.3f} B")
    typer.echo(f"  forward FLOPs/token @ {context} ctx, dense:  {s['flops_per_token_dense'] / 1e9:10.3f} GFLOP")
    typer.echo(f"  forward FLOPs/token @ {context} ctx, DSA:    {s['flops_per_token_dsa'] / 1e9:10.3f} GFLOP")
    typer.echo(f"  KV cache per token ({kv_bytes} B/value):         {s['kv_cache_bytes_per_token']} bytes")


def _plan_defaults(preset: str) -> dict:
    """The `plan:` section of configs/PRESET.yaml (read as YAML: the section is validated to fit,
    and a --plan on the command line may be what makes it fit), or {}."""
    import yaml

    from glmforge.config import CONFIGS_DIR
    path = CONFIGS_DIR / f"{preset}.yaml"
    if not path.is_file():
        return {}
    return dict((yaml.safe_load(path.read_text()) or {}).get("plan") or {})


def _rl_stage_pools(preset: str, plan) -> dict:
    """rl.placement.stage_pools for every RL-side stage of the preset's config, as it places
    them, under `plan`; {} for a preset without a config file."""
    import yaml

    from glmforge.config import CONFIGS_DIR, ConfigError, load_config, pipeline_model, preset_path
    from rl.placement import config_pools

    if not (CONFIGS_DIR / f"{preset}.yaml").is_file():
        return {}
    try:
        config = load_config(preset)
    except ConfigError:               # a placement that does not fit: shown here, refused at a run
        config = pipeline_model().model_validate(yaml.safe_load(preset_path(preset).read_text()))
    return config_pools(config, plan)


def _gb(parts: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v / 1e9:,.1f}" for k, v in parts.items() if v)


def _plan_info(preset: str, plan_text: str, given: dict, s: dict, as_json: bool) -> None:
    from dataclasses import replace

    from model.config import preset as get_preset
    from model.info import GB, Plan, memory_plan, not_fitting_message, parse_plan
    try:
        nodes, gpus = parse_plan(plan_text)
        base = _plan_defaults(preset)
        if base.get("model_preset", preset) != preset:
            base = {}
        cfg = get_preset(preset, **base.get("model_overrides", {}))
        fields = {k: v for k, v in base.items() if k in Plan.__dataclass_fields__}
        if given.get("gpu_mem_gb", fields.get("gpu_mem_gb", 80)) not in (80, 141):
            raise ValueError(f"--gpu-mem {given['gpu_mem_gb']}: choose 80 or 141")
        p = replace(Plan(nodes=nodes, gpus_per_node=gpus), **{**fields, **given, "nodes": nodes, "gpus_per_node": gpus})
        r = memory_plan(cfg, p)
    except ValueError as e:
        _fail(str(e))
    fits = r["fits_training"] and r["fits_rollout"]
    pools = _rl_stage_pools(preset, p)
    if as_json:
        typer.echo(json.dumps({**s, "memory_plan": r, "rl_pools": pools}, indent=2))
    else:
        b = r["bytes"]
        typer.echo(f"preset {preset}: plan {r['plan']} = {r['world']} GPUs, ZeRO-{r['zero_stage']}, ep {r['ep']} "
                   f"(experts data-parallel over {r['dp_expert']}, dense weights over {r['dp_dense']}), "
                   f"{r['optimizer']}, micro-batch {r['micro_batch_size']} x {r['seq_len']} tokens, activation "
                   f"checkpointing {'on' if r['activation_checkpointing'] else 'off'}, {r['gpu_mem_gb']} GB GPUs")
        typer.echo(f"  weights per GPU: {r['params_per_gpu'] / 1e9:.2f} B of {r['params_total'] / 1e9:.2f} B "
                   f"({r['params_expert'] / 1e9:.2f} B in routed experts, sharded /{r['ep']})")
        rows = [("parameters (bf16)", "parameters"), ("gradients (bf16)", "gradients"),
                ("master weights (fp32)", "master_weights"),
                ("optimizer states (fp32; Muon 1, AdamW 2 per element)", "optimizer_states"),
                ("activations (bf16, + fp32 logits)", "activations"), ("reserve (CUDA, NCCL, fragments)", "reserve"),
                ("= training", "training_total"),
                ("= the RL trainer (AdamW: 2 fp32 moments per element)", "rl_training_total"),
                (f"rollout KV cache ({r['rollout_tokens']} tokens x {r['kv_cache_bytes_per_token']} B)",
                 "rollout_kv_cache"),
                ("= rollouts (bf16 weights + KV cache + reserve)", "rollout_total")]
        for label, key in rows:
            typer.echo(f"  {label:<58} {b[key] / GB:9.2f} GB")
        typer.echo(f"  activations: {r['activation_values_per_token']} bf16 values + {r['logit_bytes_per_token']} "
                   "logit bytes per token (model.info.activation_values_per_token)")
        w = r["weight_sync"]
        typer.echo(f"  RL weight sync: one version {w['version_bytes'] / GB:.1f} GB (bf16); each trainer GPU sends "
                   f"{w['send_bytes_per_trainer_gpu'] / GB:.2f} GB, each rollout GPU receives "
                   f"{w['receive_bytes_per_rollout_gpu'] / GB:.2f} GB: {w['seconds']:.2f} s at {w['gb_per_s']:g} GB/s "
                   "per GPU")
        if not r["fits_rl_training"]:
            typer.echo(f"  the RL trainer does not fit a {r['gpu_mem_gb']} GB GPU with AdamW at this layout: "
                       "use the pretraining optimizer's layout or more GPUs for the RL stages")
        if pools:
            typer.echo(f"  RL-side stages as configs/{preset}.yaml places them, GB per GPU (loading the config refuses "
                       "a pool that does not fit; the exit status is the plan above's):")
        for stage, pl in pools.items():
            if "error" in pl:
                typer.echo(f"    {stage:<13} {pl['error']}")
                continue
            t = pl["trainer"]
            where = "the ranks generate, judge or score teachers too (whole model copies)" if t["generates"] \
                or t["bytes"]["whole_models"] else "ranks that only train"
            where += f"; {pl['note']}" if "note" in pl else ""
            typer.echo(f"    {stage:<13} {pl['gpus']} GPUs. trainer: {t['gpus']} GPUs, ZeRO-{t['zero_stage']}, ep "
                       f"{t['ep']}, {where}: {t['bytes_per_gpu'] / GB:,.1f}{'' if t['fits'] else '  DOES NOT FIT'} "
                       f"({_gb(t['bytes'])})")
            for name, sv in pl["servers"].items():
                typer.echo(f"    {'':<13} {name}: {sv['replicas']} replica(s) x {sv['gpus_per_replica']} GPU(s) (data "
                           f"parallel {sv['data_parallel']}, ep {sv['expert_parallel']}): {sv['bytes_per_gpu'] / GB:,.1f}"
                           f"{'' if sv['fits'] else '  DOES NOT FIT'} ({_gb(sv['bytes'])})")
            w = pl["weight_sync"]
            if pl["servers"]:
                typer.echo(f"    {'':<13} weight sync: {w['version_bytes'] / GB:,.1f} GB a version; a trainer GPU sends "
                           f"{w['send_bytes_per_trainer_gpu'] / GB:.2f}, a server GPU receives "
                           f"{w['receive_bytes_per_server_gpu'] / GB:.1f}: {w['seconds']:.2f} s at {w['gb_per_s']:g} GB/s "
                           "(a full version; deltas move less)")
    if not fits:
        typer.echo(f"error: {not_fitting_message(cfg, p, r)}", err=True)
        raise typer.Exit(code=1)
    if not as_json:
        typer.echo(f"  fits a {r['gpu_mem_gb']} GB GPU")


# The tokenizer an export gets when none is given: the tokenize stage's own training (same
# function, special tokens and min_frequency) on a text shipped in the repo, so it is the same
# on every machine and needs no pipeline run.
DEFAULT_TOKENIZER_TEXT = Path(__file__).resolve().parent.parent / "samples" / "tinyshakespeare" / "input.txt"


def default_tokenizer(vocab_size: int):
    """Byte-level BPE as the tokenize stage trains it (default config), on DEFAULT_TOKENIZER_TEXT,
    with at most `vocab_size` tokens (the model's embedding rows)."""
    from data_processing.tokenizer import TokenizeConfig, train_tokenizer

    defaults = TokenizeConfig()
    if not DEFAULT_TOKENIZER_TEXT.is_file():
        raise ValueError(f"missing {DEFAULT_TOKENIZER_TEXT} (the default tokenizer's training text); pass --tokenizer")
    return train_tokenizer([DEFAULT_TOKENIZER_TEXT.read_text(encoding="utf-8")],
                           min(defaults.vocab_size, vocab_size), defaults.min_frequency)


def write_tokenizer_dir(tok_json: Path | None, vocab_size: int, dest: Path) -> Path:
    """`dest` with tokenizer.json (a copy of tok_json, else default_tokenizer) and, unless one
    came with it, a tokenizer_config.json naming the fast tokenizer class and the special tokens,
    so `transformers.AutoTokenizer.from_pretrained` loads the export as it is."""
    import shutil

    from tokenizers import Tokenizer

    from data_processing.tokenizer import EOS, PAD
    dest.mkdir(parents=True, exist_ok=True)
    if tok_json is None:
        default_tokenizer(vocab_size).save(str(dest / "tokenizer.json"))
    else:
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tok_json.parent / f).is_file():
                shutil.copy(tok_json.parent / f, dest / f)
    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer {tok_json} has {tok.get_vocab_size()} tokens, more than the model's vocab_size {vocab_size}")
    if not (dest / "tokenizer_config.json").exists():
        specials = {k: t for k, t in (("eos_token", EOS), ("pad_token", PAD)) if tok.token_to_id(t) is not None}
        (dest / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **specials}, indent=2))
    return dest


def _tokenizer_json(ref: str) -> Path:
    """--tokenizer: a directory or file holding tokenizer.json, or a store artifact (`tokenize`,
    `tokenize/KEY`, a full artifact URI)."""
    from glmforge.artifacts import materialize, parse_uri

    p = Path(ref)
    if p.exists() and parse_uri(ref) is None:
        found = p if p.is_file() else p / "tokenizer.json"
    else:
        found = materialize(ref) / "tokenizer.json"
    if not found.is_file():
        raise ValueError(f"--tokenizer {ref}: no tokenizer.json in {found.parent}")
    return found


@model_app.command("export")
def export(preset: str = typer.Option(..., help="tiny | small | glm5"),
           init: str = typer.Option("random", help="only 'random' for now"),
           seed: int = typer.Option(0),
           out: Path = typer.Option(..., help="output directory (HF GlmMoeDsaForCausalLM format)"),
           tokenizer: str | None = typer.Option(
               None, help="tokenizer.json, a directory holding it, or a store artifact (e.g. `tokenize` of the "
               "latest run); default: the tokenize stage's tokenizer trained on samples/tinyshakespeare")) -> None:
    """Export a model (and its tokenizer) in transformers' GlmMoeDsaForCausalLM format."""
    import tempfile

    import torch

    from model.config import preset as get_preset
    from model.hf import save_pretrained
    from model.model import GLMModel
    if init != "random":
        _fail(f"--init must be 'random', got {init!r}")
    try:
        cfg = get_preset(preset)
        tok_json = _tokenizer_json(tokenizer) if tokenizer else None
        with tempfile.TemporaryDirectory(prefix="glmforge-tokenizer-") as tmp:
            tok_dir = write_tokenizer_dir(tok_json, cfg.vocab_size, Path(tmp))
            torch.manual_seed(seed)
            path = save_pretrained(GLMModel(cfg), out, tokenizer_dir=tok_dir)
    except ValueError as e:
        _fail(str(e))
    typer.echo(str(path))


def read_texts(path: str, text_field: str = "text", text_template: str | None = None) -> list[str]:
    """The texts of any input `glmforge curate` reads (JSONL, Parquet, text files or a folder of
    them; local or s3://), through the same reader (glmforge.curate.documents_from): each
    record's `text_field`, or `text_template` filled from its fields; a text file is one text.
    A record without a usable text stops with its file, line and reason."""
    import tempfile

    from data_processing.document import read_documents
    from glmforge.curate import documents_from
    with tempfile.TemporaryDirectory(prefix="glmforge-eval-input-") as tmp:
        docs, metrics = documents_from(str(path), Path(tmp), text_field, text_template)
        if metrics.get("quarantined"):
            bad = json.loads((docs / "quarantine.jsonl").read_text().split("\n")[0])  # not splitlines(): U+2028
            where = f"{bad['file']}:{bad['line']}" if bad.get("line") is not None else bad["file"]
            raise ValueError(f"{where}: {bad['reason']} ({metrics['quarantined']} record(s) without text; "
                             "see --text-field / --text-template)")
        return [d.text for d in read_documents(docs)]


def perplexity(model_dir: Path, texts: list[str], max_length: int = 512) -> dict:
    """Token-level perplexity: exp(total NLL / predicted tokens). Each text is scored in
    non-overlapping windows of max_length tokens (the first token of a window is context only)."""
    import torch
    from tokenizers import Tokenizer

    from model.hf import load_pretrained
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.exists():
        raise ValueError(f"missing tokenizer file {tok_path}")
    tokenizer = Tokenizer.from_file(str(tok_path))
    model = load_pretrained(model_dir).eval()
    if tokenizer.get_vocab_size() > model.config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, model vocab {model.config.vocab_size}")
    nll, n = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = tokenizer.encode(text).ids
            for s in range(0, max(len(ids) - 1, 0), max_length):
                chunk = torch.tensor(ids[s:s + max_length + 1])[None]
                if chunk.shape[1] < 2:
                    continue
                out = model(chunk[:, :-1], labels=chunk[:, 1:], compute_mtp=False)
                k = chunk.shape[1] - 1
                nll += out.losses["lm"].item() * k
                n += k
    if n == 0:
        raise ValueError("no tokens to score (texts empty or a single token)")
    return {"perplexity": math.exp(nll / n), "nll_per_token": nll / n, "tokens": n, "documents": len(texts)}


@eval_app.command("perplexity")
def perplexity_cmd(model: str = typer.Option(..., help="model directory (HF format with tokenizer.json)"),
                   input: str = typer.Option(..., help="JSONL, Parquet, text files or a folder of them (local or s3://)"),
                   max_length: int = typer.Option(512, help="tokens per scoring window"),
                   text_field: str = typer.Option("text", "--text-field", help="input field holding the text"),
                   text_template: str | None = typer.Option(
                       None, "--text-template", help='build text from fields, e.g. "{question}\\n{answer}"'),
                   as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Token-level perplexity of a text corpus (read like `glmforge curate` reads its input)."""
    try:
        if "://" not in input and not Path(input).exists():
            raise ValueError(f"input {input} does not exist")
        res = perplexity(resolve_model_dir(model), read_texts(input, text_field, text_template), max_length)
    except ValueError as e:
        _fail(str(e))
    typer.echo(json.dumps(res, indent=2) if as_json else
               f"perplexity {res['perplexity']:.3f} over {res['tokens']} tokens ({res['documents']} documents)")


@eval_app.command("long-context")
def long_context_cmd(model: str = typer.Option(..., help="model directory or store artifact (STAGE[/KEY])"),
                     lengths: str = typer.Option("256,512,1024", help="comma-separated prompt lengths in tokens"),
                     n_per_task: int = typer.Option(10, help="examples per task and length"),
                     seed: int = typer.Option(0, help="suite seed"),
                     as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """RULER-like long-context accuracy (needles, multi-value, variable tracking), exact match."""
    from evals.long_context import evaluate_checkpoint

    try:
        wanted = [int(x) for x in lengths.split(",") if x.strip()]
        if not wanted or any(n <= 0 for n in wanted):
            raise ValueError(f"--lengths {lengths!r}: give positive integers, e.g. 256,512,1024")
        res = evaluate_checkpoint(resolve_model_dir(model), wanted, n_per_task=n_per_task, seed=seed)
    except ValueError as e:
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps(res, indent=2))
        return
    for task, by_len in res["accuracy"].items():
        typer.echo(f"{task:<18} " + "  ".join(f"{n}: {acc:.2f}" for n, acc in by_len.items()))
