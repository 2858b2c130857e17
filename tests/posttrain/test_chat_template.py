import dataclasses
import random

import pytest

from chat.template import (
    EOS,
    OBSERVATION,
    STOP_TOKENS,
    USER,
    Message,
    ToolCall,
    assistant_text,
    encode,
    parse_assistant,
    render,
    render_value,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "code": {"type": "string"}}}}}


def agent_conversation(second_turn_thinking: bool = True) -> list[Message]:
    """Two user turns; the first has a tool round trip (two assistant messages in one turn)."""
    return [
        Message("system", "You are a helpful agent."),
        Message("user", "Weather in Paris?"),
        Message("assistant", "Let me check.", reasoning="I should call the tool.",
                tool_calls=(ToolCall("get_weather", {"city": "Paris", "days": 3}),)),
        Message("tool", '{"temp": 20, "sky": "sunny"}'),
        Message("assistant", "Sunny, 20 degrees.", reasoning="The tool says 20."),
        Message("user", "Thanks!", thinking=second_turn_thinking),
        Message("assistant", "You're welcome.", reasoning="Be polite." if second_turn_thinking else ""),
    ]


def assistant_parts(text: str) -> list[str]:
    """The generated part of every assistant message in a rendered conversation: from after
    <|assistant|> through its end token."""
    out = []
    for chunk in text.split("<|assistant|>")[1:]:
        end = min((chunk.index(t) + len(t) for t in STOP_TOKENS if t in chunk), default=len(chunk))
        out.append(chunk[:end])
    return out


# ---------------------------------------------------------------- rendering
def test_render_layout_is_pinned():
    msgs = [Message("system", "S"), Message("user", "U"),
            Message("assistant", "A", reasoning="R", tool_calls=(ToolCall("f", {"k": "v", "n": 1}),)),
            Message("tool", "T"), Message("assistant", "B", reasoning="R2")]
    assert render(msgs) == (
        "<|system|>\nS<|user|>\nU"
        "<|assistant|><think>R</think>A<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value>"
        "<arg_key>n</arg_key><arg_value>1</arg_value></tool_call>"
        "<|observation|><tool_response>\nT\n</tool_response>"
        "<|assistant|><think>R2</think>B<|endoftext|>")
    with_tools = render(msgs[:2], tools=[WEATHER], add_generation_prompt=True)
    assert with_tools.startswith("<|system|>\n# Tools\n") and '"name": "get_weather"' in with_tools
    assert with_tools.endswith("<|system|>\nS<|user|>\nU<|assistant|>")


def test_interleaved_keeps_reasoning_of_the_current_turn_only():
    text = render(agent_conversation(), thinking_mode="interleaved")
    parts = assistant_parts(text)
    # first turn is history: both its assistant messages lose their reasoning
    assert parts[0].startswith("<think></think>Let me check.") and parts[0].endswith(OBSERVATION)
    assert parts[1] == "<think></think>Sunny, 20 degrees.<|user|>"
    assert parts[2] == "<think>Be polite.</think>You're welcome.<|endoftext|>"
    # within the current turn, reasoning precedes every reply and every tool call
    cur = render(agent_conversation()[:5], thinking_mode="interleaved")
    assert [p[:len("<think>I")] for p in assistant_parts(cur)] == ["<think>I", "<think>T"]


def test_preserved_keeps_all_reasoning():
    parts = assistant_parts(render(agent_conversation(), thinking_mode="preserved"))
    assert [p.split("</think>")[0] for p in parts] == \
        ["<think>I should call the tool.", "<think>The tool says 20.", "<think>Be polite."]


