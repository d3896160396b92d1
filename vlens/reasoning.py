"""A reasoning model's thinking: DeepSeek-R1's, Qwen3's and DeepSeek-V3.1's replies think inside `<think>...</think>`
(the opening tag often in the prompt, put there by the chat template) and answer after it; gpt-oss's (OpenAI's harmony
format) in its analysis channel, its answer in the final channel after it. vLLM's reasoning parsers name them.

An engine made with a parser (`LLM(..., reasoning_parser=...)`, `vlens serve --reasoning-parser`) lets a structured
request think first, as vLLM's: its structure holds the text only after the thinking's end (ThinkingEnd); the server
splits such replies into their reasoning and their answer (vlens.server.reasoning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

START, END = "<think>", "</think>"
# gpt-oss: a reply opens its analysis channel (the prompt ends with `<|start|>assistant`), ends that message and opens
# the final channel's; special tokens all, which a reply's text keeps only with skip_special_tokens false
HARMONY_START = "<|channel|>analysis<|message|>"
HARMONY_END = "<|end|><|start|>assistant<|channel|>final<|message|>"


@dataclass(frozen=True)
class ThinkTags:
    """Replies that think between `start` and `end` (`<think>...</think>`), thinking `by_default` unless a request's
    `switches` (its chat template's variables, in chat_template_kwargs) say otherwise: a thinking model's false turns
    it off (Qwen3's enable_thinking=False), a switchable one's true on (DeepSeek-V3.1's thinking=True); off, the reply
    is all content. `special`: the tags are special tokens (gpt-oss's), so the server reads replies with
    skip_special_tokens false unless a request says."""

    switches: tuple[str, ...] = ()
    by_default: bool = True
    start: str = START
    end: str = END
    special: bool = False

    def thinking(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        given = chat_template_kwargs or {}
        if self.by_default:
            return all(given.get(switch, True) is not False for switch in self.switches)
        return any(bool(given.get(switch)) for switch in self.switches)


# vLLM's names: DeepSeek-R1 (and QwQ) always thinks; Qwen3 unless enable_thinking is false; DeepSeek-V3.1 only when
# thinking (or enable_thinking, as vLLM reads it too) is true; gpt-oss always (its reasoning_effort sets how long)
PARSERS = {"deepseek_r1": ThinkTags(), "qwen3": ThinkTags(("enable_thinking",)),
           "deepseek_v3": ThinkTags(("thinking", "enable_thinking"), by_default=False),
           "openai_gptoss": ThinkTags(start=HARMONY_START, end=HARMONY_END, special=True)}  # fmt: skip


@dataclass(frozen=True)
class ThinkingEnd:
    """The tags as the model's tokenizer spells them (one special token each in DeepSeek-R1's and Qwen3's; gpt-oss's
    end is its final channel's header), and whether the parser's model thinks unless its prompt says otherwise
    (ThinkTags.by_default)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    by_default: bool = True

    @classmethod
    def of(cls, tokenizer: Any, tags: ThinkTags) -> ThinkingEnd:
        if tokenizer is None:
            raise ValueError("reasoning_parser: needs the checkpoint's tokenizer, to find where the thinking ends")
        start, end = (tuple(tokenizer.encode(tag, add_special_tokens=False)) for tag in (tags.start, tags.end))
        return cls(start, end, tags.by_default)

    def thinks(self, ids: list[int]) -> bool:
        """Whether a reply to this prompt starts by thinking, by vLLM's rules. A thinking model's does unless the
        prompt's thinking is over: its last `</think>` after its last `<think>` (Qwen3's template with thinking off
        writes both; DeepSeek-R1's ends the prompt with `<think>`; templates drop earlier turns' thinking, and a
        prompt that keeps one's reads as thinking already done). A switchable one's (DeepSeek-V3.1's) only where the
        prompt opens a thinking it does not close (its template's thinking mode ends the prompt with `<think>`)."""
        opened, closed = _last(ids, self.start), _last(ids, self.end)
        return not closed > opened if self.by_default else opened > closed


def _last(ids: list[int], tag: tuple[int, ...]) -> int:
    """Where the last `tag` in `ids` starts; -1 where there is none."""
    n = len(tag)
    return next((i for i in range(len(ids) - n, -1, -1) if tuple(ids[i : i + n]) == tag), -1)
