"""Reading a model's own tool calls out of its reply text: vLLM's tool-call parsers, for tool_choice "auto".

Under "auto" the model decides whether to call a tool and writes the call in the format its chat template taught
it; a parser per format (`vlens serve --enable-auto-tool-choice --tool-call-parser NAME`, vLLM's flags and names)
finds the calls and the text around them. A reply it cannot read as calls (no call, or a malformed one) stays text,
as vLLM leaves it. While a reply streams, `content_end` says how much of it is surely text: that much streams as
content, the rest waits for the end of the reply, where the calls go out whole.
"""

from __future__ import annotations

import ast
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


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
            calls = [_call(call["name"], call["arguments"]) for call in found]
        except (ValueError, TypeError, KeyError):
            return None
        return Parsed(text[:start] or None, calls)

    def content_end(self, text: str) -> int:
        return before_marker(text, self.START)


class Llama3Json(ToolParser):
    """Llama 3.1's and 3.2's JSON format: the whole reply is `{"name": ..., "parameters": {...}}` objects (or
    "arguments"), separated by "; ", after `<|python_tag|>` where the text keeps special tokens."""

    TAG: ClassVar[str] = "<|python_tag|>"

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
        except (ValueError, TypeError, KeyError):
            return None
        return Parsed(None, calls)

    def content_end(self, text: str) -> int:
        return 0 if text.startswith(("{", self.TAG)) or self.TAG.startswith(text) else len(text)


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


# vLLM's names (its llama4_* parsers read these formats: Llama 4's JSON and pythonic calls)
PARSERS: dict[str, ToolParser] = {
    "hermes": Hermes(), "llama3_json": Llama3Json(), "llama4_json": Llama3Json(), "pythonic": Pythonic(),
    "llama4_pythonic": Pythonic(), "mistral": Mistral(),
}  # fmt: skip
