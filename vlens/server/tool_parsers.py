"""Reading a model's own tool calls out of its reply text: vLLM's tool-call parsers, for tool_choice "auto".

Under "auto" the model decides whether to call a tool and writes the call in the format its chat template taught
it; a parser per format (`vlens serve --enable-auto-tool-choice --tool-call-parser NAME`, vLLM's flags and names)
finds the calls and the text around them. A reply it cannot read as calls (no call, or a malformed one) stays text,
as vLLM leaves it. While a reply streams, `content_end` says how much of it is surely text: that much streams as
content. A format whose calls are JSON objects (Hermes', Llama 3's) says where each call's arguments lie in the text
so far (`spans`), so that they stream as they are written, each call opened once its name is whole, as vLLM streams
them; their arguments are the text the model wrote, streamed or not. So do Mistral's calls from its v11 tokenizers
on; the other formats' calls go out whole at the reply's end.
"""

from __future__ import annotations

import ast
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class CallSpan:
    """A call in a reply so far: its name (None until its string is whole), and where the JSON text of its arguments
    starts and ends in the reply (None: not yet)."""

    name: str | None
    start: int | None
    end: int | None


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def json_end(text: str, at: int) -> int | None:
    """Where the JSON value that starts at `at` ends (just past it); None where the text ends first (or a scalar may
    still grow)."""
    if at >= len(text):
        return None
    if text[at] == '"':
        i = at + 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
            elif text[i] == '"':
                return i + 1
            else:
                i += 1
        return None
    if text[at] in "{[":
        depth, i = 0, at
        while i < len(text):
            if text[i] == '"':
                end = json_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            depth += {"{": 1, "[": 1, "}": -1, "]": -1}.get(text[i], 0)
            i += 1
            if depth == 0:
                return i
        return None
    end = at
    while end < len(text) and text[end] not in ",}] \t\r\n":
        end += 1
    return end if end < len(text) else None


def call_object(text: str, at: int, keys: tuple[str, ...]) -> tuple[CallSpan, int | None]:
    """The call whose JSON object starts at `at` (its "name", its arguments under one of `keys`, members in any
    order) as far as the text goes, and where the object ends (None: not yet, or not an object)."""
    name = start = end = None
    i = _skip_space(text, at)
    if i >= len(text) or text[i] != "{":
        return CallSpan(None, None, None), None
    i += 1
    while True:
        i = _skip_space(text, i)
        if i >= len(text) or text[i] not in '"},':
            return CallSpan(name, start, end), None
        if text[i] == "}":
            return CallSpan(name, start, end), i + 1
        if text[i] == ",":
            i += 1
            continue
        key_end = json_end(text, i)
        colon = len(text) if key_end is None else _skip_space(text, key_end)
        if colon >= len(text) or text[colon] != ":":
            return CallSpan(name, start, end), None
        key, i = json.loads(text[i:key_end]), _skip_space(text, colon + 1)
        value_end = json_end(text, i)
        if key == "name" and value_end is not None and text[i] == '"':
            name = json.loads(text[i:value_end])
        elif key in keys and i < len(text):
            start, end = i, value_end
        if value_end is None:
            return CallSpan(name, start, end), None
        i = value_end


def raw_arguments(calls: list[tuple[str, str]], spans: list[CallSpan], text: str) -> list[tuple[str, str]]:
    """Calls read whole, each with its arguments as the model wrote them (the text their spans hold, as they
    streamed); ValueError where the spans are not those calls'."""
    if len(spans) != len(calls) or any(span.start is None or span.end is None for span in spans):
        raise ValueError("the calls' spans do not match them")
    return [(name, text[span.start : span.end]) for (name, _), span in zip(calls, spans)]


@dataclass(frozen=True)
class Parsed:
    """A reply read as tool calls: the text outside them (None where there is none) and each call's name and
    arguments (JSON text, as OpenAI's `arguments`)."""

    content: str | None
    calls: list[tuple[str, str]]


