"""Conversations into prompts through the checkpoint's chat template (its tokenizer's; for a conversation with images,
its processor's), with vLLM's options: `LLM.chat`'s arguments and the chat-completion fields of the same names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# apply_chat_template's own arguments: not template variables
_RESERVED = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                       "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})  # fmt: skip


@dataclass(frozen=True)
class ChatOptions:
    add_generation_prompt: bool = True  # end in the template's opening of the assistant's reply
    continue_final_message: bool = False  # leave the last message open: the reply continues it (a prefilled answer)
    chat_template: str | None = None  # a Jinja template in place of the checkpoint's
    chat_template_kwargs: Mapping[str, Any] | None = None  # the template's own variables (enable_thinking=False, ...)
    tools: Sequence[Mapping[str, Any]] | None = None  # OpenAI's function tools, rendered by the template

    def __post_init__(self) -> None:
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: {getattr(self, name)!r} is not allowed; expected a bool")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: leaves the last message open for the reply to continue, which "
                             "a generation prompt would close; set add_generation_prompt=False with it")  # fmt: skip
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError(f"chat_template: expected None or a Jinja template's text, got {self.chat_template!r}")
        kwargs = self.chat_template_kwargs
        if kwargs is not None and (not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs)):
            raise ValueError(f"chat_template_kwargs: expected a dict of the template's variables, got {kwargs!r}")
        if self.tools is not None and (isinstance(self.tools, (str, Mapping)) or not isinstance(self.tools, Sequence)
                                       or not all(isinstance(t, Mapping) for t in self.tools)):  # fmt: skip
            raise ValueError(f"tools: expected a list of tools (dicts, OpenAI's {{'type': 'function', 'function': "
                             f"{{'name': ...}}}}), got {self.tools!r}")  # fmt: skip
        if reserved := sorted(_RESERVED & set(kwargs or ())):
            raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} are apply_chat_template's own arguments, "
                             "not the template's variables")  # fmt: skip

    def render(self, owner: Any, conversation: list[dict], field: str) -> str:
        """`conversation` through `owner`'s chat template (a tokenizer's or a processor's); a ValueError naming
        `field` when there is none or it refuses the conversation."""
        if self.chat_template is None and not getattr(owner, "chat_template", None):
            raise ValueError(f"{field}: this model has no chat template; give the prompt's text, or a chat_template")
        tools = None if self.tools is None else [dict(tool) for tool in self.tools]
        try:
            return owner.apply_chat_template(
                list(conversation), tokenize=False, add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message, chat_template=self.chat_template, tools=tools,
                **dict(self.chat_template_kwargs or {}),
            )  # fmt: skip
        except Exception as e:  # (the template is Jinja code: what it raises is about the conversation)
            reason = " ".join(str(e).split())
            raise ValueError(f"{field}: the chat template refused the conversation ({reason})") from None
