"""The GLM chat template: ONE definition used by SFT, RL rollouts and evaluation.

Layout (GLM-4.5 / GLM-5 style; our tokenizer has no [gMASK]<sop> prefix):

    <|system|>\\n# Tools ... <tools>\\n{tool json per line}\\n</tools> ...   (only if tools are given)
    <|system|>\\n{content}
    <|user|>\\n{content}                          (+ "/nothink" when thinking is off, turn mode)
    <|assistant|><think>{reasoning}</think>{content}<tool_call>{name}<arg_key>{k}</arg_key><arg_value>{v}</arg_value>...</tool_call>{END}
    <|observation|><tool_response>\\n{content}\\n</tool_response>...     (one marker per run of tool messages)

The assistant part is written exactly as given (no stripping, no inserted newlines) so that
parse_assistant(assistant part) gives the message back. Tool calls use the compact XML form of
GLM-4.7/GLM-5 (GLM-4.5 put newlines between the tags).

END, the token that ends an assistant message, is what the model must learn to emit; it is
also GLM's stop-token set (generation_config eos ids <|endoftext|>, <|user|>, <|observation|>):
    - a message with tool calls ends with <|observation|> (the environment answers next); the
      tool results that follow reuse that token as their opening marker;
    - a message without tool calls ends with <|user|> when a user message follows (again shared
      with the next block) and with <|endoftext|> otherwise.
The loss mask covers, per assistant message: the kept <think> block, the content, the tool
calls and END. Never <|assistant|>, system, user or tool text, and never a <think></think>
that the template wrote rather than the model (dropped history reasoning, thinking-off prefill).

Thinking modes (the rule for each assistant message i; "current turn" = after the last user
message, i.e. the reply being produced together with its tool-call round trips):
    interleaved  reasoning is kept for every assistant message of the current turn (a <think>
                 before each reply and each tool call); earlier turns' reasoning is dropped to
                 <think></think>. This is GLM-4.5's published template rule
                 (loop.index0 > last_user_index).
    preserved    reasoning of every assistant message is kept, earlier turns included
                 (GLM-4.7/GLM-5 "preserved thinking", clear_thinking=False).
    turn         each user message switches thinking for its turn (Message.thinking, default
                 on). A thinking-off user message gets GLM-4.5's "/nothink" suffix and every
                 assistant message of that turn starts with a template-written <think></think>
                 (not trained; the generation prompt ends with it too), and must have no
                 reasoning. Thinking-on turns follow the interleaved rule (earlier turns'
                 reasoning dropped).
The "/nothink" suffix and the dropped-history rule are GLM-4.5's template; preserved thinking
and turn-level switching are described for GLM-4.7/GLM-5; their exact template text was not
available here, so the rules above are ours where they go beyond GLM-4.5.

Tool argument values: a string is written raw unless it parses as JSON on its own ("42",
"true", "[1]", '"x"'), then json.dumps'ed; any other value is json.dumps'ed (ensure_ascii=False).
Parsing reads a value with json.loads and keeps the raw text when that fails, so every value
round-trips without a schema. With a tool schema, a parameter declared "type": "string" keeps
the raw text when the JSON reading is not a string (the model wrote 42 for a string field).
GLM-4.5 writes strings raw always; quoting JSON-looking strings is our addition for exactness.

Special-token strings (data_processing.tokenizer.SPECIAL_TOKENS) may not appear inside message
text: the tokenizer would read them as structure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from data_processing.tokenizer import SPECIAL_TOKENS

Role = Literal["system", "user", "assistant", "tool"]
ThinkingMode = Literal["interleaved", "preserved", "turn"]
THINKING_MODES = ("interleaved", "preserved", "turn")

SYSTEM, USER, ASSISTANT, OBSERVATION = "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"
EOS = "<|endoftext|>"
THINK, END_THINK = "<think>", "</think>"
TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"
ARG_KEY, END_ARG_KEY = "<arg_key>", "</arg_key>"
ARG_VALUE, END_ARG_VALUE = "<arg_value>", "</arg_value>"
TOOL_RESPONSE, END_TOOL_RESPONSE = "<tool_response>", "</tool_response>"
NOTHINK = "/nothink"
# Generation stops at any of these (GLM's eos_token_id list); the stop token is part of the
# assistant's output and of its loss.
STOP_TOKENS = (EOS, USER, OBSERVATION)

_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in sorted(SPECIAL_TOKENS, key=len, reverse=True)))


def _check_text(what: str, text: str) -> None:
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a str, got {type(text).__name__}")
    m = _SPECIAL_RE.search(text)
    if m:
        raise ValueError(f"{what} contains the special token {m.group()!r}; it would be read as "
                         "template structure")


# ---------------------------------------------------------------- messages
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        _check_text("tool name", self.name)
        if not self.name or self.name != self.name.strip():
            raise ValueError(f"tool name must be non-empty without surrounding whitespace, got {self.name!r}")
        if not isinstance(self.arguments, dict):
            raise ValueError(f"tool arguments must be a dict, got {type(self.arguments).__name__}")
        for k, v in self.arguments.items():
            _check_text("argument key", k)
            if not k or k != k.strip():
                raise ValueError(f"argument key must be non-empty without surrounding whitespace, got {k!r}")
            _check_text(f"argument {k!r}", render_value(v))


@dataclass(frozen=True)
class Message:
    """role "tool" is a tool result (rendered under <|observation|>). `reasoning` and
    `tool_calls` belong to assistant messages, `thinking=False` to user messages (turn mode)."""
    role: Role
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    thinking: bool = True

    def __post_init__(self):
        if self.role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"role must be system/user/assistant/tool, got {self.role!r}")
        _check_text(f"{self.role} content", self.content)
        _check_text("reasoning", self.reasoning)
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))
        if self.role != "assistant" and (self.reasoning or self.tool_calls):
            raise ValueError(f"only assistant messages carry reasoning or tool calls, got role {self.role!r}")
        if any(not isinstance(c, ToolCall) for c in self.tool_calls):
            raise ValueError("tool_calls must be ToolCall objects")
        if self.role != "user" and not self.thinking:
            raise ValueError("thinking=False switches a turn off and belongs on user messages")

    @classmethod
    def from_dict(cls, d: dict) -> "Message":
        """OpenAI-style dict: role ("observation" = "tool"), content, reasoning_content or
        reasoning, tool_calls [{"function": {"name", "arguments": dict or JSON str}}], thinking."""
        role = "tool" if d.get("role") == "observation" else d.get("role")
        calls = []
        for c in d.get("tool_calls") or ():
            f = c.get("function", c)
            args = f.get("arguments") or {}
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError as e:
                    raise ValueError(f"tool call {f.get('name')!r}: arguments are not JSON: {e}") from None
            calls.append(ToolCall(f.get("name", ""), args))
        return cls(role=role, content=d.get("content") or "",
                   reasoning=d.get("reasoning_content") or d.get("reasoning") or "",
                   tool_calls=tuple(calls), thinking=d.get("thinking", True))


def render_value(v: Any) -> str:
    """A tool argument value as written between <arg_value> tags (rule in the module doc)."""
    if isinstance(v, str):
        try:
            json.loads(v)
        except ValueError:
            return v
    try:
        return json.dumps(v, ensure_ascii=False)
    except TypeError as e:
        raise ValueError(f"tool argument value is not JSON-serialisable: {e}") from None


def parse_value(raw: str, declared_type: str | None = None) -> Any:
    try:
        v = json.loads(raw)
    except ValueError:
        return raw
    if declared_type == "string" and not isinstance(v, str):
        return raw
    return v


def assistant_text(m: Message, keep_reasoning: bool = True) -> str:
    """What the model generates for `m` after <|assistant|>, without the end token."""
    if m.role != "assistant":
        raise ValueError(f"expected an assistant message, got role {m.role!r}")
    calls = "".join(
        TOOL_CALL + c.name + "".join(f"{ARG_KEY}{k}{END_ARG_KEY}{ARG_VALUE}{render_value(v)}{END_ARG_VALUE}"
                                     for k, v in c.arguments.items()) + END_TOOL_CALL
        for c in m.tool_calls)
    return f"{THINK}{m.reasoning if keep_reasoning else ''}{END_THINK}{m.content}{calls}"


def tools_system_prompt(tools: Sequence[dict]) -> str:
    """GLM-4.5's tool preamble, with the compact call format."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (f"{SYSTEM}\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
            "For each function call, output the function name and arguments within the following XML format:\n"
            f"{TOOL_CALL}{{function-name}}{ARG_KEY}{{arg-key-1}}{END_ARG_KEY}{ARG_VALUE}{{arg-value-1}}{END_ARG_VALUE}"
            f"{ARG_KEY}{{arg-key-2}}{END_ARG_KEY}{ARG_VALUE}{{arg-value-2}}{END_ARG_VALUE}...{END_TOOL_CALL}")