class ToolParser(ABC):
    # the format's markers are special tokens, which the reply's text must keep (the request's skip_special_tokens
    # is then false unless it says otherwise, as vLLM's parser sets it)
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str) -> Parsed | None:
        """The reply's calls, or None where it makes none (or none that can be read)."""

    @abstractmethod
    def content_end(self, text: str) -> int:
        """The length of the prefix of a reply so far that is text whatever follows."""

    def spans(self, text: str, done: bool = True) -> list[CallSpan] | None:
        """The calls in a reply so far (`done`: the whole reply), for a format whose calls stream (None: they go out
        whole at its end)."""
        return None


def _call(name: Any, arguments: Any) -> tuple[str, str]:
    """A call as (name, arguments as JSON text); TypeError for a name that is not text."""
    if not isinstance(name, str):
        raise TypeError(name)
    return name, json.dumps(arguments, ensure_ascii=False)


def before_marker(text: str, marker: str) -> int:
    """How much of `text` comes before `marker`: up to where it starts, or else to a suffix that may grow into it."""
    start = text.find(marker)
    return start if start >= 0 else unmatched_tail(text, marker)


def unmatched_tail(text: str, marker: str) -> int:
    """Where a suffix of `text` that may grow into `marker` starts (len(text) where none)."""
    for start in range(max(0, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[start:]):
            return start
    return len(text)


class Hermes(ToolParser):
    """Hermes' and Qwen's format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, after text or not;
    the last call may lack its closing tag (the reply ended at the stop token)."""

    START: ClassVar[str] = "<tool_call>"
    _CALL: ClassVar[re.Pattern] = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def parse(self, text: str) -> Parsed | None:
        start = text.find(self.START)
        if start < 0:
            return None
        try:
            found = [json.loads(closed or open_) for closed, open_ in self._CALL.findall(text)]
            calls = raw_arguments([_call(call["name"], call["arguments"]) for call in found], self.spans(text), text)
        except (ValueError, TypeError, KeyError):
            return None
        return Parsed(text[:start] or None, calls)

    def content_end(self, text: str) -> int:
        return before_marker(text, self.START)

    def spans(self, text: str, done: bool = True) -> list[CallSpan]:
        starts = [m.end() for m in re.finditer(re.escape(self.START), text)]
        return [call_object(text, at, ("arguments",))[0] for at in starts]


class Llama3Json(ToolParser):
    """Llama 3.1's and 3.2's JSON format: the whole reply is `{"name": ..., "parameters": {...}}` objects (or
    "arguments"), separated by "; ", after `<|python_tag|>` where the text keeps special tokens."""

    TAG: ClassVar[str] = "<|python_tag|>"

    KEYS: ClassVar[tuple[str, str]] = ("arguments", "parameters")

    def parse(self, text: str) -> Parsed | None:
        at = len(self.TAG) if text.startswith(self.TAG) else 0
        if not text[at:].startswith("{"):
            return None
        decoder, calls = json.JSONDecoder(), []
        try:
            while at < len(text):
                call, end = decoder.raw_decode(text, at)
                calls.append(_call(call["name"], call["arguments"] if "arguments" in call else call["parameters"]))
                at = end + len("; ")
            calls = raw_arguments(calls, self.spans(text), text)
        except (ValueError, TypeError, KeyError):
            return None
        return Parsed(None, calls)

    def content_end(self, text: str) -> int:
        return 0 if text.startswith(("{", self.TAG)) or self.TAG.startswith(text) else len(text)

    def spans(self, text: str, done: bool = True) -> list[CallSpan]:
        at, spans = len(self.TAG) if text.startswith(self.TAG) else 0, []
        while at < len(text):
            span, end = call_object(text, at, self.KEYS)
            spans.append(span)
            if end is None or not text.startswith("; ", end):
                break
            at = end + len("; ")
        return spans


class Pythonic(ToolParser):
    """Llama 3.2's and 4's pythonic format: the whole reply is a Python list of calls with literal keyword
    arguments, `[get_weather(city="Paris"), get_time()]`, between `<|python_start|>` and `<|python_end|>` where the
    text keeps special tokens."""

    START: ClassVar[str] = "<|python_start|>"
    END: ClassVar[str] = "<|python_end|>"

    def parse(self, text: str) -> Parsed | None:
        source = text.strip().removeprefix(self.START).removesuffix(self.END).strip()
        if not source.startswith("["):
            return None
        try:
            listed = ast.parse(source, mode="eval").body
            if not isinstance(listed, ast.List) or not listed.elts:
                return None
            return Parsed(None, [self._call(node) for node in listed.elts])
        except (SyntaxError, ValueError, TypeError, RecursionError):
            return None

    @staticmethod
    def _call(node: ast.expr) -> tuple[str, str]:
        """A call by name with literal keyword arguments only; ValueError for anything else."""
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(kw.arg is not None for kw in node.keywords)):  # fmt: skip
            raise ValueError("not a call of a tool by name with keyword arguments")
        return _call(node.func.id, {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords})

    def content_end(self, text: str) -> int:
        head = text.lstrip()
        return 0 if head.startswith(("[", self.START)) or self.START.startswith(head) else len(text)


