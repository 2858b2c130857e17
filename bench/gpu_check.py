"""One command that checks glmforge's GPU paths on a CUDA machine and writes a report (issue 18).

Everything GPU-specific here has only run on CPU so far. On a machine with one NVIDIA GPU this
script runs, each section in a fresh process under its own timeout (a failure or a timeout is
recorded and the next section still runs; the report is rewritten after every section):

  environment           versions, GPU, missing Python packages; the install commands (below)
  kernel_tests          pytest tests/kernels with the Triton checks compiled on CUDA
                        (GLMFORGE_TEST_DEVICE=cuda, TRITON_INTERPRET unset), forward and
                        backward; pass/fail per test from pytest's junit XML
  attention             bench/attention.py (DSA vs dense, forward + backward, GLM-5 widths / 4)
                        at 8K, 32K, 64K and 128K tokens with --device cuda
  speculative_decoding  bench/decode.py's recipe: train a model briefly on the stdlib's source
                        (LM + MTP loss), then MTP speculative vs plain greedy decoding, tokens/s
  bf16_training         50 steps of model + AdamW on the same data in fp32 and in bf16 autocast
                        from the same initial weights and batches; loss parity within tolerances
  nccl_launch           torchrun, 1 rank, backend nccl, DDP, a few bf16 steps

Outputs under --out (default $OUT, else ./gpu_check_out): report.json, report.md,
kernel_tests.xml and gpu_check.log (every section's output). Default timeouts add up to under
8 minutes (--budget caps the total); --timeout NAME=SECONDS changes one.

Model for decoding and training: preset `tiny` widened by overrides (hidden 256, 4 layers, byte
vocab 256; see MODEL_OVERRIDES), sized for these timeouts; --model-preset small takes the
`small` preset (~100M-class, 12 layers, 32 experts; slower) with the byte vocab instead.

Installing: if the installed torch has no CUDA (torch.version.cuda is None) the environment
section prints `python -m pip install --force-reinstall torch==<the same version>` (the default
index's Linux wheels are CUDA builds) and runs it only with --install; Python packages the
sections import but that are missing are installed the same way, with the version ranges of
requirements-cpu.txt / requirements-dev.txt, or from wheels in a folder with --wheels DIR (no
network). Otherwise the installed packages are used as they are.

On this workplace's GPU machine (repo root copied there, $OUT collected afterwards, no network,
torch + triton + pytest installed but not pydantic, which model/config.py needs):

    # here, once: the wheels the machine lacks (Python 3.12 there), into an ignored folder
    echo /.whl/ >> .git/info/exclude
    python3 bench/gpu_check.py --fetch-wheels .whl
    # there (carry .whl), one command, under 8 minutes:
    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --wheels .whl --out $OUT

Without a CUDA device (or with --dry-run) nothing runs on a GPU: the script checks every
section's preconditions, marks the GPU sections "skipped: no CUDA device" and still writes both
reports (tests/bench/test_gpu_check.py runs it so). --device cpu --quick runs every section at
toy sizes on CPU, to try the script itself.

Exit status: 0 when no section failed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
SCHEMA = 1
LENGTHS = [8192, 32768, 65536, 131072]
QUICK_LENGTHS = [256, 512]
# `tiny` widened towards a small model; the byte vocab (256) matches bench/decode.py's data
MODEL_OVERRIDES = {"tiny": dict(hidden_size=256, num_layers=4), "small": {}}
# the section timeouts (SECTIONS) add up to 465 s; the budget keeps one run under 8 minutes
BUDGET_S = 460
INSTALL_TIMEOUT_S = 900
# bf16 vs fp32 parity: the first loss comes from the same weights and batch (only the precision
# differs); the last-10 mean after 50 steps of diverging trajectories gets a looser bound
FIRST_LOSS_RTOL = 0.01
FINAL_LOSS_RTOL = 0.03
# module -> distribution name, for the install commands
DISTRIBUTIONS = {"torch": "torch", "triton": "triton", "pytest": "pytest", "pydantic": "pydantic",
                 "numpy": "numpy", "safetensors": "safetensors"}


class CheckFailed(Exception):
    """A section ran but what it checks does not hold (the numbers it recorded are kept)."""


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    needs_cuda: bool
    timeout_s: float
    modules: tuple[str, ...]                 # Python modules it imports: its preconditions
    fn: Callable[["Context"], None]
    default: bool = True                     # run without --sections naming it


class Context:
    """What a section sees: arguments, device, output folder, its deadline, and `record`, which
    keeps numbers (written through to the result file at once, so a timeout still reports them)."""

    def __init__(self, args: argparse.Namespace, deadline: float, result_path: Path | None = None):
        self.args, self.deadline, self.result_path = args, deadline, result_path
        self.device = args.device
        self.out = Path(args.out)
        self.numbers: dict[str, Any] = {}

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, **numbers: Any) -> None:
        self.numbers.update(numbers)
        if self.result_path is not None:
            write_json(self.result_path, {"numbers": self.numbers})


def _finite(obj: Any) -> Any:
    """NaN / inf as strings: strict JSON readers refuse the bare NaN json.dumps writes."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_finite(obj), indent=1, default=str, allow_nan=False))
    tmp.replace(path)            # atomic: a reader never sees half a file


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_command(cmd: list[str], timeout: float, log_path: Path | None = None,
                env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run cmd in its own process group (killed whole at the timeout, grandchildren too).
    -> (exit code, or None on timeout; the output), the output also appended to log_path."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env or child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(timeout, 0.1))
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    if log_path is not None:
        with open(log_path, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{out}\n")
    return rc, out


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# ------------------------------------------------------------------ sections

def requirement_spec(dist: str) -> str:
    """The requirement line for `dist` in the project's requirement files, else its name."""
    for name in ("requirements-cpu.txt", "requirements-dev.txt"):
        path = REPO / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            line = line.split("#")[0].strip()
            m = re.match(r"([A-Za-z0-9_.\-]+)", line)
            if m and m.group(1).lower().replace("_", "-") == dist.lower():
                return line
    return dist


def missing_modules(modules) -> list[str]:
    return sorted(m for m in set(modules) if importlib.util.find_spec(m) is None)


def install_commands(torch_version: str | None, torch_cuda: str | None, missing: list[str],
                     wheels: str | None) -> list[list[str]]:
    """The pip commands that would give this Python a CUDA torch and the missing packages."""
    pip = [sys.executable, "-m", "pip", "install"]
    cmds = []
    if torch_version is not None and torch_cuda is None:
        # "2.13.0+cpu" satisfies ==2.13.0, so pip would keep it without --force-reinstall
        cmds.append(pip + ["--force-reinstall", f"torch=={torch_version.split('+')[0]}"])
    specs = [requirement_spec(DISTRIBUTIONS.get(m, m)) for m in missing if m != "torch" or
             torch_version is None]
    if specs:
        cmds.append(pip + (["--no-index", "--find-links", wheels] if wheels else []) + specs)
    return cmds


def environment(ctx: Context) -> None:
    from importlib.metadata import PackageNotFoundError, version

    ctx.record(python=platform.python_version(), cuda_available=False)
    try:
        import torch
    except ImportError:
        torch = None
        ctx.record(torch="not installed")
    if torch is not None:
        cuda = torch.cuda.is_available()
        ctx.record(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=cuda)
        if cuda:
            p = torch.cuda.get_device_properties(0)
            nccl = torch.cuda.nccl.version()
            ctx.record(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                       compute_capability=f"{p.major}.{p.minor}", gpu_count=torch.cuda.device_count(),
                       nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
    for dist in ("triton", "pytest", "pydantic", "deepspeed"):     # metadata only: no slow imports
        try:
            ctx.record(**{dist: version(dist)})
        except PackageNotFoundError:
            ctx.record(**{dist: "not installed"})
    missing = missing_modules(m for s in SECTIONS for m in s.modules)
    cmds = install_commands(None if torch is None else torch.__version__,
                            None if torch is None else torch.version.cuda, missing, ctx.args.wheels)
    ctx.record(missing_modules=missing, install_commands=[" ".join(c) for c in cmds])
    if not cmds:
        return
    if not ctx.args.install or ctx.args.dry_run:
        print("to install what the GPU sections need, run (or pass --install):")
        for c in cmds:
            print("   ", " ".join(c))
        return
    for c in cmds:
        rc, out = run_command(c, ctx.remaining(), ctx.out / "gpu_check.log")
        if rc != 0:
            raise CheckFailed(f"{' '.join(c)} failed ({'timed out' if rc is None else f'exit {rc}'}):\n"
                              f"{tail(out)}")
    ctx.record(installed=True)


def parse_junit(path: Path) -> list[dict[str, str]]:
    """pytest's junit XML -> [{"test", "status": passed/failed/error/skipped, "message"}]."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                status = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or el.text or "").strip().splitlines()[0][:300] \
                    if (el.get("message") or el.text) else ""
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        rows.append({"test": name, "status": status, "message": message})
    return rows


def kernel_tests(ctx: Context) -> None:
    xml = ctx.out / "kernel_tests.xml"
    xml.unlink(missing_ok=True)
    env = child_env(GLMFORGE_TEST_DEVICE=ctx.device)
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-rA", "-p", "no:cacheprovider",
           f"--junitxml={xml}"]
    if ctx.args.quick:
        cmd += ["-k", "triton"]                 # the compiled checks only
    rc, out = run_command(cmd, ctx.remaining() - 5, ctx.out / "gpu_check.log", env)
    if not xml.exists():
        raise CheckFailed(f"pytest wrote no report ({'timed out' if rc is None else f'exit {rc}'}):\n"
                          f"{tail(out)}")
    rows = parse_junit(xml)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("passed", "failed", "error", "skipped")}
    compiled = [r for r in rows if "triton" in r["test"]]
    ctx.record(**counts, triton_checks={r["test"].rsplit("::", 1)[-1]: r["status"] for r in compiled},
               tests=rows)
    if rc != 0 or counts["failed"] or counts["error"]:
        bad = [f"{r['test']}: {r['message']}" for r in rows if r["status"] in ("failed", "error")]
        raise CheckFailed(f"pytest exit {rc}; {len(bad)} failed:\n" + "\n".join(bad)
                          + f"\n--- output tail ---\n{tail(out, 30)}")


def attention(ctx: Context) -> None:
    lengths = ctx.args.attention_lengths or (QUICK_LENGTHS if ctx.args.quick else LENGTHS)
    extra = ["--device", ctx.device, "--repeats", "2", "--threads", str(os.cpu_count() or 1)]
    if ctx.args.quick:
        extra += ["--topk", "64"]
    elif ctx.device == "cuda":
        extra += ["--index-chunk", "2048"]     # 256-query chunks leave a GPU idle
    rows, gave_up = [], {}
    for length in lengths:
        row: dict[str, Any] = {"length": length}
        for method in ("dense", "dsa"):
            if method in gave_up:
                row[f"{method}_error"] = f"not run: {gave_up[method]}"
                continue
            cmd = [sys.executable, str(BENCH / "attention.py"), "--one", method, "--lengths",
                   str(length), *extra]
            rc, out = run_command(cmd, ctx.remaining() - 2, ctx.out / "gpu_check.log")
            if rc != 0:
                why = "timed out" if rc is None else f"exit {rc}: {tail(out, 8)}"
                row[f"{method}_error"] = why
                gave_up[method] = f"{method} failed at {length} tokens"   # longer is no better
                continue
            r = json.loads(out.strip().splitlines()[-1])
            row[f"{method}_s"] = round(r["seconds"], 4)
            row[f"{method}_mb"] = round(r["peak_extra_mb"], 1)
            if method == "dsa":
                row["indexer_s"] = round(r["indexer_s"], 4)
                row["sparse_attn_s"] = round(r["sparse_attn_s"], 4)
        if "dense_s" in row and "dsa_s" in row:
            row["speedup"] = round(row["dense_s"] / row["dsa_s"], 3)
        rows.append(row)
        ctx.record(rows=rows, device=ctx.device, repeats=2)
    errors = [f"{r['length']}: {m} {r[f'{m}_error']}" for r in rows for m in ("dense", "dsa")
              if f"{m}_error" in r]
    if errors:
        raise CheckFailed("\n".join(errors))


def _model_config(args: argparse.Namespace, **extra):
    from model.config import preset

    return preset(args.model_preset, vocab_size=256, max_position_embeddings=4096,
                  **MODEL_OVERRIDES[args.model_preset], **extra)


def _param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def speculative_decoding(ctx: Context) -> None:
    import random

    import torch

    sys.path.insert(0, str(BENCH))
    from decode import stdlib_bytes, train  # bench/decode.py

    from model.generate import generate
    from model.model import GLMModel
    from model.speculative import speculative_generate

    q = ctx.args.quick
    train_s, prompts_n, new_tokens, repeats = (3, 1, 16, 1) if q else (30, 4, 128, 2)
    torch.manual_seed(0)
    train_bytes, held_bytes = stdlib_bytes(8_000_000, 0)
    data = torch.tensor(list(train_bytes), dtype=torch.long)
    cfg = _model_config(ctx.args, dense_attention=True)
    model = GLMModel(cfg).to(ctx.device)
    ctx.record(model=f"{ctx.args.model_preset} {MODEL_OVERRIDES[ctx.args.model_preset]} vocab 256, "
               "dense attention", parameters=_param_count(model), train_seconds=train_s)
    losses = train(model, data, train_s, 128, 8, 3e-3, 0)
    ctx.record(train_steps=len(losses), final_lm_loss=round(sum(losses[-10:]) / min(10, len(losses)), 4))
    held = torch.tensor(list(held_bytes), dtype=torch.long)
    rng = random.Random(0)
    prompts = [held[s:s + 64][None].to(ctx.device)
               for s in (rng.randrange(0, len(held) - 64) for _ in range(prompts_n))]
    sync = torch.cuda.synchronize if ctx.device == "cuda" else (lambda: None)
    generate(model, prompts[0], 8, greedy=True)                 # warm-up (kernels, allocator)
    speculative_generate(model, prompts[0], 8)
    plain_t = spec_t = 0.0
    n_plain = n_spec = 0
    acc, same = [], True
    for p in prompts:
        tp, ts = [], []
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            a = generate(model, p, new_tokens, greedy=True)
            sync()
            tp.append(time.perf_counter() - t)
            t = time.perf_counter()
            b = speculative_generate(model, p, new_tokens, greedy=True, num_draft=3)
            sync()
            ts.append(time.perf_counter() - t)
        plain_t, spec_t = plain_t + min(tp), spec_t + min(ts)
        n_plain, n_spec = n_plain + a.new_tokens.shape[1], n_spec + b.new_tokens.shape[1]
        acc += b.acceptance_lengths
        same &= torch.equal(a.tokens, b.tokens)
    ctx.record(plain_tokens_per_s=round(n_plain / plain_t, 2), speculative_tokens_per_s=round(n_spec / spec_t, 2),
               speedup=round((n_spec / spec_t) / (n_plain / plain_t), 3),
               mean_acceptance_length=round(sum(acc) / max(len(acc), 1), 3), draft_tokens=3,
               prompts=prompts_n, new_tokens=new_tokens, greedy_outputs_identical=same)
    if not same:
        raise CheckFailed("greedy speculative decoding produced different tokens from plain greedy")


def _batches(steps: int, batch: int, seq_len: int, seed: int):
    import torch

    sys.path.insert(0, str(BENCH))
    from decode import stdlib_bytes  # bench/decode.py: real text, no download

    data = torch.tensor(list(stdlib_bytes(4_000_000, seed)[0]), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq_len - 1, (steps, batch), generator=g)
    return [torch.stack([data[s:s + seq_len + 1] for s in row.tolist()]) for row in starts]


def _train_run(cfg, batches, precision: str, device: str, lr: float = 1e-3, warmup: int = 10,
               ddp: bool = False) -> tuple[list[float], float | None]:
    """Train a fresh model (seed 0) on `batches`; -> (lm loss per step, tokens/s over the steps
    after the first few, which include kernel compilation and allocator warm-up)."""
    import torch

    from model.model import GLMModel

    torch.manual_seed(0)
    model = GLMModel(cfg).to(device)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        # MoE experts that get no token, and the MTP block, leave parameters without gradients
        model = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if device == "cuda"
                                        else None, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    losses, t_start, timed_tokens = [], None, 0
    warm_steps = min(5, len(batches) // 2)
    for step, x in enumerate(batches):
        if step == warm_steps:
            sync()
            t_start = time.perf_counter()
        x = x.to(device)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(x[:, :-1], labels=x[:, 1:])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(out.losses["lm"]))
        if t_start is not None:
            timed_tokens += x[:, 1:].numel()
    sync()
    tps = timed_tokens / (time.perf_counter() - t_start) if t_start is not None else None
    return losses, tps


def bf16_training(ctx: Context) -> None:
    steps, batch, seq = (6, 2, 64) if ctx.args.quick else (ctx.args.train_steps, 16, 256)
    cfg = _model_config(ctx.args)
    batches = _batches(steps, batch, seq, seed=0)
    ctx.record(steps=steps, batch=batch, seq_len=seq, model=f"{ctx.args.model_preset} "
               f"{MODEL_OVERRIDES[ctx.args.model_preset]} vocab 256, DSA layers",
               first_loss_rtol=FIRST_LOSS_RTOL, final_loss_rtol=FINAL_LOSS_RTOL)
    runs = {}
    for precision in ("fp32", "bf16"):
        losses, tps = _train_run(cfg, batches, precision, ctx.device)
        runs[precision] = losses
        ctx.record(**{f"{precision}_losses": [round(v, 4) for v in losses],
                      f"{precision}_tokens_per_s": tps and round(tps, 1)})
    f32, b16 = runs["fp32"], runs["bf16"]
    last = min(10, steps)
    first_rel = abs(b16[0] - f32[0]) / abs(f32[0])
    final32, final16 = sum(f32[-last:]) / last, sum(b16[-last:]) / last
    final_rel = abs(final16 - final32) / abs(final32)
    ctx.record(first_loss_fp32=round(f32[0], 4), first_loss_bf16=round(b16[0], 4),
               first_loss_rel_diff=round(first_rel, 5), final_loss_fp32=round(final32, 4),
               final_loss_bf16=round(final16, 4), final_loss_rel_diff=round(final_rel, 5))
    problems = []
    if not all(math.isfinite(v) for v in f32 + b16):
        problems.append("a loss is not finite")
    if first_rel > FIRST_LOSS_RTOL:
        problems.append(f"first-step loss differs by {first_rel:.2%} > {FIRST_LOSS_RTOL:.0%}")
    if final_rel > FINAL_LOSS_RTOL:
        problems.append(f"last-{last} mean loss differs by {final_rel:.2%} > {FINAL_LOSS_RTOL:.0%}")
    if not ctx.args.quick and not final16 < b16[0]:
        problems.append("bf16 loss did not go down")
    if problems:
        raise CheckFailed("; ".join(problems))


def nccl_worker(args: argparse.Namespace) -> None:
    """One torchrun rank: process group (nccl on CUDA), DDP, a few bf16 steps; rank 0 writes
    the result to args.result."""
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        steps = 3 if args.quick else 8
        batches = _batches(steps, 2 if args.quick else 8, 64 if args.quick else 256, seed=1)
        losses, tps = _train_run(_model_config(args), batches, "bf16", args.device, ddp=True)
        t = torch.tensor([losses[-1]], device=args.device)
        dist.all_reduce(t)                                      # one collective outside DDP too
        if dist.get_rank() == 0:
            write_json(Path(args.result), {"backend": dist.get_backend(), "world_size": dist.get_world_size(),
                                           "losses": [round(v, 4) for v in losses],
                                           "all_reduced_last_loss": round(float(t), 4),
                                           "tokens_per_s": tps and round(tps, 1)})
    finally:
        dist.destroy_process_group()


def nccl_launch(ctx: Context) -> None:
    result = ctx.out / "nccl_result.json"
    result.unlink(missing_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={port}", "--max_restarts=0",
           str(Path(__file__).resolve()), "--nccl-worker", "--result", str(result), "--device", ctx.device,
           "--model-preset", ctx.args.model_preset, *(["--quick"] if ctx.args.quick else [])]
    rc, out = run_command(cmd, ctx.remaining() - 2, ctx.out / "gpu_check.log")
    if rc != 0 or not result.exists():
        raise CheckFailed(f"torchrun {'timed out' if rc is None else f'exit {rc}'}:\n{tail(out)}")
    r = json.loads(result.read_text())
    result.unlink()                                             # the report holds it
    ctx.record(**r)
    want = "nccl" if ctx.device == "cuda" else "gloo"
    if r["backend"] != want or not all(math.isfinite(v) for v in r["losses"]):
        raise CheckFailed(f"backend {r['backend']} (want {want}), losses {r['losses']}")


def vllm_glm(ctx: Context) -> None:
    """GLM-5's own checkpoint on vLLM's GPU path (sparse attention, which vLLM's CPU build refuses):
    a random GLM-shaped model with the DSA indexer active (contexts longer than index_topk) served
    through rl.vllm_engine with checkpoint=glm_moe_dsa: token ids in and out, a weight update, and
    the log-probs of vLLM's tokens against our forward on the same GPU. Runs where vLLM is
    installed on the device (it is not carried: too large)."""
    import torch

    from model.config import tiny
    from model.model import GLMModel
    from rl.rollout import SamplingParams
    from rl.sample import Sample
    from rl.update import recompute_old_logprobs
    from rl.vllm_engine import VLLMEngine
    from rl.vllm_server import VLLMConfig
    from domains.task import Task

    class _Bytes:                                     # token ids are bytes: no tokenizer to train
        def decode(self, ids, skip_special_tokens=True):
            return bytes(i % 256 for i in ids).decode("latin-1")

    torch.manual_seed(0)
    cfg = tiny().replace(vocab_size=256, hidden_size=256, num_layers=3, kv_lora_rank=512, qk_rope_head_dim=64,
                         index_head_dim=64, index_topk=32, mtp_depth=0)
    model = GLMModel(cfg).to(ctx.device)
    vcfg = VLLMConfig(python=sys.executable, dtype="float32", max_model_len=512, enforce_eager=True,
                      checkpoint="glm_moe_dsa", startup_timeout_s=max(ctx.remaining() - 60, 30), env={})
    task = Task("bytes", "", "")
    prompts = [[(7 * g + i) % 256 for i in range(96)] for g in range(8)]   # 96 > index_topk: sparse
    t0 = time.perf_counter()
    with VLLMEngine(model.cpu(), _Bytes(), [], vcfg, ctx.out / "vllm_glm", on_gpu=True) as engine:
        ctx.record(startup_s=round(time.perf_counter() - t0, 1))
        model.to(ctx.device)
        samples = [Sample(task, g, p) for g, p in enumerate(prompts) for _ in range(4)]
        t = time.perf_counter()
        engine.generate(samples, SamplingParams(1.0, 1.0, 64), torch.Generator().manual_seed(0))
        tokens = sum(len(s.response_ids) for s in samples)
        ctx.record(tokens_per_s=round(tokens / (time.perf_counter() - t), 1))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        engine.sync(model.cpu(), 1)
        model.to(ctx.device)
        after = [Sample(task, g, p) for g, p in enumerate(prompts) for _ in range(4)]
        engine.generate(after, SamplingParams(1.0, 1.0, 64), torch.Generator().manual_seed(1))
    recompute_old_logprobs(model, after, 0, 1.0)
    d = [abs(a - b) for s in after for a, b in zip(s.rollout_logprobs, s.train_logprobs)]
    ctx.record(mean_abs_dlogp=round(sum(d) / len(d), 5), max_abs_dlogp=round(max(d), 4),
               versions_after_update=sorted({v for s in after for v in s.versions}))
    if {v for s in after for v in s.versions} != {1}:
        raise CheckFailed("tokens after the weight update do not all carry version 1")
    if sum(d) / len(d) > 0.02:
        raise CheckFailed(f"vLLM's log-probs differ from the trainer's by {sum(d) / len(d):.4f} on average")


def vllm_served(ctx: Context) -> None:
    """The served pool on vLLM's GPU path (rl.served_vllm, engine: vllm, checkpoint glm_moe_dsa):
    a replica started on a config-only folder loads a version the trainer published in buckets as
    2 expert-parallel ranks would (expert shards), then a delta on it, through the worker
    extension; its tokens carry the version, its log-probs match our forward on the same GPU."""
    import torch

    from domains.task import Task
    from model.config import tiny
    from model.model import GLMModel
    from rl.rollout import SamplingParams
    from rl.sample import Sample
    from rl.served import ServedEngine, ServerPoolConfig
    from rl.update import recompute_old_logprobs

    class _Bytes:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(i % 256 for i in ids).decode("latin-1")

    torch.manual_seed(0)
    cfg = tiny().replace(vocab_size=256, hidden_size=256, num_layers=3, kv_lora_rank=512, qk_rope_head_dim=64,
                         index_head_dim=64, index_topk=32, mtp_depth=0)
    model = GLMModel(cfg)
    pool = ServerPoolConfig(engine="vllm", replicas=1, startup_timeout_s=max(ctx.remaining() - 60, 30),
                            vllm={"python": sys.executable, "dtype": "float32", "max_model_len": 512,
                                  "checkpoint": "glm_moe_dsa", "env": {}})
    task = Task("bytes", "", "")
    prompts = [[(7 * g + i) % 256 for i in range(96)] for g in range(8)]
    t0 = time.perf_counter()
    with ServedEngine(model, _Bytes(), [], 0, pool, ctx.out / "vllm_served") as engine:
        ctx.record(startup_s=round(time.perf_counter() - t0, 1))
        engine.sync(model, 1)
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                if i % 2 == 0:
                    p.add_(0.01 * torch.randn_like(p))
        engine.sync(model, 2)                                  # a delta, applied in vLLM's worker
        m = engine.metrics()
        ctx.record(delta_bytes=m["sync/bytes"], full_bytes=m["sync/full_bytes"], sync_s=round(m["sync/seconds"], 2))
        samples = [Sample(task, g, p) for g, p in enumerate(prompts) for _ in range(4)]
        engine.generate(samples, SamplingParams(1.0, 1.0, 64), torch.Generator().manual_seed(0))
    model.to(ctx.device)
    recompute_old_logprobs(model, samples, 0, 1.0)
    d = [abs(a - b) for s in samples for a, b in zip(s.rollout_logprobs, s.train_logprobs)]
    ctx.record(mean_abs_dlogp=round(sum(d) / len(d), 5), max_abs_dlogp=round(max(d), 4),
               versions=sorted({v for s in samples for v in s.versions}))
    if {v for s in samples for v in s.versions} != {2} or m["sync/delta"] != 1.0:
        raise CheckFailed("the replica did not serve the delta version 2")
    if sum(d) / len(d) > 0.02:
        raise CheckFailed(f"the served replica's log-probs differ from the trainer's by {sum(d) / len(d):.4f}")


SECTIONS: list[Section] = [
    Section("environment", "Environment and installs", False, 30, ("torch",), environment),
    Section("kernel_tests", "Triton kernel tests compiled on CUDA", True, 110,
            ("torch", "triton", "pytest"), kernel_tests),
    Section("attention", "DSA vs dense attention, forward + backward", True, 150,
            ("torch", "triton"), attention),
    Section("speculative_decoding", "MTP speculative vs plain decoding", True, 75,
            ("torch", "pydantic", "numpy", "safetensors"), speculative_decoding),
    Section("bf16_training", "bf16 vs fp32 training, loss parity", True, 60,
            ("torch", "pydantic", "numpy"), bf16_training),
    Section("nccl_launch", "torchrun, 1 rank, NCCL", True, 40, ("torch", "pydantic", "numpy"),
            nccl_launch),
    # opt-in (--sections vllm_glm), where vLLM is installed on the device; never installed by --install
    Section("vllm_glm", "GLM-5 checkpoint (DSA) on vLLM: versions, weight update, parity", True, 300,
            ("torch", "vllm", "pydantic", "safetensors"), vllm_glm, default=False),
    Section("vllm_served", "vLLM as a served pool: bucketed versions, a delta, parity (GLM-5 checkpoint)", True,
            300, ("torch", "vllm", "pydantic", "safetensors", "zstandard"), vllm_served, default=False),
]


# ------------------------------------------------------------------ running and reporting

def section_by_name(name: str) -> Section:
    for s in SECTIONS:
        if s.name == name:
            return s
    raise ValueError(f"unknown section {name!r}; choose from {[s.name for s in SECTIONS]}")


def run_in_child(args: argparse.Namespace) -> None:
    """`--section NAME --result FILE`: run one section here, write status/numbers/error to FILE."""
    sec = section_by_name(args.section)
    ctx = Context(args, time.monotonic() + args.child_timeout, Path(args.result))
    ctx.record()
    try:
        sec.fn(ctx)
        write_json(ctx.result_path, {"status": "ok", "numbers": ctx.numbers})
    except BaseException as e:  # noqa: BLE001 - every failure goes into the report
        err = str(e) if isinstance(e, CheckFailed) else traceback.format_exc()
        write_json(ctx.result_path, {"status": "failed", "numbers": ctx.numbers, "error": err})
        raise SystemExit(1)


def run_section(sec: Section, args: argparse.Namespace, cuda: bool, timeout: float,
                in_process: bool = False) -> dict[str, Any]:
    """Run one section (in a child process unless in_process) -> its report entry."""
    res: dict[str, Any] = {"name": sec.name, "title": sec.title, "status": "skipped", "reason": "",
                           "seconds": 0.0, "timeout_s": round(timeout, 1), "numbers": {}, "error": "",
                           "preconditions": {"needs_cuda": sec.needs_cuda, "cuda_available": cuda,
                                             "modules": list(sec.modules),
                                             "missing_modules": missing_modules(sec.modules)}}
    missing = res["preconditions"]["missing_modules"]
    if sec.needs_cuda and args.device == "cuda" and not cuda:
        res["reason"] = "no CUDA device"
    elif args.dry_run and sec.needs_cuda:
        res["reason"] = "dry run"
    elif missing and not (sec.name == "environment"):
        res["reason"] = f"missing Python modules: {', '.join(missing)} (see the install commands)"
    elif timeout < 5:
        res["reason"] = "no time left in the --budget"
    else:
        t0 = time.monotonic()
        if in_process:
            ctx = Context(args, t0 + timeout)
            try:
                sec.fn(ctx)
                res["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - recorded, the next section still runs
                res["status"] = "failed"
                res["error"] = str(e) if isinstance(e, CheckFailed) else traceback.format_exc()
            res["numbers"] = ctx.numbers
        else:
            res.update(_run_child_section(sec, args, timeout))
        res["seconds"] = round(time.monotonic() - t0, 2)
    return res


def _run_child_section(sec: Section, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    out = Path(args.out)
    result = out / f".{sec.name}.result.json"
    result.unlink(missing_ok=True)
    # the child's own deadline is a little earlier, so its sub-steps end before it is killed
    cmd = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--out", str(out),
           "--section", sec.name, "--result", str(result), "--child-timeout", str(max(timeout - 5, 1))]
    rc, text = run_command(cmd, timeout, out / "gpu_check.log")
    got = json.loads(result.read_text()) if result.exists() else {}
    result.unlink(missing_ok=True)
    res = {"numbers": got.get("numbers", {}), "status": got.get("status", "failed"),
           "error": got.get("error", "")}
    if rc is None:
        res.update(status="failed", error=f"timed out after {timeout:.0f} s; output tail:\n{tail(text, 20)}")
    elif res["status"] == "failed" and not res["error"]:
        res["error"] = f"exit {rc}; output tail:\n{tail(text, 30)}"
    return res


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - a copied tree may have no git
        return ""


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def summary(res: dict[str, Any]) -> str:
    """One line for the overview table: the reason, or the section's scalar numbers."""
    if res["status"] == "skipped":
        return res["reason"]
    nums = {k: v for k, v in res["numbers"].items()
            if isinstance(v, (int, float, bool)) or k in ("gpu", "torch")}
    if res["name"] == "attention":                                # the longest length measured
        rows = [r for r in res["numbers"].get("rows", []) if "speedup" in r]
        if rows:
            r = rows[-1]
            nums = {"length": r["length"], "dense_s": r["dense_s"], "dsa_s": r["dsa_s"],
                    "speedup": r["speedup"]}
    text = ", ".join(f"{k} {_cell(v)}" for k, v in list(nums.items())[:6])
    if res["status"] == "failed":
        first = (res["error"].strip().splitlines() or [""])[-1 if "Traceback" in res["error"] else 0]
        text = f"{first[:200]}" + (f"; {text}" if text else "")
    return text


def markdown(report: dict[str, Any]) -> str:
    lines = ["# GPU check report", "",
             f"- created: {report['created']}", f"- commit: {report['commit'] or 'unknown'}",
             f"- host: {report['host']}", f"- cuda: {report['cuda']}", f"- dry run: {report['dry_run']}",
             f"- command: `{report['command']}`", "",
             "| section | status | seconds | summary |", "| --- | --- | --- | --- |"]
    for r in report["sections"]:
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.1f} | {_cell(summary(r))} |")
    for r in report["sections"]:
        pre = r["preconditions"]
        lines += ["", f"## {r['name']}: {r['title']}", "", f"status: **{r['status']}**"
                  + (f" ({r['reason']})" if r["reason"] else "")
                  + f", {r['seconds']:.1f} s of {r['timeout_s']:.0f} s; needs CUDA: "
                  f"{'yes' if pre['needs_cuda'] else 'no'}, missing modules: "
                  f"{', '.join(pre['missing_modules']) or 'none'}", ""]
        for k, v in r["numbers"].items():
            if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                cols = list(dict.fromkeys(c for x in v for c in x))
                lines += ["", f"{k}:", "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
                lines += ["| " + " | ".join(_cell(x.get(c, "")) for c in cols) + " |" for x in v]
                lines.append("")
            else:
                lines.append(f"- {k}: {_cell(v) if not isinstance(v, (list, dict)) else json.dumps(v)}")
        if r["error"]:
            lines += ["", "error:", "", "```", r["error"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def write_reports(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "report.json", report)
    (out / "report.md").write_text(markdown(report))


def run_all(args: argparse.Namespace, in_process: bool = False) -> dict[str, Any]:
    """Every selected section in order, the reports rewritten after each -> the report."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"schema": SCHEMA, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "commit": git_commit(), "host": platform.node(), "dry_run": args.dry_run,
        "device": args.device, "cuda": False, "command": " ".join(["bench/gpu_check.py", *args.argv]),
        "sections": []}
    start = time.monotonic()
    selected = [s for s in SECTIONS if s.name in args.sections] if args.sections else \
        [s for s in SECTIONS if s.default]
    # the environment section finds out (after any install); without it, ask a fresh process
    cuda = False if any(s.name == "environment" for s in selected) else cuda_available()
    report["cuda"] = cuda
    for sec in selected:
        left = args.budget - (time.monotonic() - start)
        timeout = min(args.timeouts.get(sec.name, sec.timeout_s), left)
        res = run_section(sec, args, cuda, timeout, in_process)
        if sec.name == "environment":
            cuda = bool(res["numbers"].get("cuda_available"))
            report["cuda"] = cuda
            if res["status"] != "ok" and not in_process:
                cuda = cuda_available()                          # the section failed: ask again
                report["cuda"] = cuda
        report["sections"].append(res)
        write_reports(out, report)
        print(f"[gpu_check] {sec.name}: {res['status']} ({res['seconds']:.1f} s) {summary(res)[:160]}",
              flush=True)
    write_reports(out, report)
    return report


def cuda_available() -> bool:
    rc, out = run_command([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"], 60)
    return rc == 0 and out.strip().splitlines()[-1:] == ["True"]


def fetch_wheels(folder: str) -> None:
    """Here (with network): wheels for the GPU machine's Python 3.12 of what its image lacks."""
    specs = [requirement_spec(d) for d in ("pydantic",)]
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
           "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d", folder, *specs]
    print(" ".join(cmd), flush=True)
    raise SystemExit(subprocess.call(cmd))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out",
                   help="folder for report.json, report.md and logs (default $OUT, else ./gpu_check_out)")
    p.add_argument("--dry-run", action="store_true",
                   help="check preconditions and write the reports; run nothing on a GPU")
    p.add_argument("--install", action="store_true",
                   help="run the install commands the environment section prints")
    p.add_argument("--wheels", default=None, help="install missing packages from wheels in this folder")
    p.add_argument("--fetch-wheels", metavar="DIR", default=None,
                   help="download the wheels the GPU machine lacks into DIR (needs network), then exit")
    p.add_argument("--sections", nargs="+", choices=[s.name for s in SECTIONS], default=None,
                   help="run only these sections (default: all)")
    p.add_argument("--timeout", action="append", default=[], metavar="NAME=SECONDS",
                   help="a section's timeout (repeatable)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for all sections together (default {BUDGET_S}; with --install "
                   f"{INSTALL_TIMEOUT_S - 30} more, for the downloads)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu runs the GPU sections on CPU (with --quick: a try of this script)")
    p.add_argument("--quick", action="store_true", help="toy sizes everywhere")
    p.add_argument("--model-preset", choices=sorted(MODEL_OVERRIDES), default="tiny",
                   help="decoding / training model (tiny is widened, see MODEL_OVERRIDES)")
    p.add_argument("--train-steps", type=int, default=50, help="bf16 vs fp32 steps")
    p.add_argument("--attention-lengths", type=int, nargs="+", default=None,
                   help=f"default {LENGTHS} ({QUICK_LENGTHS} with --quick)")
    # internal: one section in a child process, or one torchrun rank
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-timeout", type=float, default=600, help=argparse.SUPPRESS)
    p.add_argument("--nccl-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.timeouts = {}
    names = [s.name for s in SECTIONS]
    for item in args.timeout:
        name, _, value = item.partition("=")
        if name not in names:
            p.error(f"--timeout {item!r}: unknown section {name!r}; choose from {names}")
        try:
            args.timeouts[name] = float(value)
        except ValueError:
            p.error(f"--timeout {item!r}: SECONDS must be a number, got {value!r}")
    if args.install and "environment" not in args.timeouts:
        args.timeouts["environment"] = INSTALL_TIMEOUT_S           # a CUDA torch is GBs to fetch
    if args.budget is None:
        args.budget = BUDGET_S + (INSTALL_TIMEOUT_S - 30 if args.install else 0)
    if args.budget <= 0:
        p.error(f"--budget must be positive, got {args.budget}")
    # what a section's child process is started with (the parent's own choices, minus --out)
    args.argv = _strip(argv, {"--out": 1, "--section": 1, "--result": 1, "--child-timeout": 1})
    return args


def _strip(argv: list[str], options: dict[str, int]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        key = a.split("=", 1)[0]
        if key in options:
            i += 1 + (0 if "=" in a else options[key])
            continue
        out.append(a)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    if args.fetch_wheels:
        fetch_wheels(args.fetch_wheels)
    if args.wheels and not args.section and not args.nccl_worker:
        _install_wheels(args)
    if args.nccl_worker:
        nccl_worker(args)
        return 0
    if args.section:
        run_in_child(args)
        return 0
    report = run_all(args)
    print(f"[gpu_check] reports: {Path(args.out) / 'report.md'}, {Path(args.out) / 'report.json'}")
    return int(any(s["status"] == "failed" for s in report["sections"]))


def _install_wheels(args: argparse.Namespace) -> None:
    """--wheels DIR: the missing packages from DIR into a folder on PYTHONPATH (the GPU image's
    Python may be read-only or shared), before any section starts."""
    missing = missing_modules(m for s in SECTIONS for m in s.modules if m not in ("torch", "vllm"))
    if not missing:
        return
    target = Path(tempfile.gettempdir()) / "glmforge_gpu_check_site"   # not under $OUT: it comes back
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-compile", "--find-links",
           args.wheels, "--target", str(target), *[requirement_spec(DISTRIBUTIONS.get(m, m)) for m in missing]]
    print(" ".join(cmd), flush=True)
    if subprocess.call(cmd) == 0:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(target), *filter(None, [os.environ.get("PYTHONPATH")])])
        sys.path.insert(0, str(target))
        importlib.invalidate_caches()


if __name__ == "__main__":
    raise SystemExit(main())
