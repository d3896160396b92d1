"""vLLM's tool-call parsers (vlens.server.tool_parsers) on reply texts: the calls and the text around them, replies
they leave as text, how much of a streaming reply goes out as content before its end, and the server flags that
turn tool_choice "auto" on (the end-to-end requests are in test_tools.py)."""

from __future__ import annotations

import pytest

from vlens.server.config import ServerConfig
from vlens.server.protocol import APIError, ChatRequest
from vlens.server.tool_parsers import PARSERS, Parsed

CASES = [
    # Hermes: text before the calls is content; the last call may lack its closing tag; arguments as JSON text
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
     '<tool_call>{"name": "g", "arguments": {}}',
     Parsed("Let me look.\n", [("f", '{"city": "Zürich"}'), ("g", "{}")])),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"n": [1, 2]}}</tool_call>',
     Parsed(None, [("f", '{"n": [1, 2]}')])),
    ("hermes", "Paris is sunny.", None),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"n": </tool_call>', None),  # (malformed: the text stays)
    ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>', None),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', None),
    # Llama 3 JSON: the whole reply is calls, "; "-separated, "parameters" or "arguments", after the python tag or not
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": "x"}}',
     Parsed(None, [("f", '{"a": 1}'), ("g", '{"b": "x"}')])),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}', Parsed(None, [("f", "{}")])),
    ("llama3_json", 'Here: {"name": "f", "parameters": {}}', None),
    ("llama3_json", '{"name": "f", "parameters": {}} and more', None),
    ("llama3_json", '{"name": "f"}', None),
    # pythonic: a list of calls with literal keyword arguments, inside python tags or not
    ("pythonic", '[get_weather(city="Paris", days=[1, 2]), get_time()]',
     Parsed(None, [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", "{}")])),
    ("pythonic", "<|python_start|>[f(a=None, b=True)]<|python_end|>", Parsed(None, [("f", '{"a": null, "b": true}')])),
    ("pythonic", "[f(1)]", None),  # (positional arguments have no names)
    ("pythonic", "[f(a=b)]", None),  # (not a literal)
    ("pythonic", "[os.system(a='x')]", None),
    ("pythonic", "[]", None),
    ("pythonic", "The answer is [f(a=1)]", None),
    # Mistral: from v11 each call after [TOOL_CALLS], its arguments as written (vLLM's); before v11 one JSON array
    ("mistral", 'Checking.[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     Parsed("Checking.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
    ("mistral", '[TOOL_CALLS]f{"a": ', Parsed(None, [("f", '{"a": ')])),  # (cut short: still a call, as vLLM's)
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g"}]',
     Parsed(None, [("f", '{"a": 1}'), ("g", "{}")])),
    ("mistral", "[TOOL_CALLS] [{\"name\": 3}]", None),
    ("mistral", "[TOOL_CALLS]no arguments", None),
    ("mistral", "Sunny [TOOL CALLS] today.", None),
]


@pytest.mark.parametrize(("name", "text", "want"), CASES)
def test_parsers_read_calls_as_vllms_do(name, text, want):
    assert PARSERS[name].parse(text) == want


@pytest.mark.parametrize(
    ("name", "reply"),
    [("hermes", 'Sure.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'), ("hermes", "Sure, a <b>tag</b>."),
     ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}'), ("llama3_json", "Hello there"),
     ("pythonic", '  [f(a="x")]'), ("pythonic", "<|python_start|>[f(a=1)]<|python_end|>"), ("pythonic", "No calls"),
     ("mistral", 'Sure.[TOOL_CALLS]f{"a": 1}'), ("mistral", "A [TOOL] of sorts.")],
)
def test_what_streams_as_content_is_never_part_of_a_call(name, reply):
    """Grown a character at a time, the content a parser lets out only grows, and ends as the parsed content (or
    the whole text where there are no calls): a client's joined deltas equal the reply's content."""
    parser, parsed = PARSERS[name], PARSERS[name].parse(reply)
    content = reply if parsed is None else parsed.content or ""
    ends = [parser.content_end(reply[:n]) for n in range(len(reply) + 1)]
    assert ends == sorted(ends) and all(end <= len(content) for end in ends)
    assert content.startswith(reply[: max(ends)])
    assert parsed is not None or ends[-1] == len(reply)


def test_auto_needs_the_servers_flags():
    body = ChatRequest(messages=[{"role": "user", "content": "hi"}],
                       tools=[{"type": "function", "function": {"name": "f"}}])  # fmt: skip
    with pytest.raises(APIError, match="--enable-auto-tool-choice and --tool-call-parser") as e:
        body.tool_reply(ServerConfig().tool_parser())
    assert e.value.param == "tool_choice"
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert body.tool_reply(config.tool_parser()).parser is PARSERS["hermes"]
    assert ServerConfig(tool_call_parser="hermes").tool_parser() is None  # (vLLM's: the parser alone is not "auto")
    with pytest.raises(ValueError, match="^enable_auto_tool_choice: needs a tool_call_parser, one of hermes, "):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="^tool_call_parser: "):
        ServerConfig(enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")
