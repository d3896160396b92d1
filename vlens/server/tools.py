"""OpenAI's function tools on chat completions, as vLLM serves them.

The tools go into the chat template (which renders them in the model's own format, as it does its assistant
messages' `tool_calls` and the `tool` messages that answer them). `tool_choice` "required" or a named function
makes the reply a structured output (vlens.engine.structured): a named function's arguments, or a JSON array of
{"name", "parameters"} objects, one of the tools each; the text is read back as `tool_calls` (vLLM's layout, finish
reasons and schema). "auto" leaves the choice to the model, whose calls in its own format the server's tool-call
parser finds (vlens.server.tool_parsers; without one, "auto" is a 400 naming the flags). "none" leaves the text.
Streamed, calls go out as they are written (vLLM's): each opens with its id and name once its name is whole, then its
arguments come piece by piece, the text the model writes (its arguments, streamed or not); a parser's format whose
calls are not JSON objects sends them whole at the reply's end.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from vlens.server.tool_parsers import CallSpan, ToolParser, call_object, raw_arguments

_NO_PARAMETERS = {"type": "object", "properties": {}}


def reply_schema(functions: list[dict[str, Any]], named: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON schema of the reply: the named function's parameters, or (named None: "required") an array of calls
    of the functions, at least one (only one, `parallel` false). A function's `$defs` move to the array's top, where
    its `#/$defs/...` references then point."""
    if named is not None:
        return next(f for f in functions if f["name"] == named).get("parameters") or _NO_PARAMETERS
    calls, defs = [], {}
    for f in functions:
        parameters = dict(f.get("parameters") or _NO_PARAMETERS)
        defs |= parameters.pop("$defs", {})
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                      "parameters": parameters}, "required": ["name", "parameters"]})  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class ToolReply:
    """How a reply's text becomes tool calls: `named`, the function tool_choice named; None, "required"; with a
    `parser`, "auto" (the model's own format)."""

    named: str | None
    parser: ToolParser | None = None

    def read(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """The reply as its content and OpenAI's tool_calls (None: the text is no calls, it stays content; so is
        "required"'s JSON cut short by max_tokens)."""
        if self.parser is not None:
            parsed = self.parser.parse(text)
            return (text, None) if parsed is None else (parsed.content, [_call(*call) for call in parsed.calls])
        if self.named is not None:
            return "", [_call(self.named, text)]
        try:
            listed = json.loads(text)
            if not (isinstance(listed, list) and listed):  # (no calls: the schema's array has one at least)
                return text, None
            named = [(call["name"], "") for call in listed]
            return "", [_call(*call) for call in raw_arguments(named, _array_spans(text), text)]
        except (ValueError, TypeError, KeyError):
            return text, None

    def call_deltas(self, text: str, sent: list[int], done: bool) -> list[dict[str, Any]] | None:
        """What a streamed reply's text so far adds to its calls: a call's opening piece (its index, id, name and the
        arguments written so far) once its name is whole and its arguments have started (or at the reply's end), then
        each later piece of its arguments; `sent` (updated): per opened call, how much of its arguments went out.
        None for a format whose calls go out whole at the end."""
        spans = self._spans(text, done)
        if spans is None:
            return None
        deltas = []
        for i, span in enumerate(spans):
            if span.name is None or (span.start is None and not done):
                break
            start = len(text) if span.start is None else span.start
            written = text[start : len(text) if span.end is None else span.end]
            if i == len(sent):
                if not (written or done):  # (a named function's call opens with the first of its reply)
                    break
                deltas.append({"index": i, **_call(span.name, written)})
                sent.append(len(written))
            elif len(written) > sent[i]:
                deltas.append({"index": i, "function": {"arguments": written[sent[i] :]}})
                sent[i] = len(written)
        return deltas

    def _spans(self, text: str, done: bool) -> list[CallSpan] | None:
        if self.parser is not None:
            return self.parser.spans(text, done)
        if self.named is not None:  # (the reply is its arguments)
            return [CallSpan(self.named, 0, None)]
        return _array_spans(text)

    def content_end(self, text: str) -> int:
        """How much of a streamed reply so far goes out as content before its end: under "auto", the text the
        parser knows is no call; otherwise none (the whole reply is the calls)."""
        return self.parser.content_end(text) if self.parser is not None else 0

    def finish(self, reason: str | None, called: bool) -> str | None:
        """vLLM's: calls the model made under "auto", and "required"'s calls complete, end with "tool_calls"; a
        named function's with the engine's reason."""
        if not called:
            return reason
        return "tool_calls" if self.parser is not None or (self.named is None and reason == "stop") else reason


def _array_spans(text: str) -> list[CallSpan]:
    """"required"'s calls so far: a JSON array of {"name", "parameters"} objects."""
    at, spans = len(text) - len(text.lstrip()), []
    if not text.startswith("[", at):
        return spans
    at += 1
    while True:
        span, end = call_object(text, at, ("parameters",))
        if span == CallSpan(None, None, None) and end is None:
            return spans
        spans.append(span)
        rest = text[end:].lstrip() if end is not None else ""
        if not rest.startswith(","):
            return spans
        at = len(text) - len(rest) + 1


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it: an assistant's tool calls with their arguments as objects (HF's
    convention; a client sends them as JSON text), as vLLM passes them."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        arguments = call["function"]["arguments"]
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = call["function"]["arguments"]  # (not JSON: the template gets the text)
        out.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**message, "tool_calls": out}
