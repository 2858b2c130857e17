"""The reward-hacking signal: a solution that memorised its tests keeps its reward and raises an
alert; an honest one does not."""
from __future__ import annotations

import logging
from pathlib import Path

from domains.pools import mbpp_tasks
from rl import reward_audit
from rl.envs import make_env, tasks_for
from rl.rewards import RewardWorker
from rl.sample import Sample

MBPP = "samples/mbpp/mbpp.jsonl"


def memorised(task) -> str:
    """A lookup table of the task's own tests: passes them, solves nothing."""
    from rl.verify import checks_from_asserts
    checks = checks_from_asserts(task.meta["tests"])
    name = checks[0].call.split("(", 1)[0]
    table = {c.call: c.expected for c in checks}
    return (f"```python\ndef {name}(*args):\n    call = {name!r} + '(' + ', '.join(map(repr, args)) + ')'\n"
            f"    return {table!r}.get(call)\n```")


def test_memorised_solutions_are_rewarded_and_flagged(caplog):
    tasks = [t for t in mbpp_tasks(str(Path(__file__).resolve().parents[2] / MBPP)) if t.meta["task_id"] in (602, 604)]
    honest = [Sample(t, 0, [], text=f"```python\n{t.meta['reference']}\n```") for t in tasks]
    cheats = [Sample(t, 1, [], text=memorised(t)) for t in tasks]
    samples = honest + cheats
    with RewardWorker() as worker:
        for s, out in zip(samples, worker.score([(s.text, s.task) for s in samples], 20)):
            s.reward = out.score
        assert [s.reward for s in samples] == [1.0] * 4             # the tests cannot tell them apart
        reward_audit.recheck_rewarded(worker, samples, per_step=8, seed=0, step=1, timeout_s=20)
    assert [s.reward_recheck for s in samples] == [1.0, 1.0, 0.0, 0.0]
    assert [s.reward for s in samples] == [1.0] * 4                 # the check never changes a reward
    rec = {"step": 1, **reward_audit.step_metrics(samples)}
    assert rec["reward_recheck_disagreement"] == 0.5 and rec["reward_rechecked"] == 4
    with caplog.at_level(logging.WARNING, logger="glmforge"):
        reward_audit.warn("rl-reasoning", rec, alert=0.25)
    assert "may be exploiting its reward" in caplog.text
    quiet = {"step": 2, **reward_audit.step_metrics(honest)}
    s = reward_audit.summary([rec, quiet], alert=0.25)
    assert s["alert_steps"] == [1] and s["rechecked"] == 6 and abs(s["disagreement"] - 2 / 6) < 1e-9


def test_recheck_is_seeded_and_capped():
    tasks = mbpp_tasks(str(Path(__file__).resolve().parents[2] / MBPP))[:6]

    def picked() -> list[int]:
        samples = [Sample(t, i, [], text=f"```python\n{t.meta['reference']}\n```", reward=1.0)
                   for i, t in enumerate(tasks)]
        with RewardWorker() as worker:
            reward_audit.recheck_rewarded(worker, samples, per_step=2, seed=3, step=7, timeout_s=20)
        return [s.group for s in samples if s.reward_recheck is not None]
    first = picked()
    assert 1 <= len(first) <= 2 and picked() == first              # a resumed step re-checks the same samples


def test_swe_repair_recheck_tells_a_fix_from_a_lookup_table():
    from rl.envs.swe_repair import test_checks
    task = tasks_for("swe_repair", "heldout", 1, 0)[0]
    env = make_env("swe_repair")
    env.reset(task)
    env.files["solution.py"] = task.answer
    assert env.final_reward("").score == 1.0 and env.recheck().score == 1.0
    _, checks = test_checks(task)
    names = {c.call.split("(", 1)[0] for c in checks.values()}
    table = {c.call: c.expected for c in checks.values()}
    env.files["solution.py"] = "".join(
        f"def {n}(*args):\n    return {table!r}.get({n!r} + '(' + ', '.join(map(repr, args)) + ')')\n" for n in names)
    assert env.final_reward("").score == 1.0                         # passes every test
    assert env.recheck().score == 0.0
