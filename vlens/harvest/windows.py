"""Documents to fixed windows of token ids: tokenisation, the BOS rule, SAELens-style packing, exclusions.

BOS rule. A window starts with BOS only when the model *uses* one, which vlens reads as: its own
tokenizer puts `bos_token_id` in front of a text by default (Llama 2/3, Mistral, Gemma do; Qwen and
SmolLM2 do not). A `bos_token_id` that the tokenizer never adds (SmolLM2's is `<|im_start|>`, a chat
marker) is not a BOS the model saw in training, so prepending it would harvest activations of an input
the model never gets. This matches `LLM.trace`, which tokenizes with the tokenizer's defaults.

Packing (as SAELens's `concat_and_batch_sequences`): documents are tokenized without special tokens and
laid end to end; each window opens with BOS (when used) and a separator goes between two documents that
share a window (none before a document that opens a window). The separator is BOS when windows get one,
else the tokenizer's EOS (else none). A document that already starts with that token (pre-tokenized rows
often open with BOS) gets no second one before it, in either place. The last, partial window is dropped
so every window holds exactly `context_size` tokens. Without packing each document becomes one window of its own, truncated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from vlens.config import ModelConfig
from vlens.harvest.sources import Document

# Texts tokenized together per call (the fast tokenizer batches them): the first call takes few, so
# the first windows (and a short run's only ones) do not wait on a megabyte of text; later calls, more.
_TOKENIZE_CHARS = (1 << 16, 1 << 20)


@dataclass(frozen=True)
class Packing:
    """How documents become windows and which of their rows are kept."""

    context_size: int
    pack: bool
    bos_token_id: int | None  # opens every window; None = no BOS
    separator_token_id: int | None  # between two documents in one window
    excluded_token_ids: tuple[int, ...]  # rows whose token is one of these are not stored

    def describe(self) -> dict[str, Any]:
        return {
            "pack": self.pack,
            "bos_token_id": self.bos_token_id,
            "separator_token_id": self.separator_token_id,
        }


def model_bos(tokenizer: Any) -> int | None:
    """The BOS id the tokenizer puts before a text by default, or None when it adds none."""
    if tokenizer is None or tokenizer.bos_token_id is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return tokenizer.bos_token_id if ids and ids[0] == tokenizer.bos_token_id else None


def make_packing(
    tokenizer: Any,
    cfg: ModelConfig,
    context_size: int,
    pack: bool,
    prepend_bos: bool,
    exclude_bos: bool,
    exclude_token_ids: Iterable[int] | None,
) -> Packing:
    """The packing of a run whose options `HarvestConfig` has checked, against what only the model knows."""
    if context_size > cfg.max_position_embeddings:
        raise ValueError(
            f"context_size: {context_size} exceeds the model's max_position_embeddings ({cfg.max_position_embeddings})"
        )
    excluded = sorted({int(t) for t in exclude_token_ids or ()})
    bad = [t for t in excluded if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"exclude_token_ids: {bad} outside the vocabulary [0, {cfg.vocab_size})")
    bos = model_bos(tokenizer) if prepend_bos else None
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None and cfg.eos_token_ids:
        eos = cfg.eos_token_ids[0]
    if bos is not None and exclude_bos:
        excluded = sorted({*excluded, bos})
    return Packing(context_size, pack, bos, bos if bos is not None else eos, tuple(excluded))


def token_documents(docs: Iterable[Document], tokenizer: Any, vocab_size: int) -> Iterator[list[int]]:
    """Token ids per document: texts, and conversations rendered by the chat template (whose text holds its
    special tokens), tokenized in batches without adding special tokens (as LLM.chat does); token lists checked."""
    pending: list[str] = []
    size, limit = 0, _TOKENIZE_CHARS[0]
    for doc in docs:
        if isinstance(doc, str) or isinstance(doc[0], dict):
            if tokenizer is None:
                raise ValueError("source: this checkpoint has no tokenizer files; give pre-tokenized data")
            if not isinstance(doc, str):
                doc = render_conversation(tokenizer, doc)
            pending.append(doc)
            size += len(doc)
            if size >= limit:
                yield from _tokenize(pending, tokenizer)
                pending, size, limit = [], 0, min(2 * limit, _TOKENIZE_CHARS[1])
        else:
            if min(doc) < 0 or max(doc) >= vocab_size:
                raise ValueError(f"source: token ids outside the vocabulary [0, {vocab_size}) in a pre-tokenized row")
            yield doc
    if pending:
        yield from _tokenize(pending, tokenizer)


def check_chat_template(tokenizer: Any) -> None:
    """Before a run whose documents are conversations: the model must have a template to render them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "source: its documents are conversations, but this model's tokenizer has no chat template to render "
            "them; give texts or token ids"
        )


def render_conversation(tokenizer: Any, conversation: list[dict[str, Any]]) -> str:
    """A whole conversation through the chat template, as the model reads it (no generation prompt after it)."""
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception as e:  # the template is the model's Jinja code: what it raises is about the data
        raise ValueError(f"source: the chat template refused a conversation ({e}): {str(conversation)[:120]}") from None


def _tokenize(texts: list[str], tokenizer: Any) -> Iterator[list[int]]:
    for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
        if ids:
            yield ids


def windows(token_docs: Iterable[list[int]], packing: Packing) -> Iterator[list[int]]:
    """The windows of a harvest, in order (see the module doc for the packing rules)."""
    size, separator = packing.context_size, packing.separator_token_id
    if not packing.pack:
        for doc in token_docs:
            prefix = _opening(packing, doc[0])
            yield prefix + doc[: size - len(prefix)]
        return
    window: list[int] = []  # empty until its first token is known
    for doc in token_docs:
        if window and separator not in (None, doc[0]):
            window.append(separator)
            if len(window) == size:
                yield window
                window = []
        start = 0
        while start < len(doc):
            window = window or _opening(packing, doc[start])
            take = min(size - len(window), len(doc) - start)
            window.extend(doc[start : start + take])
            start += take
            if len(window) == size:
                yield window
                window = []


def _opening(packing: Packing, first: int) -> list[int]:
    """What opens a window whose first document token is `first`: BOS, unless that token already is BOS
    (pre-tokenized rows often start with it; the model never sees BOS twice, as in SAELens)."""
    return [] if packing.bos_token_id in (None, first) else [packing.bos_token_id]
