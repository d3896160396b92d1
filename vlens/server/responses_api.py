"""OpenAI's Responses API, `POST /v1/responses`, as vLLM serves it.

A Responses request is a chat completion's in another form, so it runs as one (vlens.server.generate: the same
chat template, tool-call and reasoning parsers, vlens extension and engine) and its reply is presented as a
Response: output items (the reasoning, the message, each function call), a status ("incomplete" where
max_output_tokens cut it) and usage; streamed, as the Responses API's typed events. Nothing is stored, so
`previous_response_id` is refused (a client sends the conversation in `input`, output items included, as it does
with `store: false`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag, ValidationError

from vlens.server.protocol import APIError, ChatRequest, DocumentedAs, refuse_unknown, schema_error
from vlens.server.specs import ExtensionSpec

# Chat completion fields -> the Responses fields they come from, for the errors the chat path raises
_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")  # (output_text's annotations and logprobs, passed back)
    type: Literal["input_text", "output_text"]
    text: StrictStr


class InputImage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_image"]
    image_url: StrictStr  # a data: URL (base64): vlens fetches nothing
    detail: Literal["auto", "low", "high"] | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # (an output message's id and status, passed back)
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[Annotated[InputText | InputImage, Field(discriminator="type")]]

    def chat(self) -> dict[str, Any]:
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        def part(p: InputText | InputImage) -> dict[str, Any]:
            if isinstance(p, InputText):
                return {"type": "text", "text": p.text}
            return {"type": "image_url", "image_url": {"url": p.image_url, "detail": p.detail}}

        return {"role": self.role, "content": [part(p) for p in self.content]}


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")  # (its id and status, passed back)
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr


class FunctionCallOutput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr


class Reasoning(BaseModel):
    """A reasoning item passed back: dropped, as chat templates drop past turns' thinking."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]


def _kind(item: Any) -> str:
    return (item.get("type") if isinstance(item, dict) else getattr(item, "type", None)) or "message"


