"""OpenAI-shaped response bodies and stream chunks for completions and chat completions.

One `Shape` per endpoint knows the few things that differ (object names, where text goes, the
logprobs format); everything else is shared.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlens.outputs import Logprob
from vlens.reasoning import ThinkTags
from vlens.server.reasoning import split
from vlens.server.tools import ToolReply

TokenNamer = Callable[[int], str | None]  # a token id -> its name in log-probabilities


@dataclass
class _Stream:
    """A streamed chat choice read through parsers: its text so far, and how much of its reasoning and content
    went out."""

    text: str = ""
    reasoning: int = 0
    content: int = 0
    calls: list[int] = field(default_factory=list)  # per call opened, how much of its arguments went out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage, with `prompt_tokens_details.cached_tokens` (the prefix cache's) where given."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def _ranked(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda x: x[1].rank)[:k]  # (the row's own token, when not among them, ranks past k)


def completion_logprobs(
    tokens: list[int], entries: list[dict[int, Logprob] | None], k: int, text: TokenNamer, offset: int
) -> dict[str, list]:
    """The legacy completions format: parallel lists of tokens, their logprobs, top-k dicts, offsets.
    An echoed prompt's first token has no entry (nothing predicts it): null logprob and top-k."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        piece = text(token)
        out["tokens"].append(piece)
        out["token_logprobs"].append(None if entry is None else entry[token].logprob)
        out["top_logprobs"].append(None if entry is None else {text(t): lp.logprob for t, lp in _ranked(entry, k)})
        out["text_offset"].append(offset)
        offset += len(piece)
    return out


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: null for the first token, then token id -> {logprob, rank, decoded_token}."""
    return [
        None if entry is None else
        {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for t, lp in entry.items()}
        for entry in entries
    ]  # fmt: skip


@dataclass
class Echo:
    """A prompt as `echo` puts it before each of its choices: its text and tokens."""

    text: str
    token_ids: list[int]

    def before(
        self, entries: list[dict[int, Logprob] | None] | None, text: str, tokens: list[int], logprobs: list
    ) -> tuple[str, list[int], list]:
        """(text, tokens, logprob entries) of a choice with the prompt in front; `entries` are the
        prompt's (None when the request asked for no log-probabilities)."""
        return self.text + text, self.token_ids + tokens, (entries or [None] * len(self.token_ids)) + logprobs


def chat_logprobs(tokens: list[int], entries: list[dict[int, Logprob]], k: int, text: TokenNamer) -> dict[str, list]:
    """The chat format: one object per token with its bytes and its top-k alternatives."""

    def item(token: int, lp: Logprob) -> dict[str, Any]:
        piece = text(token)
        return {"token": piece, "logprob": lp.logprob, "bytes": list(piece.encode())}

    content = []
    for token, entry in zip(tokens, entries):
        content.append({**item(token, entry[token]), "top_logprobs": [item(t, lp) for t, lp in _ranked(entry, k)]})
    return {"content": content}


@dataclass
class Shape:
    """What differs between /v1/completions and /v1/chat/completions."""

    chat: bool
    model: str
    logprobs: int | None  # top-k asked for; None = no logprobs
    text: TokenNamer  # a token's name in logprobs: its text (engine.logprobs.TokenText), or its id
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    offsets: dict[int, int] = field(default_factory=dict)  # completions' text_offset per choice
    tools: ToolReply | None = None  # a chat's reply read back as tool calls (vlens.server.tools)
    thinking: ThinkTags | None = None  # a chat's reply read as a reasoning model's, its tags (vlens.server.reasoning)
    include_reasoning: bool = True  # ... its reasoning in the response (vLLM's include_reasoning)
    streams: dict[int, _Stream] = field(default_factory=dict)  # each streamed choice's, read so (by index)

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _logprobs(self, index: int, tokens: list[int], entries: list, delta_text: str) -> dict | None:
        if self.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(tokens, entries, self.logprobs, self.text)
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(delta_text)
        return completion_logprobs(tokens, entries, self.logprobs, self.text, offset)

    def choice(
        self,
        index: int,
        text: str,
        tokens: list[int],
        entries: list,
        finish_reason: str | None,
        stop_reason: int | str | None = None,
        delta: bool = False,
        first: bool = False,
    ) -> dict[str, Any]:
        """One choice: a full one, or a stream delta (delta=True; first=True adds the chat role)."""
        choice: dict[str, Any] = {"index": index}
        if not self.chat:
            choice["text"] = text
        elif self.tools is not None or self.thinking:
            finish_reason = self._read(choice, index, text, finish_reason, delta, first)
        elif delta:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = self._logprobs(index, tokens, entries, text)
        choice["finish_reason"] = finish_reason
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason  # as vLLM: the stop string or token id that ended it
        return choice

    def _read(
        self, choice: dict, index: int, text: str, finish_reason: str | None, delta: bool, first: bool
    ) -> str | None:  # fmt: skip
        """A reply read as a reasoning model's (its reasoning apart) and as tool calls (its content): its message,
        or streamed, the reasoning, the text its content surely has before any call and the calls as they are written
        (vlens.server.tools; a format that cannot stream them, every call whole at the end) as deltas, and at its end
        the rest. Text that is no calls ("required"'s JSON cut short, an "auto" reply without calls) stays content
        (content "" beside "required"'s or a named function's calls, as vLLM's; streamed, the calls' pieces that
        went out stay out). Returns the finish reason (vLLM's "tool_calls" where calls were made)."""
        message: dict[str, Any] = {"role": "assistant"} if first or not delta else {}
        done = not delta or finish_reason is not None
        stream = self.streams.setdefault(index, _Stream()) if delta else _Stream()
        stream.text += text
        reasoning, content = split(stream.text, done, self.thinking) if self.thinking else (None, stream.text)
        if reasoning is not None and self.include_reasoning and (len(reasoning) > stream.reasoning or not delta):
            message["reasoning"] = message["reasoning_content"] = reasoning[stream.reasoning:]
            stream.reasoning = len(reasoning)
        calls, pieces = None, None
        if self.tools is not None and content is not None:
            reply = content
            if done:
                content, calls = self.tools.read(reply)
            else:
                content = reply[: self.tools.content_end(reply)]
            pieces = self.tools.call_deltas(reply, stream.calls, done) if delta else None
        whole = calls is not None and pieces is None  # (calls that go out at the end, whole)
        if content is not None and (len(content) > stream.content or not delta or whole):
            message["content"] = content[stream.content:]
            stream.content = len(content)
        elif not delta:
            message["content"] = content
        if pieces:
            message["tool_calls"] = pieces
        elif whole:
            message["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)] if delta else calls
        choice["delta" if delta else "message"] = message
        return finish_reason if self.tools is None else self.tools.finish(finish_reason, calls is not None)

    def body(self, choices: list[dict], usage_: dict | None, **extra: Any) -> dict[str, Any]:
        """A full response (streamed=False) or a chunk, with `extra` top-level keys such as vlens."""
        obj = "chat.completion" if self.chat else "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage_ is not None:
            out["usage"] = usage_
        out.update(extra)
        return out

    def chunk(self, choices: list[dict], usage_: dict | None = None, **extra: Any) -> dict[str, Any]:
        out = self.body(choices, usage_, **extra)
        if self.chat:
            out["object"] = "chat.completion.chunk"
        return out
