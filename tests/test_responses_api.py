"""OpenAI's Responses API (vlens.server.responses_api, POST /v1/responses) through the openai client, on SmolLM2:
a response's text is the chat completion's reply to the same conversation (its instructions a system message), cut
by max_output_tokens into an "incomplete" response; streamed, the typed events in their order with the same text; a
forced function call as a function_call item; activations through the vlens extension; the input's items as chat
messages; what has no chat form refused by name (a reasoning model's thinking as a reasoning item: test_reasoning)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch
from server_helpers import decode_activations, running_server

from vlens import Capture, SamplingParams, StructuredOutputsParams
from vlens.server.config import ServerConfig
from vlens.server.protocol import APIError
from vlens.server.responses_api import ResponseForm, ResponsesRequest

INSTRUCTIONS = "Answer in one short sentence."
QUESTION = "What is the capital of France?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def server(served_smol):
    config = ServerConfig(served_model_name="smol", enable_capture=True)
    with running_server(served_smol, config) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def _offline(smol, messages: list[dict], max_tokens: int, **params):
    [out] = smol.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0, **params), use_tqdm=False)
    return out


def test_a_response_is_the_chat_reply_to_its_conversation(client, smol):
    want = _offline(smol, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], 5)
    text = want.outputs[0].text
    response = client.responses.create(model="smol", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=5,
                                       temperature=0, metadata={"run": "a"})  # fmt: skip
    assert response.output_text == text and response.id.startswith("resp_")
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # (cut at 5)
    [message] = response.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.output_tokens_details.reasoning_tokens) == (
        len(want.prompt_token_ids), 5, 0)  # fmt: skip
    assert (response.model, response.metadata, response.store, response.max_output_tokens) == ("smol", {"run": "a"},
                                                                                              False, 5)  # fmt: skip
    # streamed: the typed events in order, numbered, the same text, the whole response last
    events = list(client.responses.create(model="smol", instructions=INSTRUCTIONS, input=QUESTION,
                                          max_output_tokens=5, temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens == 5


def test_a_forced_function_call_is_a_function_call_item(client, smol):
    tool = {"type": "function", "name": "get_weather", "description": "Today's weather", "parameters": WEATHER}
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    want = _offline(smol, ask, 30, structured_outputs=StructuredOutputsParams(json=WEATHER)).outputs[0].text
    response = client.responses.create(model="smol", input=ask, tools=[tool], max_output_tokens=30, temperature=0,
                                       tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    [call] = response.output
    assert (call.type, call.name, call.arguments, call.status) == ("function_call", "get_weather", want, "completed")
    assert call.call_id.startswith("chatcmpl-tool-") and json.loads(want)["city"] in ("Paris", "Rome")
    named = {"type": "function", "name": "get_weather"}
    events = list(client.responses.create(model="smol", input=ask, tools=[tool], max_output_tokens=30, temperature=0,
                                          tool_choice=named, stream=True))  # fmt: skip
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (done.name, done.arguments) == ("get_weather", want)
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 5 and "".join(pieces) == want  # (as they come)
    assert events[-1].response.output[0].arguments == want


def test_activations_come_through_the_vlens_extension(server, smol):
    capture = {"hooks": ["blocks.2.hook_resid_post"], "positions": "generated"}
    body = {"model": "smol", "input": QUESTION, "max_output_tokens": 4, "temperature": 0, "vlens": {"capture": capture}}
    response = httpx.post(server + "/v1/responses", json=body, timeout=120).json()
    rows = decode_activations(response["vlens"]["activations"], server)["blocks.2.hook_resid_post"]
    params = SamplingParams(max_tokens=4, temperature=0, capture=Capture(**capture))
    [want] = smol.chat([{"role": "user", "content": QUESTION}], params, use_tqdm=False)
    offline = want.activations["blocks.2.hook_resid_post"]  # (the rows of the generated tokens fed back: 3 of 4)
    assert rows.shape == offline.shape == (3, 576) and torch.allclose(rows, offline, atol=1e-5)


def test_input_items_become_chat_messages():
    body = ResponsesRequest(instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}', "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # (dropped)
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny.",
                                                              "annotations": []}]},
    ], text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER}}, max_output_tokens=5)  # fmt: skip
    assert body.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
    ]  # fmt: skip
    chat = body.to_chat()
    assert chat.max_completion_tokens == 5 and chat.response_format.json_schema.schema_ == WEATHER
    with pytest.raises(APIError, match="^previous_response_id: vlens serve stores no responses") as e:
        ResponsesRequest(input="hi", previous_response_id="resp_1").to_chat()
    assert e.value.param == "previous_response_id"


@pytest.mark.parametrize(
    ("fields", "status", "param", "message"),
    [({"max_output_tokens": 10**6}, 400, "max_output_tokens", "max_output_tokens: 1000000 plus the"),
     ({"text": {"format": {"type": "json_schema", "name": "w"}}}, 400, "text.format.schema", "required"),
     ({"background": True}, 400, "background", "not supported"),
     ({"tools": [{"type": "web_search"}]}, 422, "tools.0.type", ""),
     ({"input": []}, 400, "input", "no messages")],
)  # fmt: skip
def test_what_has_no_chat_form_is_refused_by_name(server, fields, status, param, message):
    out = httpx.post(server + "/v1/responses", json={"model": "smol", "input": QUESTION} | fields, timeout=60)
    assert out.status_code == status, out.text
    error = out.json()["error"]
    assert error["param"].startswith(param) and message in error["message"], error


def test_a_stream_of_thinking_text_and_calls_becomes_items_in_order():
    """The events of a chat stream that thinks, says something and calls two tools (as a reasoning and a tool-call
    parser read it): each item opened, filled and closed before the next, the last event's response holding them."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    deltas = [{"role": "assistant"}, {"reasoning": "Think"}, {"reasoning": "ing."}, {"content": "Calling."},
              {"content": "", "tool_calls": [{"index": 0, **call}, {"index": 1, **call, "id": "c2"}]}]  # fmt: skip
    chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks[-1]["choices"][0]["finish_reason"] = "tool_calls"
    chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}})

    async def events() -> list[dict]:
        async def source():
            for chunk in chunks:
                yield chunk

        form = ResponseForm(ResponsesRequest(input="hi"), "m", lambda text: len(text.split()))
        lines = [line async for line in form.events(source())]
        return [json.loads(line.split("data: ", 1)[1]) for line in lines]

    got = asyncio.run(events())
    kinds = [e["type"] for e in got]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        *["response.output_item.added", "response.function_call_arguments.delta",
          "response.function_call_arguments.done", "response.output_item.done"] * 2,
        "response.completed"]  # fmt: skip
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    response = got[-1]["response"]
    assert [item["type"] for item in response["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert [item["content"][0]["text"] for item in response["output"][:2]] == ["Thinking.", "Calling."]
    assert [item.get("call_id") for item in response["output"][2:]] == ["c1", "c2"]
    assert [e["output_index"] for e in got if e["type"] == "response.output_item.done"] == [0, 1, 2, 3]
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 1 and response["status"] == "completed"