InputItem = Annotated[
    Annotated[Message, Tag("message")] | Annotated[FunctionCall, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")] | Annotated[Reasoning, Tag("reasoning")],
    Discriminator(_kind),
]  # fmt: skip


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: StrictStr


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # (OpenAI's default: the only one a model without the knob gives)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept for refuse_unknown, which names them
    NEUTRAL: ClassVar[dict[str, tuple]] = {
        "background": (None, False), "include": (None, []), "truncation": (None, "disabled"), "reasoning": (None,),
        "service_tier": (None, "auto", "default"), "prompt": (None,), "max_tool_calls": (None,),
        "top_logprobs": (None, 0), "conversation": (None,), "prompt_cache_key": (None,), "safety_identifier": (None,),
    }  # fmt: skip
    model: StrictStr | None = None
    input: StrictStr | list[InputItem]
    instructions: StrictStr | None = None  # a system message before the input
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: StrictBool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    previous_response_id: StrictStr | None = None  # (refused: nothing is stored)
    store: StrictBool | None = None  # (accepted; nothing is stored, and the response says store: false)
    metadata: dict[str, StrictStr] | None = None  # echoed in the response
    user: StrictStr | None = None
    # vLLM's fields of its Responses requests, as on chat completions
    seed: StrictInt | None = None
    top_k: StrictInt = Field(0, ge=-1)
    priority: StrictInt = 0
    cache_salt: StrictStr | None = Field(None, min_length=1)
    vlens: Annotated[dict[str, Any] | None, DocumentedAs(ExtensionSpec)] = None

    def to_chat(self) -> ChatRequest:
        """The chat completion request this one is; a 400 naming the field for what has no chat form."""
        refuse_unknown(self.model_extra, self.NEUTRAL)
        if self.previous_response_id is not None:
            raise APIError(400, "previous_response_id: vlens serve stores no responses; send the conversation in "
                           "input (the earlier output items included)", param="previous_response_id")  # fmt: skip
        fields: dict[str, Any] = {
            "model": self.model, "messages": self.messages(), "max_completion_tokens": self.max_output_tokens,
            "stream": self.stream, "seed": self.seed, "priority": self.priority, "cache_salt": self.cache_salt,
            "vlens": self.vlens, "parallel_tool_calls": self.parallel_tool_calls, "user": self.user,
        }  # fmt: skip
        # (only those given: the chat request takes the others from the generation config, vlens.generation_config)
        fields |= {name: getattr(self, name) for name in ("temperature", "top_p", "top_k")
                   if name in self.model_fields_set}  # fmt: skip
        if self.stream:
            fields["stream_options"] = {"include_usage": True}  # (the usage the last event's response holds)
        if self.tools is not None:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in self.tools]  # fmt: skip
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        form = self.text.format if self.text is not None else None
        if form is not None and form.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif form is not None and form.type == "json_schema":
            if form.schema_ is None:
                raise APIError(400, "text.format.schema: required with type json_schema", param="text.format.schema")
            schema = form.model_dump(include={"name", "description", "strict"}, exclude_none=True)
            fields["response_format"] = {"type": "json_schema", "json_schema": {**schema, "schema": form.schema_}}
        try:
            return ChatRequest.model_validate(fields)
        except ValidationError as e:  # (what the Responses schema lets through and the chat one does not)
            raise renamed(schema_error(e.errors(), 422)) from None

    def messages(self) -> list[dict[str, Any]]:
        """The conversation: the instructions as a system message, then the input's items, a run of function
        calls as one assistant message's tool calls and each call's output as a tool message."""
        items = [Message(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        out = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        for item in items:
            if isinstance(item, Message):
                out.append(item.chat())
            elif isinstance(item, FunctionCall):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutput):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        if not out:
            raise APIError(400, "input: no messages", param="input")
        return out


def renamed(e: APIError) -> APIError:
    """An error of the chat path naming the Responses field its chat field came from."""
    head = (e.param or "").split(".")[0]
    if head not in _FIELDS:
        return e
    param = _FIELDS[head] + e.param[len(head):]
    message = param + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
    return APIError(e.status, message, param, e.code, e.headers)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def _message_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": _id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}  # fmt: skip


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"], "status": "completed"}  # fmt: skip


@dataclass
class ResponseForm:
    """One request's reply as a Response; `count` gives a text's token count (the reasoning's, in usage)."""

    request: ResponsesRequest
    model: str
    count: Callable[[str], int]
    id: str = field(default_factory=lambda: _id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict], usage: dict | None, vlens: dict | None = None) -> dict:
        """The Response object (status "in_progress" while a stream runs)."""
        r = self.request
        thought = [part["text"] for item in output if item["type"] == "reasoning" for part in item["content"]]
        body = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
            "temperature": r.temperature, "top_p": r.top_p,
            "tool_choice": r.tool_choice.model_dump() if isinstance(r.tool_choice, FunctionChoice)
            else r.tool_choice or ("auto" if r.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
            "text": {"format": r.text.format.model_dump(by_alias=True, exclude_none=True)
                     if r.text is not None and r.text.format is not None else {"type": "text"}},
            "store": False, "metadata": r.metadata or {}, "user": r.user, "usage": None,
        }  # fmt: skip
        if usage is not None:
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            body["usage"] = {
                "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": cached},
                "output_tokens_details": {"reasoning_tokens": sum(map(self.count, thought))},
            }  # fmt: skip
        if vlens is not None:
            body["vlens"] = vlens
        return body

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A chat completion's body as a Response."""
        [choice] = chat["choices"]
        message, status = choice["message"], _status(choice["finish_reason"])
        output = []
        if message.get("reasoning"):
            output.append(_reasoning_item(message["reasoning"], "completed" if message.get("content") else status))
        if message.get("content"):
            output.append(_message_item(message["content"], status))
        output += [_call_item(call) for call in message.get("tool_calls") or ()]
        return self.response(status, output, chat["usage"], chat.get("vlens"))

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        """A chat completion's stream as the Responses API's events."""
        events = _Events()
        yield events.send("response.created", response=self.response("in_progress", [], None))
        yield events.send("response.in_progress", response=self.response("in_progress", [], None))
        usage = vlens = finish = None
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"]
                yield events.send("error", code=error["code"], message=error["message"], param=error["param"])
                return
            usage, vlens = chunk.get("usage") or usage, chunk.get("vlens") or vlens
            for choice in chunk["choices"]:
                delta = choice["delta"]
                for line in events.text("reasoning", delta.get("reasoning") or ""):
                    yield line
                for line in events.text("message", delta.get("content") or ""):
                    yield line
                for call in delta.get("tool_calls") or ():
                    for line in events.call(call):
                        yield line
                finish = choice["finish_reason"] or finish
        status = _status(finish)
        for line in events.close(status):
            yield line
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield events.send(kind, response=self.response(status, events.output, usage, vlens))


