"""Rewards registered only for tests; RewardWorker(imports=[__name__]) loads them in the worker."""
import time

from rl.rewards import RewardOutcome, register_reward


@register_reward("test_sleep_forever")
def sleep_forever(text, task):
    while True:
        time.sleep(1)


@register_reward("test_raise")
def raise_error(text, task):
    raise ValueError(f"boom on {text!r}")


@register_reward("test_bad_score")
def bad_score(text, task):
    return RewardOutcome(2.0, "ok", "out of range")
