"""A request's captured rows as they arrive, step by step, and what it finally returns.

Each step the plan asks every stream which of the step's positions to gather (`select`) and the stream
holds the plan segment's `Held`, where the rows land after the forward (`StepPlan.deliver`); it reads them
only when its result is built. A decode step's one row per stream (`take`) joins the step's batch of the
streams with the same taps, one segment for all, so a decode step costs a few integer operations per
request and no tensor op or container. Chunked prefill, preemption and recompute never change what a
request gets: a position is offered to a stream once, whatever recomputes it later.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from vlens.capture.names import Part, is_pattern
from vlens.capture.positions import Positions
from vlens.capture.readouts import Readout
from vlens.sae.readout import SAEReadout

if TYPE_CHECKING:
    from vlens.outputs import RequestOutput


def widen(tap: str, rows: torch.Tensor, width: int) -> torch.Tensor:
    """Attention scores or patterns widened to `width` keys with keys that are not there: -inf scores,
    zero probabilities."""
    fill = 0.0 if tap.endswith("hook_pattern") else float("-inf")
    return F.pad(rows, (0, width - rows.shape[-1]), value=fill)


def _bytes(tap_rows: dict[str, torch.Tensor], taps: Sequence[str]) -> np.ndarray:
    """[rows, bytes]: each row's values at `taps`, one after the other, as raw bytes (numpy views cost a tenth
    of a tensor's, and numpy has no bfloat16)."""
    parts = [tap_rows[tap] for tap in taps]
    parts = [p.reshape(p.shape[0], -1).view(torch.uint8).numpy() for p in parts]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)


class Layout(NamedTuple):  # (a tuple: one is made per tap of a batch per step)
    """Where one tap's values sit in a row of `_bytes`, and what they are."""

    tap: str
    start: int
    stop: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # of one row

    def rows(self, joined: np.ndarray) -> torch.Tensor:
        """This tap's rows of `joined` [rows, bytes], as a new tensor."""
        values = np.ascontiguousarray(joined[:, self.start : self.stop])
        return torch.from_numpy(values).view(self.dtype).view(len(joined), *self.shape)


def _layout(tap_rows: dict[str, torch.Tensor], taps: Sequence[str]) -> list[Layout]:
    out, at = [], 0
    for tap in taps:
        rows = tap_rows[tap]
        shape = tuple(rows.shape[1:])
        size = math.prod(shape) * rows.element_size()
        out.append(Layout(tap, at, at + size, rows.dtype, shape))
        at += size
    return out


@dataclass(slots=True)  # (one per plan segment)
class Held:
    """One plan segment's rows of one step as streams hold them: positions from the plan, rows per tap once
    the step delivers them (`put`). A stream holds all of them, or, of a decode step's batch (one with
    `taps`), row i alone: a batch keeps its rows as the bytes of all its taps, which each result slices."""

    positions: Sequence[int]
    taps: tuple[str, ...] = ()  # a batch's: its streams' taps
    rows: list[int] = field(default_factory=list)  # a batch's: the packed row of each position, as planned
    tap_rows: dict[str, object] = field(default_factory=dict)  # (a batch's: until all its taps arrived)
    row_bytes: np.ndarray | None = None  # a batch's: [rows, 1, bytes] once delivered: a stream's row i is [i]
    layout: list[Layout] = field(default_factory=list)

    @property
    def delivered(self) -> bool:
        """Whether the step's rows arrived. A result built before they do is that of a sequence that ended in
        the step before, with this one queued ahead of its end (async scheduling): these rows are not its."""
        return self.row_bytes is not None if self.taps else bool(self.tap_rows)

    def put(self, tap: str, rows: object) -> None:
        self.tap_rows[tap] = rows
        if self.taps and len(self.tap_rows) == len(self.taps):
            self.layout = _layout(self.tap_rows, self.taps)
            self.row_bytes = _bytes(self.tap_rows, self.taps)[:, None]
            self.tap_rows = {}


