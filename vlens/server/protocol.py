"""Request bodies of the OpenAI endpoints, and errors in OpenAI's JSON shape.

Fields OpenAI defines but vlens does not implement are declared so that a request using them gets a
400 naming the field rather than silently different behaviour; anything else unknown is a 422.
The `vlens` extension object is kept raw here and parsed by `extension.py`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


class APIError(Exception):
    """An error the client gets as {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def from_value_error(e: ValueError, prefix: str = "", code: str | None = None) -> APIError:
    """vlens's ValueErrors start with the field at fault ("capture.positions: ..."); make it `param`."""
    message = " ".join(str(e).split())
    match = _FIELD_PREFIX.match(message)
    param = f"{prefix}{match.group(1)}" if match else None
    return APIError(400, message, param=param, code=code)


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
        return APIError(status, f"body: invalid JSON: {first.get('ctx', {}).get('error', first['msg'])}", code=kind)
    if kind == "extra_forbidden":
        message = "unknown field"
    elif kind == "missing":
        message = "required field missing"
    elif cut < len(loc):
        message = f"matches none of the forms this field accepts (as {loc[cut]}: {first['msg']})"
    else:
        message = first["msg"]
    return APIError(status, f"{where}: {message}", param=where, code=kind)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    user: StrictStr | None = None  # OpenAI's end-user id: accepted, not used
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extensions, which clients of vLLM servers already send at the top level
    top_k: StrictInt = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    vlens: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        """400 for OpenAI features this server does not implement, naming the field."""
        unsupported = {
            "n": self.n != 1,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "logit_bias": bool(self.logit_bias),
        }
        for name, used in unsupported.items():
            if used:
                raise APIError(400, f"{name}: not supported by vlens serve; leave it at its default", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed with stream=true", param="stream_options")


class CompletionRequest(_GenerationRequest):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for name, used in {"echo": self.echo, "best_of": (self.best_of or 1) != 1, "suffix": self.suffix}.items():
            if used:
                raise APIError(400, f"{name}: not supported by vlens serve; leave it at its default", param=name)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    # Extra keys are ignored: clients pass back assistant messages with refusal/tool_calls set to None.
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs")
