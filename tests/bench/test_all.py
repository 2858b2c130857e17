"""bench/all.py: every bench is registered, its arguments exist, its output parses, and the
results table keeps the rows of benches not rerun (no bench is run here)."""
import importlib.util
import json
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _all():
    spec = importlib.util.spec_from_file_location("bench_all", BENCH / "all.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_every_bench_is_registered_and_its_arguments_exist():
    a = _all()
    assert a.unregistered() == [], "add new benches to bench/all.py (BENCHES or NOT_BENCHES)"
    for b in a.BENCHES:
        src = (BENCH / f"{b.name}.py").read_text()
        for flag in (x for x in b.quick + b.standard if x.startswith("--")):
            assert re.search(rf"""["']{re.escape(flag)}["']""", src), f"{b.name}.py has no {flag}"


def test_summaries_parse_the_benches_output():
    a = _all()
    stamp = "[2026-01-01 10:00Z; vm, 2 cpus X, Linux x86_64, Python 3.11; boto3 1.0 to SeaweedFS, 256 MiB in 7 files]"
    measured, settings = a.s3_upload(f"  repeat 1/1 raw 1 MB/s\ns3_upload summary: raw boto3 upload_file 60.0 MB/s; "
                                     f"store publish 57.0 MB/s = 0.95x (paired median 0.93x)  {stamp}\n")
    assert measured.startswith("raw boto3 upload_file 60.0 MB/s") and "0.95x" in measured
    assert settings == "boto3 1.0 to SeaweedFS, 256 MiB in 7 files"
    out = "| x |\n" + json.dumps([{"mode": "ep", "median_s": 0.2, "expert_params_per_rank": 10}])
    assert a.moe_ep(out)[0] == "ep 200 ms/step, 10 expert params/rank"
    table = ("dense MHA 16 x 64, top-k 2048; time = fwd + bwd\n length dense s DSA s (index attn) speedup\n"
             "  32768 9.00 6.00 1.00 4.00 1.50x 100 160 1.60x\n")
    assert a.attention(table)[0] == "32K DSA speed-up 1.50x mem 1.60x"


def test_results_table_keeps_other_rows_and_escapes_cells(tmp_path):
    a = _all()
    out = tmp_path / "RESULTS.md"
    a.write_rows(out, {"train": "| `train` | old | d | m | s |", "s3_upload": "| `s3_upload` | old | d | m | s |"})
    rows = a.read_rows(out)
    rows["s3_upload"] = f"| `s3_upload` | {a.cell('a | b')} | d2 | m | s |"
    a.write_rows(out, rows)
    text = out.read_text()
    assert "| `train` | old |" in text and r"a \| b" in text and "| `s3_upload` | old" not in text
    assert text.index("`s3_upload`") < text.index("`train`")  # registry order


def test_rl_ranks_summary_parses():
    a = _all()
    mis = lambda x: {"mismatch/abs_logp": x, "mismatch/k3": x / 10, "mismatch/abs_logp_max": x * 3}  # noqa: E731
    out = "noise\n" + json.dumps({
        "update": {"one_rank_s": 2.0, "two_ranks_s": 1.0, "ratio": 2.0, "ratio_1_thread": 1.5, "one_rank_threads": 2,
                   "one_rank_1_thread_s": 1.5, "samples": 16},
        "weight_sync": [{"preset": "tiny", "params": 10, "by_ranks": {
            "2": {"bytes": 2**20, "buckets": 2, "publish_s_slowest_rank": 0.5, "load_s": 0.25}}}],
        "routing_replay": {"without_replay": mis(0.05), "with_replay": mis(0.03)},
        "settings": {"preset": "tiny"}}, indent=1)
    measured, settings = a.rl_ranks(out)
    assert "= 2.00x" in measured and "tiny 1 MiB by 2 ranks" in measured and "0.050 -> 0.030" in measured
    assert settings == "preset tiny"


def test_launch_summary_parses():
    a = _all()
    out = "x\n" + json.dumps({"nproc": 2, "repeats": 3, "wall_s": {"torchrun": 5.5, "spawn": 3.0},
                               "cpu_s": {"torchrun": 8.0, "spawn": 5.0}, "wall_ratio_torchrun_over_spawn": 1.83,
                               "cpu_ratio_torchrun_over_spawn": 1.6})
    measured, settings = a.launch(out)
    assert "torchrun 5.50 s wall" in measured and "1.83x wall, 1.60x CPU" in measured and settings.startswith("median of 3")
