"""OpenAI's function tools on chat completions (vlens.server.tools), on SmolLM2 under a chat template that renders
tools and tool calls in Hermes' way: the tools, an assistant's calls and the tool messages that answer them go into
the template as HF's apply_chat_template takes them (LLM.chat's `tools` too); tool_choice "required" or a named
function makes the reply a structured output read back as tool calls, equal to the offline request with the same
JSON schema, streamed and not (the openai client's parse); "auto" (the server's Hermes parser) reads the calls the
model makes in its own format, streaming the text before them; "none" leaves the reply text; choices the tools cannot
meet are 400s naming tool_choice."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_helpers import running_server
from test_stream_reading import _joined

from vlens import LLM, SamplingParams, StructuredOutputsParams
from vlens.server.config import ServerConfig

TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Today's weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
REQUIRED = {"type": "array", "minItems": 1, "items": {"anyOf": [  # vLLM's schema of "required"
    {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": WEATHER},
     "required": ["name", "parameters"]},
    {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_time"]},
                                      "parameters": {"type": "object", "properties": {}}},
     "required": ["name", "parameters"]}]}}  # fmt: skip
GREEDY = {"max_tokens": 60, "temperature": 0}


@pytest.fixture(scope="module")
def server(served_smol):
    """SmolLM2 (the real one: a cut model's JSON may never end) served under TEMPLATE (--chat-template), with
    Hermes' tool-call parser; the offline references come from another LLM (`smol`: an LLM the server's engine
    thread steps must not be stepped from the test's thread too)."""
    config = ServerConfig(served_model_name="smol", chat_template=TEMPLATE, enable_auto_tool_choice=True,
                          tool_call_parser="hermes")  # fmt: skip
    with running_server(served_smol, config) as url:
        yield url


@pytest.fixture(scope="module")
def llm(smol) -> LLM:
    return smol


def _chat(llm: LLM, messages: list[dict], params: SamplingParams):
    [out] = llm.chat(messages, params, tools=TOOLS, chat_template=TEMPLATE, use_tqdm=False)
    return out


def _offline(llm: LLM, schema: dict) -> str:
    params = SamplingParams(**GREEDY, structured_outputs=StructuredOutputsParams(json=schema))
    return _chat(llm, MESSAGES, params).outputs[0].text


def test_tools_and_calls_render_as_hfs_template_renders_them(llm, server):
    tok = llm.tokenizer

    def hf(conversation: list[dict]) -> list[int]:
        text = tok.apply_chat_template(conversation, tools=TOOLS, chat_template=TEMPLATE, add_generation_prompt=True,
                                       tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    out = _chat(llm, MESSAGES, SamplingParams(max_tokens=1))
    assert out.prompt_token_ids == hf(MESSAGES)
    assert "get_weather" in out.prompt and "Today's weather" in out.prompt
    with pytest.raises(ValueError, match=r"^tools: expected a list of tools"):
        llm.chat(MESSAGES, tools=TOOLS[0], chat_template=TEMPLATE)
    # a second turn: the assistant's call (its arguments JSON text, as a client sends them) and the tool's answer
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]  # fmt: skip
    got = httpx.post(server + "/tokenize", json={"messages": turns, "tools": TOOLS}, timeout=60).json()["tokens"]
    as_hf = [*turns[:1], {**turns[1], "tool_calls": [{**call, "function": {**call["function"],
                                                                           "arguments": {"city": "Paris"}}}]}, turns[2]]
    assert got == hf(as_hf)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in tok.decode(got)


def test_a_named_function_s_call_is_the_structured_reply(llm, server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model="smol", messages=MESSAGES, tools=TOOLS, tool_choice=named, **GREEDY)
    choice = out.choices[0]
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, choice.message.content, choice.finish_reason) == (
        "function", "get_weather", "", "stop")  # fmt: skip
    assert call.function.arguments == _offline(llm, WEATHER) and call.id.startswith("chatcmpl-tool-")
    assert set(json.loads(call.function.arguments)) == {"city", "unit"}
    streamed = list(client.chat.completions.create(model="smol", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                                   stream=True, **GREEDY))  # fmt: skip
    # streamed, the arguments go out as they come (vLLM's): the call opens with its id and name, then its pieces
    assert streamed[0].choices[0].delta.role == "assistant"
    pieces = [d for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert pieces[0].id.startswith("chatcmpl-tool-") and pieces[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in pieces[1:]) and len(pieces) > 5
    assert "".join(d.function.arguments for d in pieces) == call.function.arguments
    assert not any(c.choices[0].delta.content for c in streamed if c.choices)
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "stop"


def test_required_calls_are_read_from_their_json_array(llm, server):
    rome = [{"role": "user", "content": "Weather in Rome, fahrenheit?"}]
    body = {"model": "smol", "messages": rome, "tools": TOOLS, "tool_choice": "required", **GREEDY}
    choice = httpx.post(server + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    params = SamplingParams(**GREEDY, structured_outputs=StructuredOutputsParams(json=REQUIRED))
    offline = _chat(llm, rome, params)
    want = [(c["name"], c["parameters"]) for c in json.loads(offline.outputs[0].text)]
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
    assert got == want and got[0][0] == "get_weather" and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == ""
    # streamed, each call opens with its name, then its arguments go out as they are written (vLLM's)
    chunks = _chunks(server, body)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    joined = _joined(deltas)
    assert joined == [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert len([d for d in deltas if d.get("tool_calls")]) > 5  # (not whole at the end)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # MESSAGES's reply is three calls (the weather in Paris twice, then in Rome); parallel_tool_calls false: one
    one = body | {"messages": MESSAGES, "parallel_tool_calls": False}
    choice = httpx.post(server + "/v1/chat/completions", json=one, timeout=120).json()["choices"][0]
    assert len(choice["message"]["tool_calls"]) == 1 and choice["finish_reason"] == "tool_calls"


def test_none_leaves_the_reply_text(llm, server):
    body = {"model": "smol", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    message = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    want = _chat(llm, MESSAGES, SamplingParams(max_tokens=8, temperature=0))
    assert message["content"] == want.outputs[0].text and "tool_calls" not in message


# The reply "auto" gets from a model that calls a tool in Hermes' format (SmolLM2 is held to it by a regex: it was
# never taught to call tools), after a sentence of its own
CALLING = (r'Let me check the weather\.\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
           r'"unit": "(celsius|fahrenheit)"\}\}</tool_call>')  # fmt: skip


def _chunks(server: str, body: dict) -> list[dict]:
    lines = httpx.post(server + "/v1/chat/completions", json=body | {"stream": True}, timeout=120).text.splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_auto_reads_the_calls_the_model_makes_in_its_own_format(llm, server):
    structure = {"structured_outputs": {"regex": CALLING}}
    body = {"model": "smol", "messages": MESSAGES, "tools": TOOLS, **structure, **GREEDY}  # (tool_choice: "auto")
    choice = httpx.post(server + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    params = SamplingParams(**GREEDY, structured_outputs=StructuredOutputsParams(regex=CALLING))
    offline = _chat(llm, MESSAGES, params)
    text = offline.outputs[0].text
    said, call = text.split("<tool_call>")
    call = json.loads(call.removesuffix("</tool_call>"))
    assert said == "Let me check the weather.\n" and call["arguments"]["city"] in ("Paris", "Rome")
    [got] = choice["message"]["tool_calls"]
    assert (got["function"]["name"], json.loads(got["function"]["arguments"])) == ("get_weather", call["arguments"])
    assert (choice["message"]["content"], choice["finish_reason"]) == (said, "tool_calls")
    # streamed: the sentence as content deltas (never a piece of the call), then the call as it is written
    chunks = _chunks(server, body)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == said
    assert _joined(deltas) == [("get_weather", got["function"]["arguments"])]
    assert len([d for d in deltas if d.get("tool_calls")]) > 5  # (not whole at the end)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_without_calls_is_the_reply_text(llm, server):
    body = {"model": "smol", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 12,
            "temperature": 0}  # fmt: skip
    choice = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    want = _chat(llm, MESSAGES, SamplingParams(max_tokens=12, temperature=0))
    text = want.outputs[0].text
    assert "<tool_call>" not in text and (choice["message"]["content"], choice["finish_reason"]) == (text, "length")
    assert not choice["message"].get("tool_calls")
    deltas = [chunk["choices"][0]["delta"] for chunk in _chunks(server, body) if chunk["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == text and not any(d.get("tool_calls") for d in deltas)


def test_mistrals_parser_keeps_the_special_tokens_its_calls_start_with(smol4):
    """Mistral's [TOOL_CALLS] is a special token, which the text must keep for the parser to see it: a request with
    tools on a server with the mistral parser runs with skip_special_tokens false (vLLM's), unless it says; its calls
    are read as vLLM reads them. (SmolLM2 has no [TOOL_CALLS]: its own special token <|im_start|> stands for one, the
    only token a request allows; a regex writes the calls.)"""
    special = smol4.tokenizer.convert_tokens_to_ids("<|im_start|>")
    config = ServerConfig(served_model_name="smol", enable_auto_tool_choice=True, tool_call_parser="mistral")
    only_special = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2, "allowed_token_ids": [special]}
    calling = {"messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 40,
               "structured_outputs": {"regex": r'\[TOOL_CALLS\]get_weather\{"city": "(Paris|Rome)"\}'}}  # fmt: skip
    with running_server(smol4, config) as url:
        kept, skipped, called = (
            httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
            for body in (only_special, only_special | {"skip_special_tokens": True}, calling))  # fmt: skip
    assert (kept["content"], skipped["content"]) == ("<|im_start|>" * 2, "")
    [call] = called["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"] in (
        "Paris", "Rome")  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "needs a tool named 'nope'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools to choose from"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
         "one structure per request; this one also sets tool_choice"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}], "tool_choice": "none"},
         "tools.0.function.name", "required field missing"),
        # (a schema that does not compile: the field it came from, not structured_outputs)
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          "tool_choice": "required"}, "tool_choice", 'Unsupported type "nonsense"'),
    ],
)
def test_tool_choices_the_tools_cannot_meet_are_refused_by_name(server, fields, param, message):
    body = {"model": "smol", "messages": MESSAGES, "max_tokens": 2} | fields
    out = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert out.status_code == (422 if param.startswith("tools.") else 400), out.text  # (422: the schema's)
    error = out.json()["error"]
    assert error["param"] == param and message in error["message"], error