@dataclass
class _Open:
    kind: str  # "reasoning", "message" or "function_call"
    item: dict[str, Any]
    index: int
    text: str = ""  # so far (a call's: its arguments)


class _Events:
    """The typed events of one streamed Response, numbered, and the output items they open and close."""

    _PART = {"reasoning": "reasoning_text", "message": "output_text"}

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: _Open | None = None

    def send(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def _part(self, kind: str, text: str) -> dict[str, Any]:
        extra = {"annotations": [], "logprobs": []} if kind == "message" else {}
        return {"type": self._PART[kind], "text": text, **extra}

    def text(self, kind: str, delta: str) -> Iterator[str]:
        """A delta of the reasoning or the message, opening its item first (and closing the other's)."""
        if not delta:
            return
        if self.open is None or self.open.kind != kind:
            yield from self.close("completed")
            item = (_reasoning_item if kind == "reasoning" else _message_item)("", "in_progress") | {"content": []}
            self.open = _Open(kind, item, len(self.output))
            yield self.send("response.output_item.added", output_index=self.open.index, item=item)
            yield self.send("response.content_part.added", item_id=item["id"], output_index=self.open.index,
                            content_index=0, part=self._part(kind, ""))  # fmt: skip
        self.open.text += delta
        extra = {"logprobs": []} if kind == "message" else {}
        yield self.send(f"response.{self._PART[kind]}.delta", item_id=self.open.item["id"],
                        output_index=self.open.index, content_index=0, delta=delta, **extra)  # fmt: skip

    def call(self, call: dict[str, Any]) -> Iterator[str]:
        """A function call's piece: one with an id opens its item (the chat stream gives a call's arguments as they
        are written, one call after another; a format that cannot stream them, each whole at the reply's end), one
        without adds to the open call's arguments."""
        if "id" in call:
            yield from self.close("completed")
            item = _call_item(call) | {"arguments": "", "status": "in_progress"}
            self.open = _Open("function_call", item, len(self.output))
            yield self.send("response.output_item.added", output_index=self.open.index, item=item)
        if arguments := call["function"].get("arguments"):
            self.open.text += arguments
            yield self.send("response.function_call_arguments.delta", item_id=self.open.item["id"],
                            output_index=self.open.index, delta=arguments)  # fmt: skip

    def close(self, status: str) -> Iterator[str]:
        """The open item's last events, `status` its own."""
        if self.open is None:
            return
        kind, item, index, text = self.open.kind, self.open.item, self.open.index, self.open.text
        self.open = None
        if kind == "function_call":  # (a call is whole when its item closes)
            item = item | {"arguments": text, "status": "completed"}
            yield self.send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=text)  # fmt: skip
            yield self.send("response.output_item.done", output_index=index, item=item)
            self.output.append(item)
            return
        part = self._part(kind, text)
        extra = {"logprobs": []} if kind == "message" else {}
        yield self.send(f"response.{self._PART[kind]}.done", item_id=item["id"], output_index=index, content_index=0,
                        text=text, **extra)  # fmt: skip
        yield self.send("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part)  # fmt: skip
        item = item | {"content": [part], "status": status}
        yield self.send("response.output_item.done", output_index=index, item=item)
        self.output.append(item)
