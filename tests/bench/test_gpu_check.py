"""bench/gpu_check.py without a GPU: arguments, reports, skipping, failure isolation."""
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod                 # dataclasses resolve annotations through it
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("gpu_check", None)


def test_arguments(gc, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("OUT", str(tmp_path / "from_env"))
    args = gc.parse_args([])
    assert args.out == str(tmp_path / "from_env") and not args.dry_run and args.device == "cuda"
    monkeypatch.delenv("OUT")
    assert gc.parse_args([]).out == "gpu_check_out"
    args = gc.parse_args(["--out", "x", "--timeout", "attention=12.5", "--sections", "attention",
                          "--quick", "--result=r"])
    assert args.timeouts == {"attention": 12.5} and args.sections == ["attention"]
    # a section's child gets the parent's choices, but its own --out / --result
    assert args.argv == ["--timeout", "attention=12.5", "--sections", "attention", "--quick"]
    assert args.budget == gc.BUDGET_S
    installing = gc.parse_args(["--install"])       # time for the downloads
    assert installing.timeouts["environment"] == gc.INSTALL_TIMEOUT_S
    assert installing.budget == gc.BUDGET_S + gc.INSTALL_TIMEOUT_S - 30
    assert sum(s.timeout_s for s in gc.SECTIONS if s.default) <= 8 * 60  # one device command, under 8 minutes
    with pytest.raises(SystemExit):
        gc.parse_args(["--timeout", "atention=5"])
    assert "unknown section 'atention'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gc.parse_args(["--timeout", "attention=soon"])
    assert "SECONDS must be a number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gc.parse_args(["--sections", "nope"])


def test_dry_run_without_cuda_skips_gpu_sections_and_writes_reports(tmp_path):
    import torch

    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert {"schema", "created", "commit", "host", "dry_run", "device", "cuda", "command",
            "sections"} <= set(report)
    assert report["dry_run"] is True and report["schema"] == 1
    names = [s["name"] for s in report["sections"]]
    assert names == ["environment", "kernel_tests", "attention", "speculative_decoding",
                     "bf16_training", "nccl_launch"]
    reason = "dry run" if torch.cuda.is_available() else "no CUDA device"
    for s in report["sections"]:
        assert {"name", "title", "status", "reason", "seconds", "timeout_s", "numbers", "error",
                "preconditions"} <= set(s)
        if s["name"] == "environment":           # not a GPU section: it runs and reports
            assert s["status"] == "ok", s["error"]
            assert s["numbers"]["torch"] == torch.__version__
            assert s["numbers"]["cuda_available"] is torch.cuda.is_available()
        else:
            assert (s["status"], s["reason"]) == ("skipped", reason), s
            assert s["preconditions"]["needs_cuda"] is True
    md = (tmp_path / "report.md").read_text()
    assert "| section | status | seconds | summary |" in md
    for name in names[1:]:
        assert f"| {name} | skipped | 0.0 | {reason} |" in md


def _fake_sections(gc):
    def ok(ctx):
        ctx.record(value=1.5, rows=[{"length": 8, "s": 0.25}])

    def boom(ctx):
        ctx.record(partial=7)
        raise RuntimeError("boom in the middle")

    def check(ctx):
        ctx.record(loss=3.0)
        raise gc.CheckFailed("loss differs by 9%")

    def after(ctx):
        ctx.record(ran=True)

    return [gc.Section("first", "First", False, 30, (), ok),
            gc.Section("second", "Second", False, 30, (), boom),
            gc.Section("third", "Third", False, 30, (), check),
            gc.Section("fourth", "Fourth", False, 30, (), after),
            gc.Section("gpu", "Needs a GPU", True, 30, (), after),
            gc.Section("absent", "Missing module", False, 30, ("no_such_module_xyz",), after)]


def test_a_failing_section_is_recorded_and_the_rest_still_run(gc, monkeypatch, tmp_path):
    monkeypatch.setattr(gc, "SECTIONS", _fake_sections(gc))
    monkeypatch.setattr(gc, "cuda_available", lambda: False)
    args = gc.parse_args(["--out", str(tmp_path)])
    report = gc.run_all(args, in_process=True)
    by = {s["name"]: s for s in report["sections"]}
    assert [s["status"] for s in report["sections"]] == ["ok", "failed", "failed", "ok", "skipped",
                                                         "skipped"]
    assert by["first"]["numbers"]["value"] == 1.5
    assert "RuntimeError: boom in the middle" in by["second"]["error"]
    assert by["second"]["numbers"] == {"partial": 7}            # kept although it raised
    assert by["third"]["error"] == "loss differs by 9%" and by["third"]["numbers"] == {"loss": 3.0}
    assert by["fourth"]["numbers"] == {"ran": True}
    assert by["gpu"]["reason"] == "no CUDA device"
    assert by["absent"]["reason"].startswith("missing Python modules: no_such_module_xyz")
    saved = json.loads((tmp_path / "report.json").read_text())
    assert [s["status"] for s in saved["sections"]] == [s["status"] for s in report["sections"]]
    md = (tmp_path / "report.md").read_text()
    assert "| second | failed |" in md and "boom in the middle" in md
    assert "| third | failed |" in md and "loss differs by 9%" in md
    assert "| length | s |" in md and "| 8 | 0.25 |" in md          # list of rows -> a table

    # without an environment section, CUDA is asked for before the GPU sections run
    monkeypatch.setattr(gc, "cuda_available", lambda: True)
    only_gpu = gc.run_all(gc.parse_args(["--out", str(tmp_path / "b"), "--sections", "gpu"]), in_process=True)
    assert only_gpu["cuda"] is True and only_gpu["sections"][0]["status"] == "ok"


def test_budget_leaves_later_sections_skipped(gc, monkeypatch, tmp_path):
    def slow(ctx):
        time.sleep(0.3)

    monkeypatch.setattr(gc, "SECTIONS", [gc.Section("a", "A", False, 30, (), slow),
                                         gc.Section("b", "B", False, 30, (), slow)])
    monkeypatch.setattr(gc, "cuda_available", lambda: False)
    report = gc.run_all(gc.parse_args(["--out", str(tmp_path), "--budget", "5.2"]), in_process=True)
    assert [s["status"] for s in report["sections"]] == ["ok", "skipped"]
    assert report["sections"][1]["reason"] == "no time left in the --budget"


def test_nan_is_written_as_valid_json(gc, tmp_path):
    gc.write_json(tmp_path / "r.json", {"losses": [1.0, float("nan")], "x": float("inf")})
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text.replace('"nan"', "")
    assert json.loads(text) == {"losses": [1.0, "nan"], "x": "inf"}


def test_run_command_timeout_kills_the_whole_group(gc, tmp_path):
    t0 = time.monotonic()
    rc, out = gc.run_command(["bash", "-c", "echo started; sleep 30 & sleep 30"], 1.0, tmp_path / "log")
    assert rc is None and "started" in out and time.monotonic() - t0 < 10
    assert "started" in (tmp_path / "log").read_text()
    rc, out = gc.run_command(["bash", "-c", "echo hi; exit 3"], 30)
    assert (rc, out.strip()) == (3, "hi")


def test_parse_junit(gc, tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text("""<?xml version="1.0"?><testsuites><testsuite name="pytest">
      <testcase classname="tests.kernels.test_topk" name="test_a"/>
      <testcase classname="tests.kernels.test_topk" name="test_triton_x">
        <failure message="AssertionError: mismatch">trace</failure></testcase>
      <testcase classname="m" name="test_c"><error message="fixture broke"/></testcase>
      <testcase classname="m" name="test_d"><skipped message="no triton"/></testcase>
    </testsuite></testsuites>""")
    rows = gc.parse_junit(xml)
    assert [(r["test"], r["status"]) for r in rows] == [
        ("tests.kernels.test_topk::test_a", "passed"), ("tests.kernels.test_topk::test_triton_x", "failed"),
        ("m::test_c", "error"), ("m::test_d", "skipped")]
    assert rows[1]["message"] == "AssertionError: mismatch"


def test_install_commands(gc):
    cmds = gc.install_commands("2.13.0+cpu", None, [], None)
    assert cmds == [[sys.executable, "-m", "pip", "install", "--force-reinstall", "torch==2.13.0"]]
    assert gc.install_commands("2.11.0+cu130", "13.0", [], None) == []
    cmds = gc.install_commands("2.11.0+cu130", "13.0", ["pydantic"], ".whl")
    assert cmds == [[sys.executable, "-m", "pip", "install", "--no-index", "--find-links", ".whl",
                     gc.requirement_spec("pydantic")]]
    assert gc.requirement_spec("pydantic").startswith("pydantic>=")      # requirements-cpu.txt's range
    cmds = gc.install_commands(None, None, ["torch"], None)               # no torch at all
    assert cmds[0][-1] == gc.requirement_spec("torch") and gc.requirement_spec("torch").startswith("torch==")


def test_kernel_check_device_hook(monkeypatch):
    import torch

    from tests.kernels._interpret import check_device, on_device

    monkeypatch.delenv("GLMFORGE_TEST_DEVICE", raising=False)
    assert check_device() == "cpu"
    monkeypatch.setenv("GLMFORGE_TEST_DEVICE", "tpu")
    with pytest.raises(ValueError, match="GLMFORGE_TEST_DEVICE"):
        check_device()
    seen = {}

    def check():
        g = torch.Generator().manual_seed(0)
        seen["drawn"] = torch.randn(3, generator=g, requires_grad=True)
        seen["zeros"], seen["explicit"] = torch.zeros(2), torch.zeros(2, device="cpu")

    on_device(check, "meta")                     # "meta" stands in for cuda: no GPU here
    assert seen["drawn"].device.type == "meta" and seen["drawn"].is_leaf and seen["drawn"].requires_grad
    assert seen["zeros"].device.type == "meta" and seen["explicit"].device.type == "cpu"
