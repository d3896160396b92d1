"""A reasoning model's thinking: DeepSeek-R1's and Qwen3's replies think inside `<think>...</think>` (the opening tag
often in the prompt, put there by the chat template) and answer after it; vLLM's reasoning parsers name them.

An engine made with a parser (`LLM(..., reasoning_parser=...)`, `vlens serve --reasoning-parser`) lets a structured
request think first, as vLLM's: its structure holds the text only after the thinking's end (ThinkingEnd); the server
splits such replies into their reasoning and their answer (vlens.server.reasoning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkTags:
    """`<think>...</think>` replies; `switchable`: the request's enable_thinking=False (Qwen3's template variable)
    turns the thinking off, and the reply is all content."""

    switchable: bool

    def thinking(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return not self.switchable or (chat_template_kwargs or {}).get("enable_thinking", True) is not False


PARSERS = {"deepseek_r1": ThinkTags(switchable=False), "qwen3": ThinkTags(switchable=True)}


@dataclass(frozen=True)
class ThinkingEnd:
    """The tags as the model's tokenizer spells them (one special token each in DeepSeek-R1's and Qwen3's)."""

    start: tuple[int, ...]
    end: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Any) -> ThinkingEnd:
        if tokenizer is None:
            raise ValueError("reasoning_parser: needs the checkpoint's tokenizer, to find where the thinking ends")
        return cls(*(tuple(tokenizer.encode(tag, add_special_tokens=False)) for tag in (START, END)))

    def ended(self, ids: list[int]) -> bool:
        """Whether a prompt's thinking is over before the reply starts, by vLLM's rule: its last `</think>` after its
        last `<think>` (Qwen3's template with thinking off writes both; DeepSeek-R1's ends the prompt with `<think>`;
        templates drop earlier turns' thinking, and a prompt that keeps one's reads as thinking already done)."""
        return _last(ids, self.end) > _last(ids, self.start)


def _last(ids: list[int], tag: tuple[int, ...]) -> int:
    """Where the last `tag` in `ids` starts; -1 where there is none."""
    n = len(tag)
    return next((i for i in range(len(ids) - n, -1, -1) if tuple(ids[i : i + n]) == tag), -1)
