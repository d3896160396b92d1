"""vLLM's tokenizer routes — `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info` — in vLLM's
shapes, so that clients that tokenize through the server (lm-evaluation-harness's remote tokenizer)
need no copy of the tokenizer; and the chat template, which /tokenize and chat completions share."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from vlens.chat import ChatOptions
from vlens.server.protocol import (
    APIError,
    ChatMessage,
    ChatTemplates,
    Tool,
    check_model,
    from_value_error,
    refuse_unknown,
)  # fmt: skip


def render_chat(tokenizer: Any, messages: list[ChatMessage], options: ChatOptions = ChatOptions()) -> str:
    """The conversation through the chat template `options` name, else the model's; a 400 naming `messages` if it
    cannot be."""
    if options.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "messages: this model's tokenizer has no chat template; use /v1/completions", "messages")
    if any(m.has_images() for m in messages):  # (a chat completion takes them: vlens.server.generate)
        raise APIError(400, "messages: image_url parts are taken by /v1/chat/completions only", "messages")
    try:
        return options.render(tokenizer, [m.for_template() for m in messages], "messages")
    except ValueError as e:
        raise from_value_error(e) from None


class TokenizeRequest(BaseModel):
    """vLLM's two forms: a `prompt` (special tokens added by default), or chat `messages` (through the
    template, which holds the special tokens)."""

    model_config = ConfigDict(extra="allow")
    NEUTRAL: ClassVar[dict[str, tuple]] = {"mm_processor_kwargs": (None,)}
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: StrictStr | None = None  # (as a chat completion's: vlens.server.protocol.ChatTemplates)
    tools: list[Tool] | None = None  # rendered by the template, as a chat completion's
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    tokens: list[StrictInt]


class Tokens:
    def __init__(
        self, tokenizer: Any, vocab_size: int, model_name: str, max_model_len: int, steered: Iterable[str] = (),
        adapters: Collection[str] = (), templates: ChatTemplates = ChatTemplates(),
    ):  # fmt: skip
        """`steered`, `adapters`: the names of the steered models and LoRA adapters the server serves too (one
        tokenizer for all; `adapters` read as they are when asked: they change at run time); `templates`, the chat
        templates of chat requests'."""
        self.tokenizer, self.vocab_size, self.templates = tokenizer, vocab_size, templates
        self.model_name, self.max_model_len, self.steered = model_name, max_model_len, tuple(steered)
        self.adapters = adapters

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        refuse_unknown(body.model_extra, TokenizeRequest.NEUTRAL)
        check_model(body.model, self.model_name, self.steered, self.adapters)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give either prompt (a text) or messages (a conversation), not both", "prompt")
        if body.messages is not None:
            text = render_chat(self.tokenizer, body.messages, self.templates.options(body))
            special = bool(body.add_special_tokens)
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        ids = self.tokenizer(text, add_special_tokens=special)["input_ids"]
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._check(body)
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def texts(self, body: DetokenizeRequest) -> dict[str, Any]:
        """Each token's own text, for the /lens page, which names the tokens of its views by them."""
        self._check(body)
        return {"texts": [self.tokenizer.decode([t]) for t in body.tokens]}

    def _check(self, body: DetokenizeRequest) -> None:
        check_model(body.model, self.model_name, self.steered, self.adapters)
        bad = [t for t in body.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"tokens: ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})", "tokens")

    def info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's class, special tokens and chat template."""
        t = self.tokenizer
        special = {name: getattr(t, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return {
            "tokenizer_class": type(t).__name__,
            **{name: None if value is None else str(value) for name, value in special.items()},
            "chat_template": self.templates.server or getattr(t, "chat_template", None),
            "model_max_length": self.max_model_len,
            "vocab_size": self.vocab_size,
        }
