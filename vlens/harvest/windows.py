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

Documents are numbered as the source's records, blank ones (which make no tokens) counted, and a window
says where each of its documents begins, so every row names its record in the source.

Images. A record with images (a source's `image_field`, for a vision-language checkpoint) is tokenized by the
checkpoint's processor, its placeholders expanded to the image's tokens, and is a window of its own (packing is
off); past `context_size` its text is cut after its last image token, never inside an image. The window keeps the
processor's vision inputs, which the vision tower turns into the image rows when the window runs.

Roles. A harvest of conversations may store the rows of some roles only (`roles`, e.g. the assistant's):
each conversation's tokens are marked by whether they render the content of a message of those roles (the
character spans the chat template gives each message, through the tokenizer's offsets), and a window lists
the positions it does not store: the other tokens, and the BOS and separators packing adds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any

import numpy as np
import torch

from vlens.chat import ChatOptions
from vlens.config import ModelConfig
from vlens.harvest.sources import Document, Pictures
from vlens.images import ImageEncoder, Prepared
from vlens.inputs import ImagePrompt

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
    roles: tuple[str, ...] | None = None  # conversations: the roles whose content rows are stored (None: all rows)

    def describe(self) -> dict[str, Any]:
        return {
            "pack": self.pack,
            "bos_token_id": self.bos_token_id,
            "separator_token_id": self.separator_token_id,
            **({"roles": list(self.roles)} if self.roles is not None else {}),  # (only then: older manifests match)
        }


@dataclass(frozen=True, slots=True)
class Marked:
    """A conversation's token ids, and whether each renders the content of a message of the harvest's roles."""

    tokens: list[int]
    stored: list[bool]


@dataclass(frozen=True, slots=True)
class Pictured:
    """A document with images: its token ids (each image's placeholder expanded) and the processor's vision inputs."""

    tokens: list[int]
    vision: dict[str, torch.Tensor]
    images_end: int  # one past its last image token
    where: str


TokenDoc = list[int] | Marked | Pictured


@dataclass(frozen=True, slots=True)
class Window:
    """A window's token ids; the positions among them whose rows are not stored for its marks (`roles`; the
    rows left out by token id are the Packing's `excluded_token_ids`); and where each document's part of it
    begins, as (position, document index), the BOS or separator before a document counted as its own."""

    tokens: list[int]
    dropped: tuple[int, ...] = ()
    documents: tuple[tuple[int, int], ...] = ()
    images: Prepared | None = None  # a window of a document with images: what the vision tower reads (see above)


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
    roles: Iterable[str] | None = None,
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
    for name, token in (("bos_token_id", bos), ("eos_token_id", eos)):  # (the embedding would fail mid-run)
        if token is not None and not 0 <= token < cfg.vocab_size:
            raise ValueError(
                f"model: its {name} {token} is outside its vocabulary [0, {cfg.vocab_size}), and a harvest puts it "
                "in the windows (to open one, or between packed documents); fix the checkpoint's config"
            )
    if bos is not None and exclude_bos:
        excluded = sorted({*excluded, bos})
    roles = None if roles is None else tuple(roles)
    return Packing(context_size, pack, bos, bos if bos is not None else eos, tuple(excluded), roles)


def token_documents(
    docs: Iterable[Document], tokenizer: Any, vocab_size: int, roles: tuple[str, ...] | None = None,
    generation_prompt: bool = False, encoder: ImageEncoder | None = None,
) -> Iterator[TokenDoc]:  # fmt: skip
    """Token ids per document: texts, and conversations rendered by the chat template (whose text holds its
    special tokens; with `generation_prompt`, ending in the template's opening of the assistant's reply),
    tokenized in batches without adding special tokens (as LLM.chat does); token lists checked.
    With `roles`, each conversation comes `Marked` (see the module doc); a text with images, `Pictured` by the
    `encoder`'s processor (a text with none is a text), and a conversation beside images rendered by the
    processor's chat template first."""
    pending: list[str] = []
    spans: list[list[tuple[int, int]]] = []  # with roles: each pending conversation's spans of those roles
    size, limit = 0, _TOKENIZE_CHARS[0]
    for doc in docs:
        if isinstance(doc, Pictures) and not isinstance(doc.text, str):  # (the processor's template knows its images)
            doc = Pictures(encoder.render_chat(doc.text, doc.where, ChatOptions(generation_prompt)), doc.images,
                           doc.where)  # fmt: skip
        if isinstance(doc, Pictures) and doc.images:
            if pending:  # (the documents keep their order)
                yield from _tokenize(pending, tokenizer, None)
                pending, size = [], 0
            prepared = encoder.prepare(ImagePrompt(doc.text, doc.images), doc.where, add_special_tokens=False)
            end = int((prepared.ids == encoder.image_token_id).nonzero().max()) + 1
            yield Pictured(prepared.ids.tolist(), prepared.vision, end, doc.where)
            continue
        if isinstance(doc, Pictures):
            doc = doc.text
        if isinstance(doc, str) or (doc and isinstance(doc[0], dict)):
            if tokenizer is None:
                raise ValueError("source: this checkpoint has no tokenizer files; give pre-tokenized data")
            if isinstance(doc, str):
                doc = doc if doc.strip() else ""  # (a blank text stays in the stream as no tokens: see `windows`)
            elif roles is not None:
                doc, content = role_spans(tokenizer, doc, roles, generation_prompt)
                spans.append(content)
            else:
                doc = render_conversation(tokenizer, doc, generation_prompt)
            pending.append(doc)
            size += len(doc)
            if size >= limit:
                yield from _tokenize(pending, tokenizer, spans if roles is not None else None)
                pending, spans, size, limit = [], [], 0, min(2 * limit, _TOKENIZE_CHARS[1])
        else:
            if doc and (min(doc) < 0 or max(doc) >= vocab_size):
                raise ValueError(f"source: token ids outside the vocabulary [0, {vocab_size}) in a pre-tokenized row")
            yield doc
    if pending:
        yield from _tokenize(pending, tokenizer, spans if roles is not None else None)


def check_chat_template(tokenizer: Any) -> None:
    """Before a run whose documents are conversations: the model must have a template to render them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "source: its documents are conversations, but this model's tokenizer has no chat template to render "
            "them; give texts or token ids"
        )


def render_conversation(tokenizer: Any, conversation: list[dict[str, Any]], generation_prompt: bool = False) -> str:
    """A whole conversation through the chat template, as the model reads it (with `generation_prompt`, as
    LLM.chat renders it for a reply)."""
    try:
        return ChatOptions(generation_prompt).render(tokenizer, conversation, "source")
    except ValueError as e:
        raise ValueError(f"{e}: {str(conversation)[:120]}") from None


def role_spans(
    tokenizer: Any, conversation: list[dict[str, Any]], roles: tuple[str, ...], generation_prompt: bool = False
) -> tuple[str, list[tuple[int, int]]]:  # fmt: skip
    """The rendered conversation and the character spans of the contents of its messages of `roles`.

    The template renders the conversation once as it is and once with each content replaced by a marker; the
    text between markers is the template's own, so the spans are exact wherever the template writes each
    content as given (most do; one that trims it is met with the trimmed content)."""
    text = render_conversation(tokenizer, conversation, generation_prompt)
    markers = [f"\ue000{i}\ue001" for i in range(len(conversation))]  # (private-use characters)
    marked = [{**m, "content": k} for m, k in zip(conversation, markers)]
    rest = render_conversation(tokenizer, marked, generation_prompt)
    pieces = []  # the template's text before each content, then after the last
    for k in markers:
        piece, found, rest = rest.partition(k)
        if not found:
            break
        pieces.append(piece)
    pieces.append(rest)
    for trimmed in (False, True):
        contents = [m["content"].strip() if trimmed else m["content"] for m in conversation]
        if len(pieces) == len(contents) + 1 and "".join(chain(*zip(pieces, contents), pieces[-1:])) == text:
            spans, at = [], 0
            for piece, content, message in zip(pieces, contents, conversation):
                at += len(piece)
                if message["role"] in roles and content:
                    spans.append((at, at + len(content)))
                at += len(content)
            return text, spans
    raise ValueError(
        "roles: the chat template does not write each message's content as given (or drops a message), so the "
        f"tokens of a role cannot be told apart in {str(conversation)[:120]}; harvest it without roles"
    )


def _tokenize(texts: list[str], tokenizer: Any, spans: list[list[tuple[int, int]]] | None) -> Iterator[TokenDoc]:
    """Token ids of `texts`; with `spans` (one list per text), Marked: a token is stored when its characters
    overlap a span."""
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False, return_offsets_mapping=spans is not None)
    for i, ids in enumerate(encoded["input_ids"]):
        if spans is None:
            yield ids
            continue
        yield Marked(ids, _overlapping(np.asarray(encoded["offset_mapping"][i]).reshape(-1, 2), spans[i]))


def _overlapping(offsets: np.ndarray, spans: list[tuple[int, int]]) -> list[bool]:
    """Whether each token's characters [start, end) overlap one of `spans` (ascending, disjoint)."""
    if not spans:
        return [False] * len(offsets)
    first, last = np.asarray(spans).T
    nearest = np.searchsorted(last, offsets[:, 0], side="right")  # the first span ending after the token starts
    inside = nearest < len(spans)
    nearest = np.minimum(nearest, len(spans) - 1)
    return (inside & (first[nearest] < offsets[:, 1])).tolist()


def windows(token_docs: Iterable[TokenDoc], packing: Packing) -> Iterator[Window]:
    """The windows of a harvest, in order (see the module doc for the packing rules); documents are numbered
    in `token_docs`' order, the empty ones (blank texts) counted and skipped. With `roles` every document is
    Marked, and what packing adds (BOS, separators) is not stored."""
    size, separator, marked = packing.context_size, packing.separator_token_id, packing.roles is not None
    if not packing.pack:
        for index, doc in enumerate(token_docs):
            if isinstance(doc, Pictured):
                yield _pictured(doc, packing, index)
                continue
            tokens = doc.tokens if marked else doc
            if not tokens:
                continue
            prefix = opening(packing, tokens[0])
            kept = size - len(prefix)
            dropped = (*range(len(prefix)), *_unstored(doc.stored[:kept], len(prefix))) if marked else ()
            yield Window(prefix + tokens[:kept], dropped, ((0, index),))
        return
    window: list[int] = []  # empty until its first token is known
    dropped: list[int] = []
    starts: list[tuple[int, int]] = []
    for index, doc in enumerate(token_docs):
        tokens = doc.tokens if marked else doc
        if not tokens:
            continue
        if window:
            starts.append((len(window), index))
            if separator not in (None, tokens[0]):
                dropped += [len(window)] if marked else []
                window.append(separator)
                if len(window) == size:
                    yield Window(window, tuple(dropped), tuple(starts))
                    window, dropped, starts = [], [], []
        start = 0
        while start < len(tokens):
            if not window:
                window = opening(packing, tokens[start])
                dropped = list(range(len(window))) if marked else []
                starts = [(0, index)]
            take = min(size - len(window), len(tokens) - start)
            if marked:
                dropped += _unstored(doc.stored[start : start + take], len(window))
            window.extend(tokens[start : start + take])
            start += take
            if len(window) == size:
                yield Window(window, tuple(dropped), tuple(starts))
                window, dropped, starts = [], [], []


def _pictured(doc: Pictured, packing: Packing, index: int) -> Window:
    """The window of a document with images: opened as any, its text past `context_size` cut after its last image
    token (a cut inside an image is refused: raise context_size)."""
    prefix = opening(packing, doc.tokens[0])
    if len(prefix) + doc.images_end > packing.context_size:
        raise ValueError(f"context_size: {doc.where} has {doc.images_end} tokens up to its last image's end "
                         f"({len(doc.tokens)} in all), more than a window of {packing.context_size} holds; a "
                         f"document's images are never cut: raise context_size to at least "
                         f"{len(prefix) + doc.images_end}")  # fmt: skip
    tokens = (prefix + doc.tokens)[: packing.context_size]
    return Window(tokens, (), ((0, index),), Prepared(torch.tensor(tokens), doc.vision))


def stored_rows(windows: list[Window], excluded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows' token ids end to end, and which of their rows are stored: not excluded by token id, nor
    dropped by the window."""
    flat = torch.tensor(list(chain.from_iterable(w.tokens for w in windows)), dtype=torch.long)
    keep = ~torch.isin(flat, excluded) if len(excluded) else torch.ones(len(flat), dtype=torch.bool)
    if any(w.dropped for w in windows):
        starts = accumulate([0, *(len(w.tokens) for w in windows[:-1])])
        keep[[start + p for start, w in zip(starts, windows) for p in w.dropped]] = False
    return flat, keep


def last_rows(keep: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Of the rows `keep` stores (windows of `lens` tokens, end to end), only each window's last."""
    at = keep.nonzero().squeeze(1)
    window = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[at]
    last = torch.zeros_like(keep)
    last[at[torch.cat([window[1:] != window[:-1], torch.ones(min(1, len(at)), dtype=torch.bool)])]] = True
    return last


def document_ids(windows: list[Window]) -> torch.Tensor:
    """The document index of each of the windows' tokens, end to end (-1 in a window that lists none)."""
    index, count = [], []
    for w in windows:
        marks = w.documents or ((0, -1),)
        index += [i for _, i in marks]
        count += [end - p for (p, _), end in zip(marks, [*(p for p, _ in marks[1:]), len(w.tokens)])]
    return torch.repeat_interleave(torch.tensor(index, dtype=torch.long), torch.tensor(count, dtype=torch.long))


def _unstored(stored: list[bool], at: int) -> list[int]:
    """The positions, counted from `at`, of the tokens not stored."""
    return [at + i for i, keep in enumerate(stored) if not keep]


def opening(packing: Packing, first: int) -> list[int]:
    """What opens a window whose first document token is `first`: BOS, unless that token already is BOS
    (pre-tokenized rows often start with it; the model never sees BOS twice, as in SAELens)."""
    return [] if packing.bos_token_id in (None, first) else [packing.bos_token_id]
