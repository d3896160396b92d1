"""Request bodies of the OpenAI endpoints (and vLLM's extensions of them), and errors in OpenAI's JSON shape.

Clients written for vLLM or OpenAI send fields vlens does not implement, mostly at their default
values; those are listed in NEUTRAL with the values that change nothing, and accepted at them. Any
other value, and any field nobody defines, is a 400 naming the field rather than silently different
behaviour. The `vlens` extension object is kept raw here and parsed by `extension.py`; the OpenAPI
document shows its typed form (specs.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, TypeAdapter

from vlens.chat import ChatOptions
from vlens.sampling_params import StructuredOutputsParams
from vlens.server.specs import ExtensionSpec
from vlens.server.tool_parsers import PARSERS, ToolParser
from vlens.server.tools import ToolReply, reply_schema, template_message


class APIError(Exception):
    """An error the client gets as {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # Retry-After, on 429 and 503

    def body(self) -> dict[str, Any]:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def from_value_error(e: ValueError, prefix: str = "", code: str | None = None) -> APIError:
    """vlens's ValueErrors start with the field at fault ("capture.positions: ..."); make it `param`, named
    in the message as in the request body (under `prefix`), so a client reads the same path in both."""
    message = " ".join(str(e).split())
    match = _FIELD_PREFIX.match(message)
    if match is None:
        return APIError(400, message, param=None, code=code)
    return APIError(400, prefix + message, param=prefix + match.group(1), code=code)


def check_model(asked: str | None, served: str, steered: Collection[str] = (), adapters: Collection[str] = ()) -> None:
    """404 naming the model a request asked for, unless it is the one served (or none was named) or one of the
    `steered` ones (the served model steered by a vector of that name: vlens serve --steering-vector) or of the
    `adapters` (the served model under a LoRA adapter of that name: --lora-modules)."""
    if asked is not None and asked != served and asked not in steered and asked not in adapters:
        also = f", and steered by its vectors: {', '.join(map(repr, steered))}" if steered else ""
        also += f", and under its LoRA adapters: {', '.join(map(repr, adapters))}" if adapters else ""
        raise APIError(
            404,
            f"model: {asked!r} is not served here; this server serves {served!r}{also}",
            param="model",
            code="model_not_found",
        )


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _is_union_tag(part: object) -> bool:
    """Pydantic puts the tried alternative of a union into an error's loc (`str`, `list[int]`,
    `SliceSpec`); field names are never like that."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part[:1].isupper())


def schema_error(errors: list[dict], status: int, prefix: tuple[str, ...] = ()) -> APIError:
    """Pydantic's first complaint, with `param` the dotted path of the field in the request body."""
    first = errors[0]
    loc = [str(p) for p in (*prefix, *first["loc"]) if p != "body"]
    cut = next((i for i, p in enumerate(loc) if _is_union_tag(p)), len(loc))
    where, kind = ".".join(loc[:cut]) or "body", first["type"]
    if kind == "json_invalid":
        error = first.get("ctx", {}).get("error", first["msg"])
        return APIError(status, f"body: invalid JSON: {error}", param="body", code=kind)
    if kind == "extra_forbidden":
        message = "unknown field"
    elif kind == "missing":
        message = "required field missing"
    elif cut < len(loc):
        message = f"matches none of the forms this field accepts (as {loc[cut]}: {first['msg']})"
    else:
        message = first["msg"]
    return APIError(status, f"{where}: {message}", param=where, code=kind)


@dataclass(frozen=True)
class DocumentedAs:
    """A field validated by hand after the body (to give a 400 naming the nested field, or refuse capture
    on a server without it before looking inside), shown in the OpenAPI document as the optional `model`
    it is checked against, so clients and schema fuzzers see its fields."""

    model: type[BaseModel]

    def __get_pydantic_json_schema__(self, core_schema, handler):
        return handler(TypeAdapter(self.model | None).core_schema)


class JSONSchemaFormat(BaseModel):
    name: StrictStr | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class StructuralTagItem(BaseModel):
    """One structure of vLLM's older structural tag: the text between `begin` and `end` is JSON of `schema`."""

    model_config = ConfigDict(extra="forbid")
    begin: StrictStr
    schema_: dict[str, Any] = Field(alias="schema")
    end: StrictStr


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no structure), any JSON object, or JSON of a schema; or vLLM's structural tag:
    xgrammar's `format`, or the older `structures` with the `triggers` that open them."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[StructuralTagItem] | None = None
    triggers: list[StrictStr] | None = None

    def structure(self) -> dict[str, Any] | None:
        """StructuredOutputsParams' fields for it (None for text); a 400 naming a field its type lacks or refuses."""

        def refuse(name: str, why: str) -> APIError:
            return APIError(400, f"response_format.{name}: {why}", param=f"response_format.{name}")

        older = {"structures": self.structures, "triggers": self.triggers}  # (vLLM's older structural tag)
        if self.type != "structural_tag":
            if given := [name for name, v in {"format": self.format, **older}.items() if v is not None]:
                raise refuse(given[0], f"only with type structural_tag, not {self.type}")
            if self.type == "json_schema" and self.json_schema is None:
                raise refuse("json_schema", "required with type json_schema")
            if self.type == "text":
                return None
            return dict(json=self.json_schema.schema_) if self.json_schema is not None else dict(json_object=True)
        if self.json_schema is not None:
            raise refuse("json_schema", "not with type structural_tag (its schemas are in its format)")
        if self.format is not None:
            if given := [name for name, v in older.items() if v is not None]:
                raise refuse(given[0], "not with format: a structural tag takes one form or the other")
        elif self.structures is None and self.triggers is None:
            raise refuse("format", "required with type structural_tag (or structures and triggers)")
        elif missing := [name for name, v in older.items() if v is None]:
            raise refuse(missing[0], "required with " + ("triggers" if missing[0] == "structures" else "structures"))
        return dict(structural_tag=self.model_dump(by_alias=True, exclude_none=True))


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs object: one of its fields."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    structural_tag: dict[str, Any] | StrictStr | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


