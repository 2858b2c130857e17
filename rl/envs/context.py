"""Context management for long tool-using episodes, as a pure function over the message list.

    keep-recent-k   only the last k tool results stay visible; older ones become ELIDED
    reset           when the (elided) history still counts more than max_tokens, it is cleared:
                    system messages and the first user message stay, with a note that the
                    earlier turns were removed (the environment's own state, e.g. files, stays)

manage_context returns (messages, rewritten). rewritten is True whenever the returned history is
not the input with messages appended, i.e. when an earlier message changed: the caller
(rl.agent.run_group) then forks the trajectory, because the token ids so far no longer extend
(TITO). Already-elided results are not changed again, so a history at most k results long comes
back unchanged and does not fork.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

from chat.template import Message, encode

ELIDED = "[result elided]"
RESET_NOTE = "[Context reset: {n} earlier messages were removed to stay under {max_tokens} tokens. " \
             "Tool state is kept; continue the task.]"


def manage_context(messages: Sequence[Message], keep_recent: int, max_tokens: int | None,
                   count_tokens: Callable[[list[Message]], int]) -> tuple[list[Message], bool]:
    if keep_recent < 0:
        raise ValueError(f"keep_recent must be >= 0, got {keep_recent}")
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0 or None, got {max_tokens}")
    out = list(messages)
    tool_idx = [i for i, m in enumerate(out) if m.role == "tool"]
    old = tool_idx[: max(0, len(tool_idx) - keep_recent)]
    rewritten = False
    for i in old:
        if out[i].content != ELIDED:
            out[i] = Message("tool", ELIDED)
            rewritten = True
    if max_tokens is not None and count_tokens(out) > max_tokens:
        first_user = next((i for i, m in enumerate(out) if m.role == "user"), None)
        if first_user is None:
            raise ValueError("cannot reset a history without a user message")
        keep = [m for m in out[:first_user] if m.role == "system"]
        task = out[first_user]
        dropped = len(out) - len(keep) - 1
        if dropped > 0:
            note = RESET_NOTE.format(n=dropped, max_tokens=max_tokens)
            base = task.content.split("\n\n[Context reset:", 1)[0]      # one note, not one per reset
            out = [*keep, Message("user", f"{base}\n\n{note}", thinking=task.thinking)]
            rewritten = True
    return out, rewritten


class TemplateTokenCounter:
    """count_tokens for manage_context: the chat template's token count of the history (with the
    generation prompt, i.e. what the next turn's prompt would be). Picklable."""

    def __init__(self, tokenizer, tools: list[dict] | None, thinking_mode: str = "turn"):
        self.tokenizer, self.tools, self.thinking_mode = tokenizer, tools, thinking_mode

    def __call__(self, messages: list[Message]) -> int:
        return len(encode(self.tokenizer, messages, self.tools, thinking_mode=self.thinking_mode,
                          add_generation_prompt=True).ids)


def context_manager(keep_recent: int, max_tokens: int | None, count_tokens: Callable[[list[Message]], int]
                    ) -> Callable[[list[Message]], tuple[list[Message], bool]]:
    """manage_context with its settings bound: what rl.agent.run_group takes as `context=`."""
    return functools.partial(manage_context, keep_recent=keep_recent, max_tokens=max_tokens,
                             count_tokens=count_tokens)
