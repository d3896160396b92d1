"""Binding a request's Capture and interventions to the loaded model: hook names resolved to taps,
positions checked against the rows the request can have, readouts and vectors shaped for the taps.

Everything here runs when a request is submitted, before any of it runs, so a bad request fails alone
with a ValueError naming its field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch

from vlens.capture.interventions import Ablate, Patch, Steer
from vlens.capture.names import FINAL_NORM, LOGITS, resolve_hooks
from vlens.capture.positions import Positions
from vlens.capture.readouts import logit_lens, project
from vlens.capture.rows import RowStream
from vlens.capture.spec import Capture

if TYPE_CHECKING:
    from vlens.models.base import DecoderLM
    from vlens.sampling_params import SamplingParams

# What an edit does to a row x with vector v (runtime.Tap applies it; KEEP pads a pass).
KEEP, STEER, ABLATE, PATCH = 0, 1, 2, 3
KINDS = {Steer: STEER, Ablate: ABLATE, Patch: PATCH}


@dataclass
class BoundIntervention:
    """An intervention bound to the model: its taps, and its vectors as rows of the runtime's vector table."""

    kind: int  # STEER | ABLATE | PATCH
    taps: list[str]
    positions: Positions
    prompt_len: int
    data: torch.Tensor  # [n, width] float32: scale * vector, the unit direction, or the patch rows
    value_positions: list[int] | None = None  # a multi-row patch: the position of each data row
    table_rows: list[int] | None = None  # where the runtime stored each row of `data` (set on upload)

    @property
    def width(self) -> int:
        return self.data.shape[1]

    def rows_at(self, start: int, end: int) -> tuple[Sequence[int], list[int]]:
        """(positions in [start, end) it edits, the vector-table row for each)."""
        positions = self.positions.candidates(start, end, self.prompt_len)
        if self.value_positions is None:
            return positions, self.table_rows * len(positions)
        row_of = dict(zip(self.value_positions, self.table_rows))
        return positions, [row_of[p] for p in positions]


@dataclass
class RequestTaps:
    """What one request does at the taps: the row streams it collects and the interventions it applies."""

    streams: list[RowStream] = field(default_factory=list)
    interventions: list[BoundIntervention] = field(default_factory=list)

    def reusable_prefix(self, num_tokens: int) -> int:
        """Leading tokens whose KV may come from the prefix cache without losing a wanted row."""
        return min([s.first_needed() for s in self.streams], default=num_tokens)


def bind_request(
    params: SamplingParams, prompt_len: int, max_rows: int, model: DecoderLM, shapes: dict[str, tuple[int, ...]],
    enable_capture: bool,
) -> RequestTaps:  # fmt: skip
    """Check a request's capture and interventions against the model; `max_rows` is the most rows the
    request can have (prompt plus max_tokens, within the model length, minus one)."""
    capture = params.capture
    if (capture is not None or params.return_hidden_states) and not enable_capture:
        raise ValueError(
            "capture: this LLM was created with enable_capture=False; create it with "
            "LLM(..., enable_capture=True) to capture activations or hidden states"
        )
    bound = RequestTaps()
    if capture is not None:
        capture.positions.check_range(max_rows, "capture.positions", prompt_len, params.max_tokens)
        bound.streams.append(_capture_stream(capture, prompt_len, model, shapes))
    if params.return_hidden_states:
        bound.streams.append(RowStream("hidden_states", {FINAL_NORM: FINAL_NORM}, Positions("all"), prompt_len, shapes))
    for i, iv in enumerate(params.interventions):
        bound.interventions.append(_intervention(iv, f"interventions[{i}]", prompt_len, max_rows, model, shapes))
    return bound


def _capture_stream(capture: Capture, prompt_len: int, model: DecoderLM, shapes: dict) -> RowStream:
    cfg = model.cfg
    hooks = resolve_hooks(capture.hooks, cfg)
    taps = set(hooks.values())
    shapes = {t: shapes[t] for t in taps}
    weight = model.lm_head.weight
    readout = None
    if capture.project is not None:
        w, b = capture.project
        bad = {t: s for t, s in shapes.items() if (w.shape[0],) != (math.prod(s),)}
        if bad:
            raise ValueError(f"capture.project: W has {w.shape[0]} rows; taps {bad} have rows of another size")
        b = None if b is None else b.to(weight.device, weight.dtype)
        readout = partial(project, w=w.to(weight.device, weight.dtype), b=b)
        shapes = {t: (w.shape[1],) for t in taps}
    if capture.logit_lens is not None:
        bad = [t for t, s in shapes.items() if s != (cfg.hidden_size,) or t == LOGITS]
        if bad:
            raise ValueError(f"capture.logit_lens: needs residual-stream taps of width {cfg.hidden_size}; not {bad}")
        readout = partial(logit_lens, model=model, k=capture.logit_lens)
    exclude = torch.tensor(sorted(capture.exclude_token_ids), dtype=torch.long) if capture.exclude_token_ids else None
    return RowStream(
        "capture", hooks, capture.positions, prompt_len, shapes, exclude, capture.dtype, readout, capture.reduce,
        capture.logit_lens,
    )  # fmt: skip


def _intervention(
    iv: Steer | Ablate | Patch, where: str, prompt_len: int, max_rows: int, model: DecoderLM, shapes: dict
) -> BoundIntervention:
    taps = sorted(set(resolve_hooks(iv.hook, model.cfg).values()))
    if LOGITS in taps:
        raise ValueError(f"{where}.hook: interventions on {LOGITS} are not supported; steer the residual instead")
    shape_set = {shapes[t] for t in taps}
    if len(shape_set) > 1:
        raise ValueError(f"{where}.hook: {iv.hook!r} matches taps of different shapes {sorted(shape_set)}")
    shape = shape_set.pop()
    width = math.prod(shape)
    data = iv.vector * iv.scale if isinstance(iv, Steer) else iv.direction if isinstance(iv, Ablate) else iv.values
    value_positions = None
    if isinstance(iv, Patch) and data.numel() != width:
        rows = iv.positions.explicit_rows(prompt_len)
        if rows is None or data.numel() != len(rows) * width:
            raise ValueError(
                f"{where}.values: shape {tuple(data.shape)} fits neither one row of {iv.hook} {shape} nor one row "
                f"per position of {iv.positions}" + ("" if rows is None else f" ({len(rows)} rows)")
            )
        value_positions = rows
    elif data.numel() != width:
        raise ValueError(f"{where}: vector of shape {tuple(data.shape)} does not fit {iv.hook}, whose rows are {shape}")
    if iv.positions.kind == "list":
        bad = [p for p in iv.positions.indices if p >= max_rows]
        if bad:
            raise ValueError(f"{where}.positions: {bad} out of range; this request has at most {max_rows} rows")
    return BoundIntervention(KINDS[type(iv)], taps, iv.positions, prompt_len, data.reshape(-1, width), value_positions)
