"""Activations leaving the server: their size bound before a request runs, their safetensors encoding,
and the short-lived store behind download handles.

Safetensors is self-describing (names, dtypes, shapes) and binary, so neither side parses floats
from JSON. One file per request holds each requested hook `[rows, ...]`, `positions` `[rows]`
(the sequence position of each row), `token_ids` (prompt then generated tokens, so row p's token
is token_ids[positions[p]]) and, with return_hidden_states, `hidden_states` `[rows, d]` at every
position. Readouts change the hook tensors' shapes (`reduce: "mean"` one row, `project` [rows, k]);
a logit lens gives `{hook}.logit_lens.token_ids` and `{hook}.logit_lens.logprobs` [rows, k] instead.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from vlens import tensor_file
from vlens.capture.bind import result_parts
from vlens.capture.names import FINAL_NORM, resolve_hooks, row_size
from vlens.capture.positions import rows_of
from vlens.outputs import RequestOutput
from vlens.sampling_params import SamplingParams

INT64 = 8
DOWNLOAD_CHUNK = 1 << 20  # what a handle's download hands the transport at a time


def capture_bound(
    params: SamplingParams,
    prompt_len: int,
    shapes: dict[str, tuple[int, ...]],
    cfg,
    model_dtype: torch.dtype,
) -> int:
    """Upper bound on the tensor bytes a request can return, known before it runs: rows the position
    spec can select (given the prompt length and max_tokens) times the bytes of a row of every hook,
    plus positions, token ids and the hidden-states shortcut. Raises ValueError for unknown hooks."""
    total = 0
    rows_all = rows_of(prompt_len, params.max_tokens)
    capture = params.capture
    if capture is not None:
        row = 0  # attention patterns: as many keys as the widest row's context
        for tap in resolve_hooks(capture.hooks, cfg).values():
            row += sum(row_size(p.shape, rows_all) * p.dtype.itemsize for p in result_parts(capture, tap, shapes[tap], model_dtype))
        rows = capture.positions.max_rows(prompt_len, params.max_tokens)
        total += rows * INT64 + (1 if capture.reduce == "mean" else rows) * row
    if params.return_hidden_states:
        total += rows_all * math.prod(shapes[FINAL_NORM]) * model_dtype.itemsize
    if total:
        total += (prompt_len + params.max_tokens) * INT64  # token_ids
    return total


def encode(out: RequestOutput, model_name: str) -> bytearray:
    """One request's captured tensors as safetensors bytes (see the module docstring for the layout),
    each tensor copied once into them (alias names, hidden_states.3 and blocks.3.hook_resid_pre, each
    get their rows)."""
    tensors = dict(out.activations)
    for name, (ids, logprobs) in out.logit_lens.items():
        tensors[f"{name}.logit_lens.token_ids"] = ids
        tensors[f"{name}.logit_lens.logprobs"] = logprobs
    if out.activation_positions is not None:
        tensors["positions"] = out.activation_positions.to(torch.int64)
    if out.hidden_states is not None:
        tensors["hidden_states"] = out.hidden_states
    tokens = out.prompt_token_ids + out.outputs[0].token_ids
    tensors["token_ids"] = torch.tensor(tokens, dtype=torch.int64)
    metadata = {
        "format": "vlens.activations/1",
        "model": model_name,
        "request_id": out.request_id,
        "prompt_tokens": str(len(out.prompt_token_ids)),
        "hooks": json.dumps(list(out.activations) + list(out.logit_lens)),
    }
    return tensor_file.encode(tensors, metadata)


def owner_of(api_key: str | None) -> bytes:
    """What a handle is bound to: a digest of the key that created it (empty without authentication)."""
    return hashlib.sha256(api_key.encode()).digest() if api_key else b""


@dataclass
class _Entry:
    data: bytes
    owner: bytes
    expires_at: float


class ActivationStore:
    """Payloads too large to send inline, kept until downloaded once or until their TTL passes.

    Ids are 192 random bits, so they cannot be guessed; a download must also come with the API key
    that made the request. Only the event-loop thread touches the store, so it needs no lock."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.time):
        self.ttl_s, self.clock = ttl_s, clock
        self._entries: dict[str, _Entry] = {}
        self._sending = 0  # bytes of downloads under way: out of the store, still in memory until sent

    def put(self, data: bytes, owner: bytes) -> tuple[str, float]:
        """Store a payload; return its id and its expiry (unix time)."""
        self.sweep()
        handle = "act-" + secrets.token_urlsafe(24)
        expires_at = self.clock() + self.ttl_s
        self._entries[handle] = _Entry(data, owner, expires_at)
        return handle, expires_at

    def take(self, handle: str, owner: bytes) -> bytes | None:
        """The payload, removed from the store; None if unknown, expired or made under another key."""
        self.sweep()
        entry = self._entries.get(handle)
        if entry is None or not hmac.compare_digest(entry.owner, owner):
            return None
        del self._entries[handle]
        self._sending += len(entry.data)
        return entry.data

    def sent(self, data: bytes) -> None:
        """A download taken with `take` ended, sent whole or not (its client left): its bytes are freed."""
        self._sending -= len(data)

    def sweep(self) -> None:
        now = self.clock()
        for handle in [h for h, e in self._entries.items() if e.expires_at <= now]:
            del self._entries[handle]

    @property
    def count(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held for downloads: the stored payloads and those being sent."""
        return self._sending + sum(len(e.data) for e in self._entries.values())


class Download(StreamingResponse):
    """A payload taken from the store, sent in chunks: the transport buffers one chunk rather than a
    second copy of the whole payload (a slow client would make it hold all of it), and the bytes stay in
    the store's count (what --max-capture-bytes-in-flight bounds) until the response ends, however it ends."""

    def __init__(self, data: bytes, handle: str, store: ActivationStore):
        headers = {
            "Content-Length": str(len(data)),
            "Content-Disposition": f'attachment; filename="{handle}.safetensors"',
        }
        super().__init__(_chunks(data), media_type="application/octet-stream", headers=headers)
        self.data, self.store = data, store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.store.sent(self.data)


async def _chunks(data: bytes) -> AsyncIterator[memoryview]:
    view = memoryview(data)
    for start in range(0, len(view), DOWNLOAD_CHUNK):
        yield view[start : start + DOWNLOAD_CHUNK]


def present(data: bytes, inline_limit: int, store: ActivationStore, owner: bytes) -> dict:
    """The `vlens.activations` object of a response: the bytes inline, or a handle to download them."""
    described = {"format": "safetensors", "bytes": len(data)}
    if len(data) <= inline_limit:
        return {**described, "encoding": "base64", "data": base64.b64encode(data).decode("ascii")}
    handle, expires_at = store.put(data, owner)
    return {**described, "id": handle, "url": f"/v1/activations/{handle}", "expires_at": int(expires_at)}
