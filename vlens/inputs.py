"""Turning user prompts into token-id lists, with errors that name the offending field and item."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt and TokensPrompt dicts
# ... and what else they may hold: vLLM's cache_salt (LLM.generate's requests share cached prefixes only with those of
# the same salt; a forward outside the engine's cache, LLM.trace's, has none to share)
PROMPT_OPTIONS = ("cache_salt",)


@dataclass(frozen=True)
class ImagePrompt:
    """vLLM's {"prompt": text, "multi_modal_data": {"image": an image or a list}}: a text whose image placeholders
    the images fill (vlens.images)."""

    text: str
    images: list[Any]


def to_token_lists(
    prompts: Any, tokenizer: Any, vocab_size: int, field: str = "prompts", add_special_tokens: bool = True
) -> list[list[int]]:
    """str | list[str] | list[list[int]] (or vLLM's prompt dicts, see prompt_list) -> list of token-id lists,
    tokenized with the tokenizer's defaults (special tokens included, as HF does, unless add_special_tokens=False)."""
    out = []
    for i, p in enumerate(prompt_list(prompts, field)):
        if isinstance(p, str):
            if not p:
                raise ValueError(f"{field}[{i}]: empty text; give at least one character")
            if tokenizer is None:
                raise ValueError(f"{field}[{i}]: this checkpoint has no tokenizer files; pass token-id lists")
            ids = tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"]
        elif _is_token_list(p):
            ids = [int(t) for t in p]
        elif isinstance(p, Sequence) and len(p) == 0:
            raise ValueError(f"{field}[{i}]: empty token-id list; give at least one token")
        elif isinstance(p, ImagePrompt):
            raise ValueError(f"{field}[{i}]: multi_modal_data is taken by LLM.generate, LLM.chat, LLM.trace and "
                             "HookedLM's forwards and generate; this call reads texts and token ids")  # fmt: skip
        else:
            raise ValueError(f"{field}[{i}]: expected a string or a list of token ids, got {type(p).__name__}")
        if not ids:
            raise ValueError(f"{field}[{i}]: empty prompt (no tokens)")
        bad = [t for t in ids if not 0 <= t < vocab_size]  # (a text's too: a tokenizer may spell past the embedding)
        if bad:
            spelt = " (the tokenizer's, for this text)" if isinstance(p, str) else ""
            raise ValueError(f"{field}[{i}]: token ids {bad[:5]}{spelt} outside the vocabulary [0, {vocab_size})")
        out.append(list(ids))
    return out


def prompt_list(prompts: Any, field: str = "prompts") -> list[Any]:
    """The prompts as a list of texts and token-id lists: one prompt becomes a list of one, and vLLM's prompt
    dicts, {"prompt": text} and {"prompt_token_ids": ids}, their text or ids (so a vLLM script that passes
    TextPrompt or TokensPrompt runs unchanged); a text with images, an ImagePrompt."""
    prompts = _one_or_many(prompts)
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"{field}: expected a string, a list of strings or a list of token-id lists, got {prompts!r}")
    out = list(prompts)
    for i, p in enumerate(out):
        if isinstance(p, Mapping) and "multi_modal_data" in p:
            out[i] = _image_prompt(p, f"{field}[{i}]")
        elif isinstance(p, Mapping):
            keys = [k for k in PROMPT_KEYS if k in p]
            if len(keys) != 1 or not set(p) <= {*keys, *PROMPT_OPTIONS}:
                raise ValueError(f"{field}[{i}]: a prompt dict holds one of {', '.join(PROMPT_KEYS)} (and optionally "
                                 f"{', '.join(PROMPT_OPTIONS)}); got the keys {sorted(map(str, p))}")  # fmt: skip
            _check_salt(p, f"{field}[{i}]")
            out[i] = p[keys[0]]
    return out


def cache_salts(prompts: Any) -> list[str | None]:
    """Each prompt's vLLM cache_salt (None where a prompt is not a dict with one), in prompt_list's order (prompts
    prompt_list has taken)."""
    return [p.get("cache_salt") if isinstance(p, Mapping) else None for p in _one_or_many(prompts)]


def _one_or_many(prompts: Any) -> Any:
    """One prompt (a text, a dict, a token-id list) as a list of one; anything else as it is."""
    return [prompts] if isinstance(prompts, (str, Mapping)) or _is_token_list(prompts) else prompts


def _check_salt(p: Mapping, field: str) -> None:
    salt = p.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"{field}.cache_salt: {salt!r} is not allowed; expected a non-empty string")


def _image_prompt(p: Mapping, field: str) -> ImagePrompt:
    if not {"prompt", "multi_modal_data"} <= set(p) <= {"prompt", "multi_modal_data", *PROMPT_OPTIONS} or \
            not isinstance(p["prompt"], str) or not p["prompt"]:  # fmt: skip
        raise ValueError(f"{field}: a prompt with multi_modal_data gives its text as 'prompt' (a non-empty string) "
                         f"and nothing else but {', '.join(PROMPT_OPTIONS)}; got the keys {sorted(map(str, p))}")
    _check_salt(p, field)
    data = p["multi_modal_data"]
    if not isinstance(data, Mapping) or set(data) != {"image"}:
        kinds = sorted(map(str, data)) if isinstance(data, Mapping) else type(data).__name__
        raise ValueError(f"{field}.multi_modal_data: vlens takes {{'image': an image or a list of them}}; got {kinds}")
    images = list(data["image"]) if isinstance(data["image"], (list, tuple)) else [data["image"]]
    if not images:
        raise ValueError(f"{field}.multi_modal_data.image: an empty list; give at least one image")
    return ImagePrompt(p["prompt"], images)


def _is_token_list(x: Any) -> bool:
    # bool is an int subclass: [True, False] is a mistake, not tokens 1 and 0. A tensor or array has __index__
    # too, but only one of a single element is a token: [tensor([1, 2])] is a list of one prompt, not of ids.
    return isinstance(x, Sequence) and not isinstance(x, str) and len(x) > 0 and all(
        hasattr(t, "__index__") and not isinstance(t, bool) and getattr(t, "ndim", 0) == 0 for t in x
    )


def truncated(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: a prompt's last `keep` tokens (None: all of them)."""
    return ids if keep is None or len(ids) <= keep else ids[-keep:]