@dataclass
class RowStream:
    """One set of taps collected at one position spec (a Capture, or the hidden-states shortcut)."""

    kind: str  # "capture" | "hidden_states"
    hooks: dict[str, str]  # requested name -> canonical tap
    positions: Positions
    prompt_len: int
    parts: dict[str, tuple[Part, ...]]  # canonical tap -> what its result holds per row (bind.result_parts)
    exclude: torch.Tensor | None = None  # token ids whose rows are left out
    dtype: torch.dtype | None = None
    readout: Readout | SAEReadout | None = None  # on-device transform of each step's rows (probe, logit lens, SAE)
    reduce: str = "none"  # "mean": one row, the mean over the selected rows
    logit_lens: int | None = None  # top-k of the logit lens: rows are (token ids, log-probabilities)
    heads: torch.Tensor | None = None  # the heads kept at the per-head taps in `head_taps`
    head_taps: frozenset[str] = frozenset()
    offered_upto: int = 0  # positions below this were offered to the stream already
    _pieces: list[tuple[Held, int | None]] = field(default_factory=list)  # per step, ascending: all, or row i

    def __post_init__(self) -> None:
        self.taps = sorted(set(self.hooks.values()))
        self.patterns = any(is_pattern(t) for t in self.taps)
        self.first_wanted = self.positions.first_needed(self.prompt_len)
        self._window = self.positions.window(self.prompt_len) if self.exclude is None else None
        # Taps whose rows need work on the device before they leave it (a readout, a mean, a cast, heads)
        on_device = self.readout is not None or self.sums_on_device or self.dtype is not None
        self.device_taps = frozenset(t for t in self.taps if on_device or t in self.head_taps)
        # A step's one row may join the step's batch: one segment of the streams with the same taps
        self.batched = self._window is not None and not self.patterns and not self.device_taps
        self.tap_key = tuple(self.taps)

    @property
    def sums_on_device(self) -> bool:
        """Mean readouts add up each step's rows on the device when no row can be dropped later."""
        return self.reduce == "mean" and self.positions.exact

    def cast_only(self, tap: str) -> torch.dtype | None:
        """The dtype the rows of `tap` are only cast to on the device (no readout, mean or head selection);
        None when they need more, or nothing."""
        if self.readout is not None or self.sums_on_device or tap in self.head_taps:
            return None
        return self.dtype

    def first_needed(self) -> int:
        """Rows below this are never wanted again: their KV may come from the prefix cache."""
        return max(self.offered_upto, self.first_wanted)

    def select(self, token_ids: list[int], start: int, end: int) -> Sequence[int]:
        """Positions of a step's rows [start, end) to gather: wanted, new, and not excluded."""
        start, offered = max(start, self.offered_upto), self.offered_upto
        self.offered_upto = max(offered, end)
        if self._window is not None:  # (every step of most captures: one range, no call)
            return range(max(start, self._window[0]), min(end, self._window[1]))
        pos = self.positions.candidates(start, end, self.prompt_len)
        if self.exclude is not None and len(pos):
            at = torch.as_tensor(pos)
            pos = at[~torch.isin(torch.tensor(token_ids)[at], self.exclude)].tolist()
        return pos

    def take(self, position: int, row: int, batch: Held) -> None:
        """`select` of a step's one row at `position` (packed row `row`), for a stream with a window
        (`batched`): if it is wanted, it joins the step's `batch`, whose row it holds."""
        if position < self.offered_upto:
            return
        self.offered_upto = position + 1
        if self._window[0] <= position < self._window[1]:
            self._pieces.append((batch, len(batch.positions)))
            batch.positions.append(position)
            batch.rows.append(row)

    def hold(self, held: Held, i: int | None = None) -> None:
        """Rows of this step are `held`'s (all of them, or row i); a tail drops older rows it no longer needs.
        (A batched stream has no tail: its rows are all kept.)"""
        self._pieces.append((held, i))
        if not self.positions.tail:
            return
        newest = held.positions[-1] - 1  # (the step before: this one may be queued ahead of the sequence's end)
        while len(self._pieces) > 1 and self.positions.tail_obsolete(self._pieces[0][0].positions, newest):
            self._pieces.pop(0)

    def _collected(self) -> tuple[list[int], dict[str, list]]:
        """Every collected position, and each tap's pieces of rows in the same order (a batched stream's:
        one tensor, joined from the bytes of its rows)."""
        n = len(self._pieces)
        while n and not self._pieces[n - 1][0].delivered:  # (only the newest can be: queued ahead of the end)
            n -= 1
        pieces, positions = self._pieces[:n], []
        for held, i in pieces:
            if i is None:
                positions.extend(held.positions)
            else:
                positions.append(held.positions[i])
        if not (self.batched and pieces):
            return positions, {tap: [held.tap_rows[tap] for held, _ in pieces] for tap in self.taps}
        taps = self.tap_key
        joined = np.concatenate([_bytes(held.tap_rows, taps) if i is None else held.row_bytes[i] for held, i in pieces])
        last, i = pieces[-1]
        layout = _layout(last.tap_rows, taps) if i is None else last.layout
        return positions, {part.tap: [part.rows(joined)] for part in layout}

    def result(self, num_rows: int, model_dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, object]]:
        """(positions, {requested name: rows or (ids, logprobs)}) per the spec, once the sequence has
        `num_rows` rows."""
        collected, pieces_of = self._collected()
        positions = torch.from_numpy(np.array(collected, dtype=np.int64))
        keep = self.positions.keep(positions, num_rows)
        if bool(keep.all()):  # (the usual case: no copy through a mask)
            keep = None

        def kept_of(rows: torch.Tensor) -> torch.Tensor:
            return rows if keep is None else rows[keep]

        kept = kept_of(positions)
        dtype = self.dtype or model_dtype
        out: dict[str, object] = {}
        for tap in self.taps:
            pieces = pieces_of[tap]
            if pieces and is_pattern(tap):  # K: the last kept row's context; each piece is as wide as its own
                width = int(kept.max()) + 1 if len(kept) else 0
                pieces = [widen(tap, p[..., :width], width) for p in pieces]
            if not pieces:
                empty = tuple(part.empty() for part in self.parts[tap])
                out[tap] = empty if self.logit_lens or isinstance(self.readout, SAEReadout) else empty[0]
            elif self.sums_on_device:
                out[tap] = (sum(p.double() for p in pieces) / len(positions)).to(dtype)
            elif isinstance(pieces[0], tuple):
                out[tap] = tuple(kept_of(torch.cat(parts)) for parts in zip(*pieces))
            else:
                rows = kept_of(pieces[0] if self.batched else torch.cat(pieces))  # (a batched stream's: joined)
                out[tap] = rows.mean(0, keepdim=True) if self.reduce == "mean" and len(rows) else rows
        return kept, {name: out[tap] for name, tap in self.hooks.items()}

    def place(self, out: RequestOutput, results: dict[str, object]) -> None:
        """Put the results where a RequestOutput keeps them: SAE features, logit lens or activations."""
        if isinstance(self.readout, SAEReadout):
            for name, result in results.items():
                self.readout.place(out, name, result)
        else:
            (out.logit_lens if self.logit_lens else out.activations).update(results)