class Mistral(ToolParser):
    """Mistral's format, after text or not, the calls after its special token `[TOOL_CALLS]`: each
    `[TOOL_CALLS]name{...}` (or `name[ARGS]{...}`) with tokenizers from v11 (Mistral Small 3.1 on, Ministral 3), or
    one JSON array of {"name", "arguments"} objects before (Mistral 7B v0.3). As vLLM's, a v11 call's arguments are
    returned as written, JSON or not."""

    START: ClassVar[str] = "[TOOL_CALLS]"
    keeps_special_tokens: ClassVar[bool] = True

    def parse(self, text: str) -> Parsed | None:
        content, *raw = text.split(self.START)
        if not raw:
            return None
        try:
            if raw[0].lstrip().startswith("["):  # (before v11: one array)
                listed, _ = json.JSONDecoder().raw_decode(raw[0].strip())
                calls = [_call(call["name"], call.get("arguments", {})) for call in listed]
            else:
                calls = [(name.replace("[ARGS]", ""), "{" + arguments)
                         for name, _, arguments in (call.partition("{") for call in raw if "{" in call)]  # fmt: skip
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        return Parsed(content or None, calls) if calls else None

    def content_end(self, text: str) -> int:
        return before_marker(text, self.START)

    def spans(self, text: str, done: bool = True) -> list[CallSpan] | None:
        """From v11, each call once its name is whole (at its arguments' "{"), its arguments the text up to the next
        call's marker (the last's, before the reply's end, short of a marker that may be being written); calls
        without arguments are no calls, as parse reads them. A pre-v11 array goes out whole at the end."""
        content, *raw = text.split(self.START)
        if raw and raw[0].lstrip().startswith("["):
            return None
        spans, at = [], len(content)
        for i, call in enumerate(raw):
            at += len(self.START)
            brace = call.find("{")
            if brace >= 0:
                end = at + len(call) if i < len(raw) - 1 else len(text) if done else unmatched_tail(text, self.START)
                spans.append(CallSpan(call[:brace].replace("[ARGS]", ""), at + brace, end))
            at += len(call)
        return spans


# vLLM's names (its llama4_* parsers read these formats: Llama 4's JSON and pythonic calls)
PARSERS: dict[str, ToolParser] = {
    "hermes": Hermes(), "llama3_json": Llama3Json(), "llama4_json": Llama3Json(), "pythonic": Pythonic(),
    "llama4_pythonic": Pythonic(), "mistral": Mistral(),
}  # fmt: skip
