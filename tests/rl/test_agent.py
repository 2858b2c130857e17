"""Multi-turn episodes: token-in-token-out, observation masking, forks, per-token versions."""
from __future__ import annotations

from dataclasses import dataclass

from chat.template import EOS, OBSERVATION, Message, ToolCall, assistant_text, encode
from domains.task import Task
from rl.agent import observation_ids, run_group
from rl.rollout import SamplingParams
from rl.sample import Status

CALC = {"type": "function", "function": {"name": "calculator", "description": "add",
                                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}


@dataclass
class Step:
    observations: list
    done: bool = False


@dataclass
class Outcome:
    score: float
    status: str = "ok"
    reason: str = ""


class CalcEnv:
    tools = [CALC]

    def __init__(self):
        self.calls = []

    def reset(self, task):
        return task.prompt

    def step(self, calls):
        self.calls += calls
        return Step([str(eval(c.arguments["expression"], {}))for c in calls])

    def final_reward(self, answer):
        return Outcome(float(answer.strip() == "45"))


class ScriptedEngine:
    """complete() returns the next scripted turn for every prefix; records what it was given."""

    def __init__(self, turns):
        self.turns, self.version, self.seen = list(turns), 0, []

    def complete(self, prefixes, params, generator, keys=None):
        self.seen.append([list(p) for p in prefixes])
        ids = self.turns.pop(0)
        return [(list(ids), [-0.5] * len(ids), True, [self.version] * len(ids)) for _ in prefixes]


def _call(expr):
    # what the model generates after the prompt's "<|assistant|><think></think>" (thinking off)
    text = assistant_text(Message("assistant", tool_calls=(ToolCall("calculator", {"expression": expr}),)))
    return text.removeprefix("<think></think>")


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_tool_turn_then_answer_token_in_token_out(tokenizer):
    call = _call("40+5")
    turn1 = _ids(tokenizer, call + OBSERVATION)
    # the answer "45" sampled as two tokens "4", "5": a decode -> encode round trip merges them
    four, five = tokenizer.token_to_id("4"), tokenizer.token_to_id("5")
    turn2 = [four, five, tokenizer.token_to_id(EOS)]
    assert _ids(tokenizer, "45" + EOS) != turn2
    engine = ScriptedEngine([turn1, turn2])
    versions = iter([3, 4])

    def bump():
        engine.version = next(versions)
    task = Task("calc", "What is 40+5?", "45")
    (s,) = run_group(engine, tokenizer, CalcEnv, task, group=7, n=1, params=SamplingParams(), max_turns=4, seed=0,
                     on_turn=bump)
    obs = observation_ids(tokenizer, ["45"])
    assert s.response_ids == turn1 + obs + turn2                        # exactly the sampled ids, appended
    assert s.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert s.rollout_logprobs == [-0.5] * len(turn1) + [0.0] * len(obs) + [-0.5] * len(turn2)
    assert s.versions == [3] * (len(turn1) + len(obs)) + [4] * len(turn2)
    assert s.reward == 1.0 and s.status == Status.OK and s.group == 7
    # the second turn continued from the first turn's ids, not from a re-encoding of the text
    assert engine.seen[1][0] == s.prompt_ids + turn1 + obs
    # and the template renders the same conversation to the same prefix ids
    history = [Message("user", task.prompt, thinking=False),
               Message("assistant", tool_calls=(ToolCall("calculator", {"expression": "40+5"}),)),
               Message("tool", "45")]
    rendered = encode(tokenizer, history, [CALC], thinking_mode="turn", add_generation_prompt=True).ids
    assert rendered == s.prompt_ids + turn1 + obs


def test_context_rewrite_forks_the_trajectory(tokenizer):
    call = _call("40+5")
    turn1 = _ids(tokenizer, call + OBSERVATION)
    turn2 = _ids(tokenizer, "45" + EOS)
    engine = ScriptedEngine([turn1, turn2])

    def elide(messages):
        shown = [m if m.role != "tool" else Message("tool", "[result elided]") for m in messages]
        return shown, True
    task = Task("calc", "What is 40+5?", "45")
    first, second = run_group(engine, tokenizer, CalcEnv, task, group=1, n=1, params=SamplingParams(), max_turns=4,
                              seed=0, context=elide)
    assert first.response_ids == turn1 + observation_ids(tokenizer, ["45"])
    history = [Message("user", task.prompt, thinking=False),
               Message("assistant", tool_calls=(ToolCall("calculator", {"expression": "40+5"}),)),
               Message("tool", "[result elided]")]
    assert second.prompt_ids == encode(tokenizer, history, [CALC], thinking_mode="turn",
                                       add_generation_prompt=True).ids
    assert second.response_ids == turn2
    assert first.reward == second.reward == 1.0 and first.group == second.group == 1


def test_max_turns_ends_the_episode_and_scores_it(tokenizer):
    call = _call("1+1")
    turn = _ids(tokenizer, call + OBSERVATION)
    engine = ScriptedEngine([turn, turn])
    (s,) = run_group(engine, tokenizer, CalcEnv, Task("calc", "x", "45"), group=0, n=1, params=SamplingParams(),
                     max_turns=2, seed=0)
    assert s.reward == 0.0 and s.response_ids == turn + observation_ids(tokenizer, ["2"]) + turn