def _tool_schema(tools: Sequence[dict] | None) -> dict[str, dict[str, str]]:
    """{tool name: {parameter: declared JSON type}} from OpenAI-style tool dicts."""
    out = {}
    for t in tools or ():
        f = t.get("function", t)
        props = (f.get("parameters") or {}).get("properties") or {}
        out[f.get("name", "")] = {k: p.get("type") for k, p in props.items() if isinstance(p, dict)}
    return out


# ---------------------------------------------------------------- rendering
def _segments(messages: Sequence[Message], tools: Sequence[dict] | None, thinking_mode: str,
              add_generation_prompt: bool, train_history: bool = True) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) pieces. A trained piece always starts right
    after a special token and ends with one, so encoding pieces one by one gives the same ids
    as encoding the whole string (added tokens split the text before BPE)."""
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, Message):
            raise ValueError(f"messages[{i}] must be a Message, got {type(m).__name__}")
    if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools)):
        raise ValueError("tools must be a list of dicts (OpenAI function format)")
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)

    segs: list[tuple[str, bool]] = []
    prompt = [tools_system_prompt(tools)] if tools else []   # untrained text not yet flushed
    thinking_on, opened = True, None   # opened: the block marker already emitted by the previous END
    for i, m in enumerate(messages):
        nxt = messages[i + 1] if i + 1 < len(messages) else None
        if m.role == "user" and not m.thinking and thinking_mode != "turn":
            raise ValueError(f"messages[{i}]: thinking=False needs thinking_mode='turn', got {thinking_mode!r}")
        if m.role == "system":
            prompt.append(f"{SYSTEM}\n{m.content}")
        elif m.role == "user":
            if opened != USER:
                prompt.append(USER)
            thinking_on = m.thinking
            prompt.append("\n" + m.content + ("" if m.thinking else NOTHINK))
        elif m.role == "tool":
            prev = messages[i - 1] if i else None
            if prev is None or not (prev.role == "tool" or (prev.role == "assistant" and prev.tool_calls)):
                raise ValueError(f"messages[{i}]: a tool result must follow an assistant tool call or another tool result")
            if prev.role == "assistant" and opened != OBSERVATION:
                prompt.append(OBSERVATION)
            prompt.append(f"{TOOL_RESPONSE}\n{m.content}\n{END_TOOL_RESPONSE}")
        else:
            if thinking_mode == "turn" and not thinking_on and m.reasoning:
                raise ValueError(f"messages[{i}]: reasoning in a thinking-off turn (turn mode)")
            if m.tool_calls and nxt is not None and nxt.role != "tool":
                raise ValueError(f"messages[{i}]: an assistant tool call must be followed by tool results "
                                 f"or end the conversation, got role {nxt.role!r} next")
            keep = {"interleaved": i > last_user, "preserved": True,
                    "turn": i > last_user and thinking_on}[thinking_mode]
            end = OBSERVATION if m.tool_calls else (USER if nxt is not None and nxt.role == "user" else EOS)
            body = assistant_text(m, keep_reasoning=keep)
            prompt.append(ASSISTANT)
            if not keep:                   # the template's empty think block is context, not output
                prompt.append(THINK + END_THINK)
                body = body[len(THINK + END_THINK):]
            segs.append(("".join(prompt), False))
            segs.append((body + end, train_history or i > last_user))
            prompt, opened = [], end
            continue
        opened = None
    if add_generation_prompt:
        if messages and messages[-1].role == "assistant" and messages[-1].tool_calls:
            raise ValueError("add_generation_prompt after an assistant tool call: the tool results are missing")
        prompt.append(ASSISTANT)
        if thinking_mode == "turn" and not thinking_on:
            prompt.append(THINK + END_THINK)
    if prompt:
        segs.append(("".join(prompt), False))
    return segs


def render(messages: Sequence[Message], tools: Sequence[dict] | None = None,
           thinking_mode: ThinkingMode = "interleaved", add_generation_prompt: bool = False) -> str:
    """The conversation as text (see the module doc for the layout and thinking-mode rules)."""
    return "".join(t for t, _ in _segments(messages, tools, thinking_mode, add_generation_prompt))


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    loss_mask: list[int]        # 1 = the model produced this token (trained), 0 = context


def encode(tokenizer, messages: Sequence[Message], tools: Sequence[dict] | None = None,
           thinking_mode: ThinkingMode = "interleaved", add_generation_prompt: bool = False,
           train_history: bool = True) -> Encoded:
    """Token ids and loss mask for a `tokenizers.Tokenizer` that has SPECIAL_TOKENS as added
    tokens; ids equal tokenizer.encode(render(...)).ids.

    train_history=False trains only the assistant messages after the last user message. In
    interleaved and turn modes the earlier turns are shown without their reasoning, a context
    the model never answered from, so a multi-turn sample is better split into one sample per
    turn (each a prefix of the conversation) with train_history=False."""
    missing = [t for t in (SYSTEM, USER, ASSISTANT, OBSERVATION, EOS, THINK, END_THINK, TOOL_CALL,
                           END_TOOL_CALL, ARG_KEY, END_ARG_KEY, ARG_VALUE, END_ARG_VALUE,
                           TOOL_RESPONSE, END_TOOL_RESPONSE) if tokenizer.token_to_id(t) is None]
    if missing:
        raise ValueError(f"tokenizer lacks the special tokens {missing}")
    ids, mask = [], []
    for text, trained in _segments(messages, tools, thinking_mode, add_generation_prompt, train_history):
        piece = tokenizer.encode(text, add_special_tokens=False).ids
        ids += piece
        mask += [int(trained)] * len(piece)
    return Encoded(ids, mask)


# ---------------------------------------------------------------- parsing
@dataclass(frozen=True)
class ParseResult:
    message: Message                 # what could be recovered (always a valid assistant Message)
    errors: tuple[str, ...] = ()     # one line per problem; empty = well formed
    stop_token: str | None = None    # the trailing stop token, if the text had one

    @property
    def ok(self) -> bool:
        return not self.errors


def _pieces(text: str) -> list[tuple[bool, str]]:
    """text -> [(is_tag, s)]: special-token tags and the plain text between them."""
    out, pos = [], 0
    for m in _SPECIAL_RE.finditer(text):
        if m.start() > pos:
            out.append((False, text[pos:m.start()]))
        out.append((True, m.group()))
        pos = m.end()
    if pos < len(text):
        out.append((False, text[pos:]))
    return out


def _plain(pieces, errors: list[str], where: str) -> str:
    for is_tag, s in pieces:
        if is_tag:
            errors.append(f"unexpected {s} in {where}, dropped")
    return "".join(s for is_tag, s in pieces if not is_tag)


def _read_until(pieces, k: int, close: str) -> tuple[str, int, bool]:
    """Plain text from pieces[k] up to the tag `close` (consumed). Stops without consuming at
    any other tag: (text, next index, closed?)."""
    text = []
    while k < len(pieces) and not pieces[k][0]:
        text.append(pieces[k][1])
        k += 1
    if k < len(pieces) and pieces[k] == (True, close):
        return "".join(text), k + 1, True
    return "".join(text), k, False


def _parse_call(pieces, k: int, errors: list[str], schemas: dict[str, dict[str, str]]
                ) -> tuple[ToolCall | None, int]:
    """Parse one call starting after <tool_call>; returns (call or None, next index)."""
    name, k, _ = _read_until(pieces, k, "")
    name = name.strip()
    label, schema = f"tool call {name!r}", schemas.get(name, {})
    args: dict[str, Any] = {}
    closed = False
    while k < len(pieces):
        is_tag, s = pieces[k]
        if not is_tag:
            if s.strip():
                errors.append(f"{label}: stray text {s[:40]!r} ignored")
            k += 1
        elif s == END_TOOL_CALL:
            closed, k = True, k + 1
            break
        elif s == ARG_KEY:
            key, k, ok = _read_until(pieces, k + 1, END_ARG_KEY)
            key = key.strip()
            if not ok:
                errors.append(f"{label}: unterminated {ARG_KEY} {key!r}")
            if k < len(pieces) and not pieces[k][0] and not pieces[k][1].strip():
                k += 1                             # whitespace between </arg_key> and <arg_value>
            if k < len(pieces) and pieces[k] == (True, ARG_VALUE):
                raw, k, ok = _read_until(pieces, k + 1, END_ARG_VALUE)
                if not ok:
                    errors.append(f"{label}: unterminated {ARG_VALUE} for {key!r}")
                if not key:
                    errors.append(f"{label}: empty argument key, value dropped")
                    continue
                if key in args:
                    errors.append(f"{label}: duplicate argument {key!r}, last one kept")
                args[key] = parse_value(raw, schema.get(key))
            else:
                errors.append(f"{label}: missing {ARG_VALUE} for {key!r}, argument dropped")
        elif s == ARG_VALUE:
            _, k, _ = _read_until(pieces, k + 1, END_ARG_VALUE)
            errors.append(f"{label}: {ARG_VALUE} without {ARG_KEY}, dropped")
        elif s == TOOL_CALL:
            break                                  # the next call starts; this one is unclosed
        else:
            errors.append(f"{label}: unexpected {s}, dropped")
            k += 1
    if not closed:
        errors.append(f"{label}: unclosed {TOOL_CALL}")
    if not name:
        errors.append("tool call without a name dropped")
        return None, k
    try:       # e.g. a JSON value that decodes to a special-token string ("\u003cthink>")
        return ToolCall(name, args), k
    except ValueError as e:
        errors.append(f"{label}: {e}; call dropped")
        return None, k


def parse_assistant(text: str, tools: Sequence[dict] | None = None) -> ParseResult:
    """Generated text (everything after <|assistant|>, optionally ending with a stop token) ->
    the assistant Message. Malformed output never raises: what can be recovered is returned and
    every problem is listed in `errors`. `tools` (OpenAI format) types the argument values."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    errors: list[str] = []
    pieces = _pieces(text)
    stop = None
    for i, (is_tag, s) in enumerate(pieces):
        if is_tag and s in STOP_TOKENS:
            stop = s
            if pieces[i + 1:]:
                errors.append(f"text after the stop token {s} ignored")
            pieces = pieces[:i]
            break

    reasoning, k = "", 0
    if len(pieces) > 1 and not pieces[0][0] and not pieces[0][1].strip() and pieces[1] == (True, THINK):
        k = 1                                       # tolerate whitespace before <think>
    first_call = next((j for j, p in enumerate(pieces) if p == (True, TOOL_CALL)), len(pieces))
    if k < len(pieces) and pieces[k] == (True, THINK):
        end = next((j for j in range(k + 1, len(pieces)) if pieces[j] == (True, END_THINK)), None)
        if end is None:
            # Reasoning runs to the first tool call (then parsed as usual) or to the end.
            errors.append(f"unterminated {THINK}: reasoning taken up to the first {TOOL_CALL} or the end")
            reasoning, k = _plain(pieces[k + 1:first_call], errors, "reasoning"), first_call
        else:
            reasoning, k = _plain(pieces[k + 1:end], errors, "reasoning"), end + 1
    elif (True, END_THINK) in pieces[:first_call]:
        end = pieces.index((True, END_THINK))
        errors.append(f"{END_THINK} without {THINK}: the text before it is taken as reasoning")
        reasoning, k = _plain(pieces[:end], errors, "reasoning"), end + 1

    first_call = next((j for j in range(k, len(pieces)) if pieces[j] == (True, TOOL_CALL)), len(pieces))
    content = _plain(pieces[k:first_call], errors, "content")
    schemas = _tool_schema(tools)
    calls, k = [], first_call
    while k < len(pieces):
        is_tag, s = pieces[k]
        if (is_tag, s) == (True, TOOL_CALL):
            call, k = _parse_call(pieces, k + 1, errors, schemas)
            if call is not None:
                calls.append(call)
            continue
        if is_tag:
            errors.append(f"unexpected {s} after the tool calls, dropped")
        elif s.strip():
            errors.append(f"text between tool calls ignored: {s[:40]!r}")
        k += 1
    if tools is not None:
        for c in calls:
            if c.name not in schemas:
                errors.append(f"tool call {c.name!r}: no such tool")
    return ParseResult(Message("assistant", content=content, reasoning=reasoning, tool_calls=tuple(calls)),
                       tuple(errors), stop)


def reply_text(m: Message) -> str:
    """What the model generates for a thinking-off turn's assistant message `m`, its end token
    included: the content and tool calls after the template's empty think block, then
    <|observation|> after tool calls, <|endoftext|> otherwise (reply_ids' `raw`)."""
    if m.reasoning:
        raise ValueError("reply_text: a thinking-off turn has no reasoning")
    return assistant_text(m)[len(THINK + END_THINK):] + (OBSERVATION if m.tool_calls else EOS)


def reply_ids(tokenizer, prompt: str, raw: str, max_len: int, tools: Sequence[dict] | None = None
              ) -> tuple[list[int], int]:
    """The ids of a one-turn conversation, thinking off: the user's `prompt` (after the tools'
    system prompt when `tools` are declared) and the assistant's `raw` reply as the model wrote it,
    special tokens included (tool calls, the end token; a malformed call stays malformed). The
    last max_len ids are kept, with where the reply starts in them."""
    head = encode(tokenizer, [Message("user", prompt, thinking=False)], tools, thinking_mode="turn",
                  add_generation_prompt=True).ids
    ids = head + tokenizer.encode(raw, add_special_tokens=False).ids
    cut = max(0, len(ids) - max_len)
    return ids[cut:], max(1, len(head) - cut)