# Fields of vLLM's (and OpenAI's) requests that vlens serve does not implement -> the values at which
# they change nothing. Keys a client sends that are neither declared nor listed here are unknown.
_NEUTRAL = {
    "spaces_between_special_tokens": (True,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "logits_processors": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "prompt_embeds": (None,),
    "request_id": (None,),
}
_NEUTRAL_CHAT = {
    **_NEUTRAL,
    "documents": (None,),
    "mm_processor_kwargs": (None,),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "reasoning_effort": (None,),
    "metadata": (None, {}),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "audio": (None,),
    "web_search_options": (None,),
}


def refuse_unknown(extra: dict[str, Any] | None, neutral: dict[str, tuple]) -> None:
    """400 for a field nobody defines, or one vlens does not implement sent at a value that would matter."""
    for name, value in (extra or {}).items():
        if name not in neutral:
            raise APIError(400, f"{name}: unknown field", param=name, code="unknown_field")
        if value not in neutral[name]:
            accepted = " or ".join(json.dumps(v) for v in neutral[name])
            raise APIError(
                400, f"{name}: not supported by vlens serve; accepted only at {accepted} (or left out)", param=name
            )


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")  # kept for refuse_unknown, which names them
    NEUTRAL: ClassVar[dict[str, tuple]] = _NEUTRAL

    model: StrictStr | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    best_of: StrictInt | None = None  # OpenAI's on completions, vLLM's on chat too
    user: StrictStr | None = None  # OpenAI's end-user id: accepted, not used
    presence_penalty: float = 0.0  # ranges are SamplingParams' to check: a 400 naming the field
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extensions, which clients of vLLM servers already send at the top level
    top_k: StrictInt = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = 1.0
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=1)
    return_token_ids: StrictBool | None = None  # vLLM's: the prompt's and each choice's token ids beside the text
    return_tokens_as_token_ids: StrictBool | None = None  # vLLM's: logprobs name tokens "token_id:{id}"
    cache_salt: StrictStr | None = Field(None, min_length=1)  # vLLM's: only requests with it share cached prefixes
    priority: StrictInt = 0  # vLLM's: lower first, on a server run with --scheduling-policy priority
    # A structure for the text: OpenAI's response_format, vLLM's structured_outputs or its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=20)  # as logprobs: each row's entries come as JSON
    use_beam_search: StrictBool = False  # vLLM's: the n likeliest continuations (vlens.beam_search), n the width
    length_penalty: float = 1.0  # ... a beam's score: cumulative log-probability / length ** length_penalty
    vlens: Annotated[dict[str, Any] | None, DocumentedAs(ExtensionSpec)] = None

    def check(self, max_n: int) -> None:
        """400 for what the schema cannot say, naming the field."""
        refuse_unknown(self.model_extra, self.NEUTRAL)
        if not 1 <= self.n <= max_n:
            raise APIError(400, f"n: {self.n} is not allowed; expected 1 to {max_n} (this server's --max-n)", param="n")
        if self.best_of is not None and not self.n <= self.best_of <= max_n:
            raise APIError(
                400,
                f"best_of: {self.best_of} is not allowed; expected n ({self.n}) to {max_n} (--max-n)",
                param="best_of",
            )
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise APIError(
                400, "best_of: more samples than n cannot be streamed (they are ranked at the end)", param="best_of"
            )
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed with stream=true", param="stream_options")
        self.structure()
        if self.use_beam_search:
            self._check_beam_search()

    def _check_beam_search(self) -> None:
        """What beam search leaves out, by name: it ranks whole beams by the model's own log-probabilities."""
        asked = {"stream": self.stream, "logprobs": getattr(self, "logprobs", None) not in (None, False),
                 "prompt_logprobs": self.prompt_logprobs is not None, "echo": getattr(self, "echo", False),
                 "best_of": self.best_of is not None, "vlens": bool(self.vlens),
                 self.structure_field() or "": self.structure_field() is not None}  # fmt: skip
        for name, given in asked.items():
            if given:
                raise APIError(400, f"{name}: not with use_beam_search, which returns the n best beams' texts "
                               "whole, ranked by the model's log-probabilities", param=name)  # fmt: skip

    def structure(self) -> StructuredOutputsParams | None:
        """The one structure the body asks for, or None; a 400 naming the fields when it asks for several."""
        given = self._structures()
        if len(given) > 1:
            raise APIError(400, f"{list(given)[1]}: one structure per request; this one also sets {list(given)[0]}",
                           param=list(given)[1])  # fmt: skip
        if not given:
            return None
        [(name, fields)] = given.items()
        try:
            return StructuredOutputsParams(**fields)
        except ValueError as e:
            raise APIError(400, f"{name}: {str(e).split(': ', 1)[1]}", param=name) from None

    def structure_field(self) -> str | None:
        """The field the structure comes from (checked by structure()): what a structure that does not compile names."""
        return next(iter(self._structures()), None)

    def _structures(self) -> dict[str, dict[str, Any]]:
        """Each field that asks for a structure -> StructuredOutputsParams' fields for it."""
        given = {}
        if self.response_format is not None and (fields := self.response_format.structure()) is not None:
            given["response_format"] = fields
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, f"guided_{name}") is not None:
                given[f"guided_{name}"] = {name: getattr(self, f"guided_{name}")}
        return given


