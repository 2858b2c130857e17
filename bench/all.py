"""Run every benchmark under bench/ and write their figures to bench/RESULTS.md (issue 19).

One command refreshes every figure from one run, each table row with the date, the machine and
the settings it was measured with:

    .venv/bin/python bench/all.py                  # every bench, standard settings (hours on 2 cores)
    .venv/bin/python bench/all.py --quick          # every bench, small sizes (minutes; smoke figures)
    .venv/bin/python bench/all.py --only s3_upload --only train
    .venv/bin/python bench/all.py --list           # what would run, with which arguments
    make bench [BENCH_ARGS="--quick"]

Each bench runs as its own process (`python bench/NAME.py ARGS`, from the repository root) and is
only ever called, never imported: the benches stay free to change. Its whole output goes to
--logs/NAME.log; a small parser per bench picks the summary figures out of it (a bench whose
output it cannot parse gets its last output line instead, so a changed bench never breaks the
table). Rows of benches not run this time are kept as they were, each with its own date.
A bench that fails or times out gets a row saying so: a stale figure is never left looking new.

Every bench/*.py must be registered below, as a bench (BENCHES) or as not one (NOT_BENCHES,
with the reason); --list names any that is neither.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
RESULTS = BENCH / "RESULTS.md"


# ---------------------------------------------------------------- parsing bench output


def last_json(out: str):
    """The last JSON document in the output: a line starting with { or [, alone (log lines may
    follow it: a Prefect server stopping) or through the end (an indented document)."""
    lines = out.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i][:1] in "{[":
            for text in (lines[i], "\n".join(lines[i:])):
                try:
                    return json.loads(text)
                except ValueError:
                    continue
    raise ValueError("no JSON document in the output")


def last_line(out: str) -> str:
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def _stamp(line: str) -> tuple[str, str]:
    """Split 'figures  [date; machine; settings]' (the benches that stamp their own lines)."""
    m = re.match(r"(.*?)\s*\[([^\[\]]*)\]\s*$", line)
    return (m.group(1), m.group(2)) if m else (line, "")


def s3_upload(out: str) -> tuple[str, str]:
    line = next(ln for ln in out.splitlines() if ln.startswith("s3_upload summary:"))
    measured, stamp = _stamp(line[len("s3_upload summary:"):].strip())
    parts = [p.strip() for p in stamp.split(";")]
    return measured, "; ".join(parts[2:])  # date and machine have their own columns


def curation(out: str) -> tuple[str, str]:
    rows = {}
    for ln in out.splitlines():
        m = re.match(r"(glmforge MinHash pipeline \(sig \+ LSH\)|glmforge quality scoring \(fastText\)|"
                     r"datatrove MinHash pipeline \(4 stages\))\s+([\d,]+)\s+(\S+)\s+\[", ln)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    if not rows:
        raise ValueError("no result rows")
    parts = [f"{name.split(' (')[0]} {rate} docs/s/core" + (f" (recall {rec})" if rec != "-" else "")
             for name, (rate, rec) in rows.items()]
    # the end-to-end ratios (the same JSONL in, kept documents out, the same process count) first,
    # the in-memory one beside them
    for ln in out.splitlines():
        m = re.match(r"minhash end-to-end \(JSONL in -> kept JSONL out\), 1 process: .*ratio ([\d.]+x)", ln)
        if m:
            parts.append(f"end to end {m.group(1)} datatrove per core (1 process each)")
        m = re.match(r"minhash end-to-end \(JSONL in -> kept JSONL out\), all (\d+) cores .*wall .*?ratio ([\d.]+x)", ln)
        if m:
            parts.append(f"{m.group(2)} in wall time on {m.group(1)} cores")
    speed = next((ln for ln in out.splitlines() if ln.startswith("speed-up over datatrove")), "")
    m = re.search(r"in memory[^\d]*([\d.]+x)", speed)
    if m:
        parts.append(f"in memory {m.group(1)}")
    corpus = next((ln for ln in out.splitlines() if ln.startswith("corpus:")), "")
    return "; ".join(parts), corpus.split(";")[0].replace("corpus: ", "")


def train(out: str) -> tuple[str, str]:
    r = last_json(out)
    over = ", ".join(f"{k} {v:+.1%}" for k, v in r["deepspeed_overhead"].items())
    mfu = max(s["mfu"] for s in r["setups"].values())
    return (f"DeepSpeed overhead {over}; MFU up to {mfu:.1%} of a measured {r['matmul_peak_gflops']:.1f} GFLOP/s "
            f"fp32 matmul peak", f"batch {r['batch']} x seq {r['seq_len']}, {r['threads']} thread(s)")


def mfu_ceiling(out: str) -> tuple[str, str]:
    r = last_json(out)
    rows = "; ".join(f"{m['model']} (width {m['hidden_size']}) {m['mfu']:.0%} of {m['ceiling_mfu']:.0%}" for m in r["rows"])
    return (f"plain PyTorch step MFU of the ceiling its own matmuls reach: {rows}",
            f"{r['tokens_per_step']} tokens/step, {r['threads']} thread(s), peak {r['matmul_peak_gflops']:.0f} GFLOP/s")


def _ratio_table(out: str, labels: list[str]) -> list[str]:
    """Rows of a table whose first column is a sequence length: the columns ending in 'x'."""
    rows = []
    for ln in out.splitlines():
        tok = ln.split()
        if tok and tok[0].isdigit() and len(tok) > 3:
            ratios = [t for t in tok if re.fullmatch(r"-?[\d.]+x", t)]
            rows.append(f"{int(tok[0]) // 1024}K " + " ".join(f"{lab} {r}" for lab, r in zip(labels, ratios)))
    if not rows:
        raise ValueError("no table rows")
    return rows


def _first_line_settings(out: str, starts: tuple[str, ...]) -> str:
    return next((ln.split(";")[0] for ln in out.splitlines() if ln.startswith(starts)), "")


def attention(out: str) -> tuple[str, str]:
    rows = _ratio_table(out, ["DSA speed-up", "mem"])
    return "; ".join(rows), _first_line_settings(out, ("dense MHA", "MHA "))


def long_context(out: str) -> tuple[str, str]:
    rows = _ratio_table(out, ["fwd", "train", "mem"])
    return "DSA vs dense: " + "; ".join(rows), _first_line_settings(out, ("GLMModel",))


def decode(out: str) -> tuple[str, str]:
    r = last_json(out)
    kinds = "; ".join(f"{k} {v['speedup']:.2f}x, acceptance {v['mean_acceptance_length']:.2f}, "
                      f"whitespace {v['whitespace_fraction_of_output']:.0%}" for k, v in r["per_kind"].items())
    return (f"speculative vs plain greedy: {kinds}; outputs identical: {r['greedy_outputs_identical']}",
            f"{r['model_preset']} ({r['params']:,} params), trained {r['train_seconds']:g} s, "
            f"{r['prompts_per_kind']} prompts per kind x {r['new_tokens']} tokens")


def rl_reasoning(out: str) -> tuple[str, str]:
    r = last_json(out)
    sp = r["split"]
    return (f"{r['rollout_tokens_per_s']:,.0f} generated tokens/s, trainer {r['trainer_tokens_per_s']:,.0f} tokens/s; "
            f"{r['step_s']:.2f} s per RL step: generation {sp['generate']:.0%}, reward {sp['reward']:.0%}, "
            f"training {sp['train']:.0%}", ", ".join(f"{k} {v}" for k, v in r["settings"].items()))


def rl_async(out: str) -> tuple[str, str]:
    r = last_json(out)
    return (f"async {r['speedup']:.2f}x faster than sync ({r['async_s']:.1f} vs {r['sync_s']:.1f} s); overlapping "
            f"generate {r['generate_s']:.1f} s and train {r['train_s']:.1f} s alone bounds it at "
            f"{r['overlap_bound']:.2f}x ({r['of_overlap_bound']:.2f} of it); trainer idle "
            f"{r['trainer_idle_fraction']:.0%} of the async run",
            ", ".join(f"{k} {v}" for k, v in r["settings"].items()))


def rl_prefix(out: str) -> tuple[str, str]:
    r = last_json(out)
    rows = "; ".join(
        f"{x['model']} prompt {x['prompt']}: trainer {x['trainer_s']:.2f} -> {x['trainer_shared_s']:.2f} s = "
        f"{x['trainer_speedup']:.2f}x (FLOPs {x['flops_ratio']:.2f}x fewer), rollouts {x['rollout_speedup']:.2f}x, "
        f"agent turns {x['agent_speedup']:.2f}x" for x in r["rows"])
    return (f"a group's prompt once vs once per sample: {rows}", ", ".join(f"{k} {v}" for k, v in r["settings"].items()))


def launch(out: str) -> tuple[str, str]:
    r = last_json(out)
    return (f"{r['nproc']} ranks (gloo init + one all-reduce): torchrun {r['wall_s']['torchrun']:.2f} s wall / "
            f"{r['cpu_s']['torchrun']:.2f} s CPU, training.spawn {r['wall_s']['spawn']:.2f} / {r['cpu_s']['spawn']:.2f}: "
            f"torchrun / spawn {r['wall_ratio_torchrun_over_spawn']:.2f}x wall, {r['cpu_ratio_torchrun_over_spawn']:.2f}x CPU",
            f"median of {r['repeats']}, OMP_NUM_THREADS=1")


def rl_ranks(out: str) -> tuple[str, str]:
    r = last_json(out)
    u, rr = r["update"], r["routing_replay"]
    sync = "; ".join(f"{w['preset']} {w['by_ranks']['2']['bytes'] / 2**20:.0f} MiB by 2 ranks: publish "
                     f"{w['by_ranks']['2']['publish_s_slowest_rank']:.2f} s, load + verify {w['by_ranks']['2']['load_s']:.2f} s"
                     for w in r["weight_sync"])
    return (f"RL update 1 rank {u['one_rank_s']:.2f} s vs 2 ranks {u['two_ranks_s']:.2f} s = {u['ratio']:.2f}x "
            f"({u['ratio_1_thread']:.2f}x vs 1 thread); weight sync {sync}; INT4 mismatch |d log p| "
            f"{rr['without_replay']['mismatch/abs_logp']:.3f} -> {rr['with_replay']['mismatch/abs_logp']:.3f} with "
            f"routing replay (K3 {rr['without_replay']['mismatch/k3']:.4f} -> {rr['with_replay']['mismatch/k3']:.4f})",
            ", ".join(f"{k} {v}" for k, v in r["settings"].items()))


def weight_sync_delta(out: str) -> tuple[str, str]:
    r = last_json(out)
    rows = "; ".join(f"{w['preset']} {w['dtype']} lr {w['lr']:.0e}: {w['whole_bytes'] / 2**20:.2f} -> "
                     f"{w['delta_bytes'] / 2**20:.2f} MiB = {w['ratio']:.1f}x" for w in r["rows"])
    return (f"bytes per policy version, whole -> delta (XOR + zstd): {rows}",
            ", ".join(f"{k} {v}" for k, v in r["settings"].items()))


def swe_envs(out: str) -> tuple[str, str]:
    r = last_json(out)
    return (f"suite of 455 tests: plain {r['plain_s']:.2f} s, sandboxed {r['sandboxed_s']:.2f} s = "
            f"{r['overhead_ratio']:.2f}x; {r['instances']} validated instances from {r['mutants_tried']} mutants in "
            f"{r['build_s']:.0f} s = {r['instances_per_cpu_minute']:.1f} per CPU-minute",
            ", ".join(f"{k} {v}" for k, v in r["settings"].items()))


def vllm_rollout(out: str) -> tuple[str, str]:
    r = last_json(out)
    n, v = r["native"], r["vllm"]
    return (f"rollouts {v['tokens_per_s']:.0f} tok/s on vLLM vs {n['tokens_per_s']:.0f} native = "
            f"{r['ratio_vllm_over_native']:.2f}x; vLLM start-up {v['startup_s']:.0f} s, weight update "
            f"{v['weight_update_s']:.2f} s; |d log p| vs the trainer mean/max vLLM {v['mean_abs_dlogp']:.1e}/"
            f"{v['max_abs_dlogp']:.1e}, native {n['mean_abs_dlogp']:.1e}/{n['max_abs_dlogp']:.1e}",
            ", ".join(f"{k} {v}" for k, v in r["settings"].items()))


def curation_dask(out: str) -> tuple[str, str]:
    rows = last_json(out)

    def who(r: dict) -> str:
        per = r.get("shards_per_task", "-")
        return f"{r['engine']} x{r['workers']}" + (f", {per} shards/task" if per not in ("-", None) else "")

    return "; ".join(f"{who(r)}: exact {r['exact_docs_s']:.0f}, MinHash {r['minhash_docs_s']:.0f} docs/s"
                     f"{'' if r['same_output'] else ' (OUTPUT DIFFERS)'}" for r in rows), ""


def moe_ep(out: str) -> tuple[str, str]:
    rows = last_json(out)
    settings = next((ln.strip() for ln in out.splitlines() if ln.startswith("2 ranks")), "")
    return "; ".join(f"{r['mode']} {r['median_s'] * 1e3:.0f} ms/step, {r['expert_params_per_rank']:,} expert "
                     "params/rank" for r in rows), settings


def cached_rerun(out: str) -> tuple[str, str]:
    meds = re.findall(r"^(.*?)\s+median\s+([\d.]+) s", out, re.M)
    speed = next(ln for ln in out.splitlines() if ln.startswith("speed-up"))
    return "; ".join(f"{n.strip()} {s} s" for n, s in meds) + f"; {speed.split('(')[0].strip()}", \
        speed[speed.find("(") + 1: speed.rfind(")")]


def sandbox(out: str) -> tuple[str, str]:
    r = last_json(out)
    rows = "; ".join(f"{name} {v['sandbox']['median_ms']:.0f} ms (p95 {v['sandbox']['p95_ms']:.0f}) vs plain "
                     f"{v['baseline']['median_ms']:.0f} ms = {v['ratio']:.2f}x ({v['ratio_same_python']:.2f}x the "
                     f"sandbox's own python unisolated)" for name, v in r["rows"].items())
    iso = r["isolation"]
    return f"{iso['tool']} {iso['bwrap_version']}: {rows}", f"{r['runs']} runs per side"


def tail(n: int) -> Callable[[str], tuple[str, str]]:
    def parse(out: str) -> tuple[str, str]:
        lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
        return " / ".join(lines[-n:]), ""
    return parse


# ---------------------------------------------------------------- the registry


@dataclasses.dataclass
class Bench:
    name: str               # bench/{name}.py
    quick: list[str]        # arguments of the quick mode
    standard: list[str]     # arguments of the standard mode (what the README figures use)
    parse: Callable[[str], tuple[str, str]]  # output -> (measured, settings the bench reports)
    what: str
    default: bool = True    # run without --only
    needs: Callable[[argparse.Namespace], str | None] = lambda a: None  # why it cannot run now, or None
    extra: Callable[[argparse.Namespace], list[str]] = lambda a: []     # arguments from all.py's own options


BENCHES = [
    Bench("s3_upload", ["--quick"], [], s3_upload,
          "checkpoint upload to SeaweedFS: the store (publish, checkpoint mirror) vs raw boto3 upload_file"),
    Bench("curation", ["--max-docs", "3000", "--planted", "200"], [], curation,
          "quality scoring and MinHash dedup docs/s per core, beside datatrove's MinHash",
          extra=lambda a: ["--datatrove-python", a.datatrove_python] if a.datatrove_python else []),
    Bench("train", ["--steps", "5", "--warmup", "1", "--rounds", "1"], [], train,
          "DeepSpeed training step vs a plain PyTorch loop, MFU"),
    Bench("mfu_ceiling", ["--widths", "128", "--steps", "2", "--repeats", "2", "--json"], ["--json"], mfu_ceiling,
          "training-step MFU vs the ceiling of the step's own matmuls, tiny / small / small widened"),
    Bench("attention", ["--lengths", "1024", "2048"], ["--lengths", "2048", "8192", "16384", "32768"], attention,
          "DSA vs dense attention forward + backward, GLM-5 widths / 4"),
    Bench("long_context", ["--lengths", "512", "1024"], [], long_context,
          "tiny GLMModel forward + backward, DSA (top-k 64) vs dense"),
    Bench("decode", ["--train-seconds", "10", "--prompts", "2", "--new-tokens", "32", "--repeats", "1", "--json"],
          ["--json"], decode, "MTP speculative vs plain greedy decoding"),
    Bench("rl_reasoning", ["--prompts", "4", "--group", "4", "--steps", "2", "--json"], ["--json"], rl_reasoning,
          "RL rollout and trainer tokens/s, one RL step split"),
    Bench("rl_async", ["--steps", "2", "--json"], ["--json"], rl_async,
          "agentic RL, asynchronous vs synchronous, same trained samples"),
    Bench("rl_prefix", ["--prompt", "24", "200", "--prompts", "2", "--group", "4", "--repeats", "1", "--json"],
          ["--model", "tiny", "small", "--prompt", "24", "600", "--json"],
          rl_prefix, "RL with a group's prompt computed once vs once per sample: trainer update and rollouts"),
    Bench("rl_ranks", ["--samples", "16", "--repeats", "1", "--sync-presets", "tiny", "--json"], ["--json"], rl_ranks,
          "RL update on 1 vs 2 gloo ranks, bucketed weight sync (tiny, small), INT4 mismatch with/without routing replay"),
    Bench("weight_sync_delta", ["--presets", "tiny", "--steps", "2", "--json"], ["--json"], weight_sync_delta,
          "RL weight sync: bytes per version whole vs delta, tiny and small, fp32 and bf16"),
    Bench("swe_envs", ["--repeats", "2", "--instances", "4", "--json"], ["--json"], swe_envs,
          "environments from a real repository: sandboxed vs plain test run, instances per CPU-minute"),
    Bench("vllm_rollout", ["--prompts", "4", "--group", "4", "--new-tokens", "8", "--repeats", "1", "--json"],
          ["--json"], vllm_rollout, "rollouts on vLLM vs the native engine, same model and tokens (make vllm-setup)"),
    Bench("curation_dask", ["--max-docs", "500", "--planted", "50"], [], curation_dask,
          "exact + MinHash dedup on Dask (1, 2 workers; 1, 5 shards per task) beside one process"),
    Bench("launch", ["--repeats", "1", "--json"], ["--json"], launch,
          "one node's ranks started by torchrun vs training.spawn, same job"),
    Bench("moe_ep", ["--tokens", "256", "--steps", "3", "--warmup", "1"], [], moe_ep,
          "MoE step, expert parallel vs replicated, 2 gloo ranks"),
    Bench("cached_rerun", ["--repeat", "1"], [], cached_rerun,
          "fully cached `glmforge run`: shortcut vs through the Prefect flow",
          needs=lambda a: None if a.cached_home else "needs a GLMFORGE_HOME whose store holds the published "
          "pipeline: --cached-home DIR (run the pipeline there once first)",
          extra=lambda a: ["--home", a.cached_home, "--until", a.cached_until] if a.cached_home else []),
    Bench("sandbox", ["--quick", "--json"], ["--json"], sandbox,
          "the sandbox's cost per call (print(1), an MBPP test run) beside the same programs unisolated"),
    Bench("effects_long_context", ["--smoke"], [], tail(3), "effect study: full vs DSA vs SWA on MQAR (~1 h)",
          default=False),
    Bench("effects_qat", ["--smoke"], [], tail(3), "effect study: INT4 QAT vs PTQ (~1 h)", default=False),
    Bench("effects_needle_check", ["--smoke"], [], tail(6), "sanity checks of the needle tasks", default=False),
]

NOT_BENCHES = {
    "all": "this script",
    "memory": "helper module (RSS readings), imported by the benches",
    "effects_common": "helper module of the effects benches",
    "machine": "helper module: the machine line every bench prints",
    "gpu_check": "the CUDA check; writes its own report: python3 bench/gpu_check.py --out DIR",
    "prefect_db_load": "a load test of the Prefect server's database, SQLite beside PostgreSQL (minutes; its table "
                       "is in the README): python3 bench/prefect_db_load.py",
    "swe_forgery": "rates, not speed: what forging a test run pays in the swe environment and what catches it "
                   "(docs/guides/swe-envs.md): python3 bench/swe_forgery.py",
}


def unregistered() -> list[str]:
    known = {b.name for b in BENCHES} | set(NOT_BENCHES)
    return sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in known and not p.stem.startswith("_"))


# ---------------------------------------------------------------- machine, table


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().split("\n"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError):
        mem = ""
    gpu = ""
    if shutil.which("nvidia-smi"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=20).stdout.split("\n")
            names = [n.strip() for n in names if n.strip()]
            gpu = f", {len(names)} x {names[0]}" if names else ""
        except (OSError, subprocess.SubprocessError):
            pass
    return (f"{platform.node()}: {os.cpu_count()} cpus {cpu}{mem}{gpu}, {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}")


HEADER = """# Benchmark results

Written by `bench/all.py` (`make bench`); do not edit by hand. Each row is the latest run of that
bench: when, where and with which settings it was measured. Rerun one with
`.venv/bin/python bench/all.py --only NAME`; `--quick` rows are smoke-sized, not the README's
standard figures. What each bench measures and its target: docs/results/benchmarks.md.

| bench | measured | date | machine | settings |
|---|---|---|---|---|
"""


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|") or "—"


def read_rows(path: Path) -> dict[str, str]:
    rows = {}
    if path.is_file():
        for ln in path.read_text().splitlines():
            m = re.match(r"\| `([\w.-]+)` \|", ln)
            if m:
                rows[m.group(1)] = ln
    return rows


def write_rows(path: Path, rows: dict[str, str]) -> None:
    order = [b.name for b in BENCHES]
    names = sorted(rows, key=lambda n: (order.index(n) if n in order else len(order), n))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(HEADER + "".join(rows[n] + "\n" for n in names))
    os.replace(tmp, path)


# ---------------------------------------------------------------- running


def command(b: Bench, args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(BENCH / f"{b.name}.py"), *(b.quick if args.quick else b.standard), *b.extra(args)]


def run_one(b: Bench, args: argparse.Namespace, logs: Path, mach: str) -> tuple[str, bool]:
    cmd = command(b, args)
    shown = " ".join(["bench/" + b.name + ".py", *cmd[2:]])
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    log = logs / f"{b.name}.log"
    print(f"[bench/all] {b.name}: {shown}  (output: {log})", flush=True)
    t0 = time.monotonic()
    try:
        with open(log, "w") as f:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout,
                                start_new_session=True).returncode
    except subprocess.TimeoutExpired:
        rc = None
    wall = time.monotonic() - t0
    out = log.read_text(errors="replace")
    date = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%MZ}"
    mode = "quick" if args.quick else "standard"
    ok = rc == 0
    if rc is None:
        measured, own = f"**timed out** after {args.timeout:g} s: {last_line(out)}", ""
    elif rc != 0:
        measured, own = f"**failed** (exit {rc}): {last_line(out)}", ""
    else:
        try:
            measured, own = b.parse(out)
        except Exception as e:  # a bench changed its output: keep its own last line
            measured, own = last_line(out), f"(summary not parsed: {type(e).__name__})"
    settings = f"{mode}: `{shown}`" + (f"; {own}" if own else "") + f"; {wall:.0f} s"
    print(f"[bench/all] {b.name}: {'ok' if ok else 'FAILED'} in {wall:.0f} s: {measured}", flush=True)
    return f"| `{b.name}` | {cell(measured)} | {date} | {cell(mach)} | {cell(settings)} |", ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", metavar="NAME", help="run this bench (repeatable); default: all")
    ap.add_argument("--list", action="store_true", help="list the benches and their arguments, run nothing")
    ap.add_argument("--quick", action="store_true", help="small sizes: minutes, smoke figures")
    ap.add_argument("--out", type=Path, default=RESULTS, help=f"the results table (default {RESULTS.relative_to(REPO)})")
    ap.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "glmforge-bench",
                    help="folder for each bench's full output")
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per bench")
    ap.add_argument("--datatrove-python", default=os.environ.get("DATATROVE_PYTHON"),
                    help="curation: interpreter of datatrove's venv (bench/curation.py); default $DATATROVE_PYTHON")
    ap.add_argument("--cached-home", default=None, help="cached_rerun: a GLMFORGE_HOME with the pipeline published")
    ap.add_argument("--cached-until", default="sft", help="cached_rerun: last stage (default sft)")
    args = ap.parse_args()

    by_name = {b.name: b for b in BENCHES}
    for name in args.only or []:
        if name not in by_name:
            ap.error(f"unknown bench {name!r}; known: {', '.join(by_name)}")
    chosen = [by_name[n] for n in args.only] if args.only else [b for b in BENCHES if b.default]
    stray = unregistered()

    if args.list:
        for b in BENCHES:
            why = b.needs(args)
            state = "runs" if b in chosen and not why else ("skipped: " + why if why else "only with --only")
            print(f"{b.name:<22} {b.what}\n{'':<22} quick:    {' '.join(b.quick) or '(defaults)'}\n"
                  f"{'':<22} standard: {' '.join(b.standard) or '(defaults)'}\n{'':<22} {state}")
        for name, why in NOT_BENCHES.items():
            print(f"{name:<22} not a bench: {why}")
        for name in stray:
            print(f"{name:<22} NOT REGISTERED in bench/all.py: add it to BENCHES or NOT_BENCHES")
        return

    if stray:
        print(f"[bench/all] warning: not registered in bench/all.py, not run: {', '.join(stray)}", file=sys.stderr)
    args.logs.mkdir(parents=True, exist_ok=True)
    mach = machine()
    rows = read_rows(args.out)
    ran, failed, skipped = [], [], []
    for b in chosen:
        why = b.needs(args)
        if why:
            print(f"[bench/all] {b.name}: skipped, {why}", flush=True)
            skipped.append(b.name)
            continue
        rows[b.name], ok = run_one(b, args, args.logs, mach)
        write_rows(args.out, rows)  # after every bench: a long run interrupted keeps what it measured
        ran.append(b.name)
        if not ok:
            failed.append(b.name)
    print(f"[bench/all] {f'wrote {args.out}' if ran else f'nothing run, {args.out} unchanged'}"
          + (f"; failed: {', '.join(failed)}" if failed else "") + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    # a bench asked for by name that could not run is an error too
    sys.exit(1 if failed else 2 if args.only and skipped else 0)


if __name__ == "__main__":
    main()
