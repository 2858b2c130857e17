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
    if p.is_dir() and parse_uri(str(ref)) is None:
        return p

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
         as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Parameters (total/activated), FLOPs per token, KV-cache bytes per token."""
    from model.config import preset as get_preset
    from model.info import summary
    try:
        s = summary(get_preset(preset), context=context, bytes_per_value=kv_bytes)
    except ValueError as e:
        _fail(str(e))
    s["preset"] = preset
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


@model_app.command("export")
def export(preset: str = typer.Option(..., help="tiny | small | glm5"),
           init: str = typer.Option("random", help="only 'random' for now"),
           seed: int = typer.Option(0),
           out: Path = typer.Option(..., help="output directory (HF GlmMoeDsaForCausalLM format)"),
           tokenizer: Path | None = typer.Option(None, help="directory holding tokenizer.json to copy")) -> None:
    """Export a model in transformers' GlmMoeDsaForCausalLM format."""
    import torch

    from model.config import preset as get_preset
    from model.hf import save_pretrained
    from model.model import GLMModel
    if init != "random":
        _fail(f"--init must be 'random', got {init!r}")
    try:
        cfg = get_preset(preset)
        torch.manual_seed(seed)
        path = save_pretrained(GLMModel(cfg), out, tokenizer_dir=tokenizer)
    except ValueError as e:
        _fail(str(e))
    typer.echo(str(path))


def read_texts(path: Path) -> list[str]:
    """.txt: the whole file is one text; .jsonl: the "text" field of every line."""
    if path.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(path.read_text().splitlines()):
            if line.strip():
                row = json.loads(line)
                if "text" not in row:
                    raise ValueError(f"{path}:{i + 1} has no 'text' field")
                texts.append(row["text"])
        return texts
    if path.suffix == ".txt":
        return [path.read_text()]
    raise ValueError(f"input must be .txt or .jsonl, got {path.name}")


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
                   input: Path = typer.Option(..., help=".txt or .jsonl with a 'text' field"),
                   max_length: int = typer.Option(512, help="tokens per scoring window"),
                   as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Token-level perplexity of a text file."""
    try:
        if not input.exists():
            raise ValueError(f"input file {input} does not exist")
        res = perplexity(resolve_model_dir(model), read_texts(input), max_length)
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