class CompletionRequest(_GenerationRequest):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=0)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    add_special_tokens: StrictBool = True  # vLLM's: how text prompts are tokenized

    def check(self, max_n: int) -> None:
        super().check(max_n)
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                400, "max_tokens: 0 generates nothing; it is allowed only with echo=true", param="max_tokens"
            )
        if self.suffix:
            raise APIError(400, "suffix: not supported: no model served here fills in the middle", param="suffix")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: StrictStr  # a data: URL (base64): vlens fetches nothing
    detail: Literal["auto", "low", "high"] | None = None  # (OpenAI's; the checkpoint's processor sets the resolution)


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageURL


class Function(BaseModel):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of its arguments
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class FunctionName(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class CallFunction(BaseModel):
    name: StrictStr
    arguments: StrictStr  # JSON, as OpenAI sends it


class ToolCall(BaseModel):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: CallFunction


class ChatMessage(BaseModel):
    # Extra keys are ignored: clients pass back assistant messages with refusal and the like set to None.
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's, passed back
    tool_call_id: StrictStr | None = None  # a tool message's: the call it answers
    name: StrictStr | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it: its text, and its tool calls or the call it answers."""
        extra = self.model_dump(include={"tool_calls", "tool_call_id", "name"}, exclude_none=True)
        return template_message({"role": self.role, "content": self.text(), **extra})

    def text(self) -> str:
        """The content as one text; a list's parts joined by newlines, as vLLM joins them, so that a client
        written for vLLM gets the same prompt here."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(part, ImagePart) for part in self.content)


def chat_options(body: Any, template: str | None = None) -> ChatOptions:
    """A body's chat-template fields (vLLM's: add_generation_prompt, continue_final_message, chat_template_kwargs;
    OpenAI's tools, where the body has them) with `template` in place of the checkpoint's (None: the checkpoint's); a
    400 naming the field."""
    given = getattr(body, "tools", None)
    tools = [tool.model_dump(exclude_none=True) for tool in given] if given else None
    try:
        return ChatOptions(body.add_generation_prompt, body.continue_final_message, template, body.chat_template_kwargs,
                           tools)  # fmt: skip
    except ValueError as e:
        raise from_value_error(e) from None


@dataclass(frozen=True)
class ChatTemplates:
    """Which chat template renders a request: its own `chat_template` where the server trusts requests' templates
    (vLLM's --trust-request-chat-template: a template is code the server runs), else the server's (--chat-template),
    else the checkpoint's."""

    server: str | None = None
    trust_requests: bool = False

    def options(self, body: Any) -> ChatOptions:
        if body.chat_template is not None and not self.trust_requests:
            raise APIError(400, "chat_template: this server renders requests with its own chat template; start it "
                           "with --trust-request-chat-template to take a request's", param="chat_template")  # fmt: skip
        return chat_options(body, body.chat_template if body.chat_template is not None else self.server)


class ChatRequest(_GenerationRequest):
    NEUTRAL: ClassVar[dict[str, tuple]] = _NEUTRAL_CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # the reply continues the last message (an answer's start)
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own variables (enable_thinking, ...)
    chat_template: StrictStr | None = None  # the request's own (vlens.server.protocol.ChatTemplates)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False  # vLLM's (repeat the last message): refused when true
    add_special_tokens: StrictBool = False  # vLLM's: the template already holds the special tokens
    tools: list[Tool] | None = None  # OpenAI's function tools (vlens.server.tools)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # (None: true, OpenAI's default)
    include_reasoning: StrictBool = True  # vLLM's: a reasoning model's thinking in the reply (vlens.server.reasoning)

    def check(self, max_n: int) -> None:
        super().check(max_n)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs")
        if self.echo:
            raise APIError(400, "echo: not supported on chat completions; use /v1/completions with echo", param="echo")
        chat_options(self, self.chat_template)

    def tool_reply(self, parser: ToolParser | None = None) -> ToolReply | None:
        """How the reply becomes tool calls ("auto" through the server's tool-call `parser`, "required", a named
        function), or None (text); a 400 naming tool_choice for a choice the tools cannot meet, or "auto" on a
        server without a parser."""
        if self.tools and self.tool_choice in (None, "auto"):  # (OpenAI's default with tools, as vLLM's)
            if parser is None:
                raise APIError(400, "tool_choice: \"auto\" (the default with tools) needs the server started with "
                               "--enable-auto-tool-choice and --tool-call-parser (one of "
                               f"{', '.join(PARSERS)}); send \"required\", a named function or \"none\"",
                               param="tool_choice")  # fmt: skip
            return ToolReply(None, parser)
        return self._forced_tools()

    def _forced_tools(self) -> ToolReply | None:
        """tool_choice "required" or a named function: a reply the tools' schema holds to (None: any other)."""
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return None
        names = [tool.function.name for tool in self.tools or ()]
        named = None if choice == "required" else choice.function.name
        if not names or (named is not None and named not in names):
            wanted = "tools to choose from" if named is None else f"a tool named {named!r}"
            raise APIError(400, f"tool_choice: needs {wanted}; the request's tools are {names}", param="tool_choice")
        return ToolReply(named)

    def _structures(self) -> dict[str, dict[str, Any]]:
        forced = self._forced_tools()
        if forced is None:
            return super()._structures()
        functions = [tool.function.model_dump(exclude_none=True) for tool in self.tools]
        return {"tool_choice": {"json": reply_schema(functions, forced.named, self.parallel_tool_calls is not False)},
                **super()._structures()}  # fmt: skip
