"""The RL stages that run model-written code refuse to start without the sandbox's isolation,
unless their config opts out by name; the stages that run none start anyway."""
from __future__ import annotations

import os
import sys

import pytest
from pydantic import ValidationError

from runtime.runner import key_config
from runtime.stage import Workdir
from posttrain import rl_agentic, rl_reasoning
from posttrain.rl_agentic import SANDBOXED_ENVIRONMENTS, RLAgenticConfig, run_rl_agentic
from posttrain.rl_reasoning import RLReasoningConfig, run_rl_reasoning
from rl import sandbox
from rl.envs import ENVIRONMENTS
from rl.sandbox import ALLOW_WEAK_ENV, SandboxError


@pytest.fixture
def no_bwrap(monkeypatch):
    """A machine without bubblewrap: isolation() says so, weak isolation not yet allowed."""
    report = {"tool": "none", "problem": "bwrap not found on /usr/bin:/bin:/usr/sbin:/sbin"}
    monkeypatch.setattr(sandbox, "isolation", lambda: report)
    monkeypatch.setenv(ALLOW_WEAK_ENV, "0")          # restored (unset) after the test


def test_rl_reasoning_with_code_refuses_to_start_without_isolation(no_bwrap, tmp_path):
    cfg = RLReasoningConfig(domains={"arithmetic": 1.0, "code": 1.0})
    # the first thing the stage does: no input is read before the refusal
    with pytest.raises(SandboxError, match="^bwrap not found.*rl_reasoning.sandbox_allow_weak_isolation: true"):
        run_rl_reasoning(cfg, {}, Workdir.at(tmp_path))
    rl_reasoning.require_sandbox(RLReasoningConfig(domains={"arithmetic": 1.0, "code": 0.0}))   # no code: starts
    rl_reasoning.require_sandbox(cfg.model_copy(update={"sandbox_allow_weak_isolation": True}))
    assert os.environ[ALLOW_WEAK_ENV] == "1"   # the reward worker, started next, inherits it


def test_rl_agentic_with_a_sandboxed_environment_refuses_to_start_without_isolation(no_bwrap, tmp_path):
    with pytest.raises(SandboxError, match="rl_agentic.sandbox_allow_weak_isolation: true"):
        run_rl_agentic(RLAgenticConfig(environments={"terminal": 1.0, "calc_arith": 1.0}), {}, Workdir.at(tmp_path))
    wrapped = RLAgenticConfig(environments={"delayed": 1.0}, env_args={"delayed": {"inner": "swe_repair"}})
    with pytest.raises(SandboxError, match="rl_agentic.sandbox_allow_weak_isolation"):
        rl_agentic.require_sandbox(wrapped)
    rl_agentic.require_sandbox(RLAgenticConfig(environments={"delayed": 1.0, "search": 1.0, "terminal": 0.0}))
    rl_agentic.require_sandbox(wrapped.model_copy(update={"sandbox_allow_weak_isolation": True}))


def test_the_opt_out_is_a_strict_bool_outside_the_stage_key():
    with pytest.raises(ValidationError, match="sandbox_allow_weak_isolation"):
        RLReasoningConfig(sandbox_allow_weak_isolation="yes")
    with pytest.raises(ValidationError, match="sandbox_allow_weak_isolation"):
        RLAgenticConfig(sandbox_allow_weak_isolation=1)
    # how the code runs, not what it computes: existing artifacts keep their keys
    assert "sandbox_allow_weak_isolation" not in key_config(RLReasoningConfig(sandbox_allow_weak_isolation=True))
    assert "sandbox_allow_weak_isolation" not in key_config(RLAgenticConfig())


def test_sandboxed_environments_are_those_whose_module_uses_the_sandbox():
    sandboxed = ("rl.sandbox", "rl.swe.python")            # rl.swe.python runs test suites through rl.sandbox
    uses = {name for name, cls in ENVIRONMENTS.items()
            if any(getattr(v, "__module__", None) in sandboxed for v in vars(sys.modules[cls.__module__]).values())}
    assert uses == SANDBOXED_ENVIRONMENTS
