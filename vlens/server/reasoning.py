"""A reasoning model's thinking apart from its answer: vLLM's reasoning parsers (`vlens serve --reasoning-parser`).

DeepSeek-R1's and Qwen3's replies think inside `<think>...</think>` (the opening tag often in the prompt, put there by
the chat template) and answer after it. With a parser, a chat reply's message carries the thinking as `reasoning`
(and `reasoning_content`, its older name, as vLLM keeps both) and the answer as `content`; streamed, each goes out
in its own deltas as it comes. A reply that stops while still thinking is all reasoning; Qwen3's with
`chat_template_kwargs: {"enable_thinking": false}` (no thinking asked for) is all content. A structured reply
(response_format, a forced tool choice) is content: its structure holds it from its first token, where vLLM first
lets the model think.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlens.server.tool_parsers import unmatched_tail

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkTags:
    """`<think>...</think>` replies; `switchable`: the request's enable_thinking=False (Qwen3's template variable)
    turns the thinking off, and the reply is all content."""

    switchable: bool

    def thinking(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return not self.switchable or (chat_template_kwargs or {}).get("enable_thinking", True) is not False


PARSERS = {"deepseek_r1": ThinkTags(switchable=False), "qwen3": ThinkTags(switchable=True)}


def split(text: str, done: bool) -> tuple[str, str | None]:
    """A thinking reply's (reasoning, content): the text before `</think>` (after `<think>` where the reply opens
    with it) and the text after it, None where there is none. Before the reply's end (`done` False) the content
    is what came after `</think>` so far ("" before it) and the reasoning what is surely reasoning: not a tag still
    being written."""
    if not done and START.startswith(text):
        return "", ""
    body = text.removeprefix(START)
    end = body.find(END)
    if end >= 0:
        content = body[end + len(END):]
        return body[:end], content if content or not done else None
    return (body, None) if done else (body[: unmatched_tail(body, END)], "")