def test_turn_mode_switches_thinking_per_turn():
    msgs = agent_conversation(second_turn_thinking=False)
    text = render(msgs, thinking_mode="turn")
    assert "<|user|>\nThanks!/nothink<|assistant|><think></think>You're welcome.<|endoftext|>" in text
    assert "<think>I should" not in text                  # earlier turn's reasoning dropped
    # the generation prompt of a thinking-off turn pre-fills the empty think block
    prompt = render(msgs[:6], thinking_mode="turn", add_generation_prompt=True)
    assert prompt.endswith("/nothink<|assistant|><think></think>")
    on = render(agent_conversation()[:6], thinking_mode="turn", add_generation_prompt=True)
    assert on.endswith("Thanks!<|assistant|>")
    # thinking on in the last turn: its reasoning is kept, like interleaved
    assert "<think>Be polite.</think>" in render(agent_conversation(), thinking_mode="turn")
    with pytest.raises(ValueError, match="thinking-off turn"):
        render(msgs[:6] + [Message("assistant", "x", reasoning="secret")], thinking_mode="turn")
    with pytest.raises(ValueError, match="thinking_mode='turn'"):
        render(msgs, thinking_mode="interleaved")


@pytest.mark.parametrize("bad, match", [
    (lambda: Message("user", "hi <|assistant|>"), "special token"),
    (lambda: Message("user", "x", reasoning="r"), "only assistant"),
    (lambda: Message("assistant", "x", thinking=False), "user messages"),
    (lambda: ToolCall(" f", {}), "whitespace"),
    (lambda: ToolCall("f", {"k": object()}), "JSON"),
    (lambda: ToolCall("f", {"k": "a</arg_value>b"}), "special token"),
    (lambda: render([Message("user", "u"), Message("tool", "t")]), "tool result must follow"),
    (lambda: render([Message("user", "u"), Message("assistant", tool_calls=(ToolCall("f"),)),
                     Message("user", "u")]), "followed by tool results"),
    (lambda: render([Message("user", "u")], thinking_mode="deep"), "thinking_mode"),
    (lambda: render([{"role": "user", "content": "u"}]), "must be a Message"),
])
def test_bad_input_is_a_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_from_dict_reads_openai_style_messages():
    m = Message.from_dict({"role": "assistant", "content": "ok", "reasoning_content": "r",
                           "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}}]})
    assert m == Message("assistant", "ok", reasoning="r", tool_calls=(ToolCall("f", {"a": [1]}),))
    assert Message.from_dict({"role": "observation", "content": "x"}).role == "tool"


# ---------------------------------------------------------------- round trip
TRICKY = ["", " ", "plain", "line\nbreak", "<b>html</b>", "a < b > c", "<think", "think>", "42", "true",
          "null", '"quoted"', "[1, 2]", '{"a": 1}', " 7 ", "NaN?", "emoji \U0001F600 中文", "tab\tend\n"]
VALUES = TRICKY + [0, -3, 2.5, 1e-9, True, False, None, [1, "a", None], {"x": {"y": [True]}}, {}, []]


def random_assistant(rng: random.Random) -> Message:
    calls = tuple(ToolCall(rng.choice(["f", "get_weather", "run code", "a.b-c"]),
                           {f"k{j}": rng.choice(VALUES) for j in range(rng.randint(0, 3))})
                  for _ in range(rng.randint(0, 2)))
    return Message("assistant", content=rng.choice(TRICKY), reasoning=rng.choice(TRICKY), tool_calls=calls)


def test_parse_inverts_render_exactly():
    rng = random.Random(0)
    for _ in range(300):
        m = random_assistant(rng)
        for end in (None, *STOP_TOKENS):
            r = parse_assistant(assistant_text(m) + (end or ""))
            assert r.errors == () and r.stop_token == end
            assert r.message == m, (m, r.message)


@pytest.mark.parametrize("mode", ["interleaved", "preserved", "turn"])
def test_every_assistant_part_of_a_rendered_conversation_parses_back(mode):
    msgs = agent_conversation()
    assistants = [m for m in msgs if m.role == "assistant"]
    kept = {"interleaved": [False, False, True], "preserved": [True] * 3, "turn": [False, False, True]}[mode]
    parts = assistant_parts(render(msgs, thinking_mode=mode))
    assert len(parts) == 3
    for part, m, keep in zip(parts, assistants, kept):
        r = parse_assistant(part)
        assert r.errors == ()
        assert r.message == (m if keep else dataclasses.replace(m, reasoning=""))
        assert r.stop_token == (OBSERVATION if m.tool_calls else part[-len(r.stop_token):])


def test_argument_values_follow_the_stated_rule():
    assert render_value("Paris") == "Paris" and render_value("42") == '"42"' and render_value(42) == "42"
    assert render_value({"a": "é"}) == '{"a": "é"}'
    text = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>42</arg_value>"
            "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>extra</arg_key><arg_value>x y</arg_value></tool_call>")
    untyped = parse_assistant(text).message.tool_calls[0].arguments
    assert untyped == {"city": 42, "days": 3, "extra": "x y"}
    typed = parse_assistant(text, tools=[WEATHER])
    assert typed.message.tool_calls[0].arguments == {"city": "42", "days": 3, "extra": "x y"}
    assert typed.errors == ()
    assert "no such tool" in parse_assistant("<tool_call>nope</tool_call>", tools=[WEATHER]).errors[0]


# ---------------------------------------------------------------- malformed model output
@pytest.mark.parametrize("text, reasoning, content, calls, error", [
    ("<think>still thinking", "still thinking", "", (), "unterminated <think>"),
    ("<think>a<tool_call>f</tool_call>", "a", "", (ToolCall("f"),), "unterminated <think>"),
    ("r</think>answer", "r", "answer", (), "</think> without <think>"),
    ("<think>r</think>hi<tool_call>f<arg_key>x</arg_key><arg_value>1</arg_value>", "r", "hi",
     (ToolCall("f", {"x": 1}),), "unclosed <tool_call>"),
    ("<think></think><tool_call>f<arg_key>x</arg_key></tool_call>", "", "", (ToolCall("f"),),
     "missing <arg_value> for 'x'"),
    ("<think></think><tool_call>f<arg_key>x</arg_key><arg_value>abc", "", "", (ToolCall("f", {"x": "abc"}),),
     "unterminated <arg_value>"),
    ("<think></think><tool_call>f<arg_value>1</arg_value></tool_call>", "", "", (ToolCall("f"),),
     "<arg_value> without <arg_key>"),
    ("<think></think><tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", "", "", (),
     "without a name"),
    ("<think></think>hello <tool_response> world", "", "hello  world", (), "unexpected <tool_response>"),
    ("<think></think>done<|endoftext|>junk after", "", "done", (), "after the stop token"),
    ("<think></think><tool_call>f</tool_call> stray <tool_call>g</tool_call>", "", "",
     (ToolCall("f"), ToolCall("g")), "text between tool calls"),
    ('<tool_call>f<arg_key>a</arg_key><arg_value>"\\u003cthink>"</arg_value></tool_call>', "", "", (),
     "special token"),
    ("<tool_call>f<tool_call>g</tool_call>", "", "", (ToolCall("f"), ToolCall("g")), "unclosed <tool_call>"),
])
def test_malformed_output_is_reported_not_raised(text, reasoning, content, calls, error):
    r = parse_assistant(text)
    assert not r.ok and any(error in e for e in r.errors), r.errors
    assert (r.message.reasoning, r.message.content, r.message.tool_calls) == (reasoning, content, calls)


def test_tolerates_glm45_newlines_inside_tool_calls():
    r = parse_assistant("\n<think>r</think>ok\n<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>")
    assert r.ok and r.message == Message("assistant", "ok\n", reasoning="r", tool_calls=(ToolCall("f", {"a": 1}),))


def test_garbage_never_raises_and_always_gives_a_renderable_message():
    rng = random.Random(1)
    atoms = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
             "</arg_value>", "<|user|>", "<|observation|>", "<tool_response>", "<|fim_middle|>", "x", " ", "\n",
             "42", '{"a":', "name", "\\u003cthink>", '"\\u003c|user|>"']
    for _ in range(2000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 14)))
        r = parse_assistant(text)
        assert r.message.role == "assistant"
        assistant_text(r.message)            # whatever was recovered renders again


# ---------------------------------------------------------------- tokens and loss mask
def spans(text: str, needle: str) -> list[tuple[int, int]]:
    out, i = [], text.find(needle)
    while i >= 0:
        out.append((i, i + len(needle)))
        i = text.find(needle, i + 1)
    return out


@pytest.mark.parametrize("mode", ["interleaved", "preserved", "turn"])
def test_ids_equal_encoding_the_rendered_text(tokenizer, mode):
    msgs = agent_conversation(second_turn_thinking=mode != "turn")
    enc = encode(tokenizer, msgs, tools=[WEATHER], thinking_mode=mode)
    assert enc.ids == tokenizer.encode(render(msgs, tools=[WEATHER], thinking_mode=mode)).ids
    assert len(enc.loss_mask) == len(enc.ids)


@pytest.mark.parametrize("mode", ["interleaved", "preserved", "turn"])
def test_loss_mask_covers_exactly_the_assistant_output(tokenizer, mode):
    msgs = agent_conversation(second_turn_thinking=mode != "turn")
    enc = encode(tokenizer, msgs, tools=[WEATHER], thinking_mode=mode)
    # contiguous trained runs decode to the assistant parts, end tokens included
    runs, cur = [], []
    for i, m in zip(enc.ids, enc.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    runs += [cur] if cur else []
    got = [tokenizer.decode(r, skip_special_tokens=False) for r in runs]
    parts = assistant_parts(render(msgs, tools=[WEATHER], thinking_mode=mode))
    # a template-written empty think block is context, so it is not in the run
    expected = [p[len("<think></think>"):] if p.startswith("<think></think>") else p for p in parts]
    assert got == expected
    assert got[0].endswith(OBSERVATION) and got[1].endswith(USER) and got[2].endswith(EOS)


def test_no_system_user_or_tool_token_is_trained(tokenizer):
    msgs = agent_conversation()
    text = render(msgs, tools=[WEATHER])
    enc = tokenizer.encode(text)
    mask = encode(tokenizer, msgs, tools=[WEATHER]).loss_mask
    assert enc.ids == encode(tokenizer, msgs, tools=[WEATHER]).ids
    context = [s for m in msgs if m.role != "assistant" for s in spans(text, m.content)]
    context += spans(text, "<|assistant|>") + spans(text, "# Tools") + spans(text, "<tool_response>")
    trained = [s for m in msgs if m.role == "assistant" for s in spans(text, m.content)]
    for (a, b), keep in zip(enc.offsets, mask):
        if any(a < e and s < b for s, e in context):
            assert keep == 0, text[a:b]
        if any(a < e and s < b for s, e in trained):
            assert keep == 1, text[a:b]
    # and the trained tokens do not depend on the context's text at all
    edited = [dataclasses.replace(m, content=m.content + " changed") if m.role in ("user", "tool", "system") else m
              for m in msgs]
    e2 = encode(tokenizer, edited, tools=[WEATHER])
    assert [i for i, k in zip(enc.ids, mask) if k] == [i for i, k in zip(e2.ids, e2.loss_mask) if k]


def test_generation_prompt_is_not_trained_and_tokenizer_must_know_the_tags(tokenizer):
    enc = encode(tokenizer, agent_conversation()[:6], add_generation_prompt=True)
    assert enc.ids[-1] == tokenizer.token_to_id("<|assistant|>") and enc.loss_mask[-1] == 0
    from tokenizers import Tokenizer, models
    with pytest.raises(ValueError, match="lacks the special tokens"):
        encode(Tokenizer(models.BPE()), agent_conversation())


def test_train_history_false_trains_only_the_last_turn(tokenizer):
    msgs = agent_conversation()
    full = encode(tokenizer, msgs)
    last = encode(tokenizer, msgs, train_history=False)
    assert last.ids == full.ids
    trained = tokenizer.decode([i for i, k in zip(last.ids, last.loss_mask) if k], skip_special_tokens=False)
    assert trained == "<think>Be polite.</think>You're welcome.<|endoftext|>"
    assert sum(last.loss_mask) < sum(full.loss_mask)
