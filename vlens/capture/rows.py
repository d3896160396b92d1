"""A request's captured rows as they arrive, step by step, and what it finally returns.

Each step the plan asks every stream which of the step's positions to gather (`select`); after the
forward the rows come back (`add`). Chunked prefill, preemption and recompute never change what a
request gets: a position is offered to a stream once, whatever recomputes it later. Positions stay
Python ranges and lists until the end, so a step costs a few integer operations per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

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
    _positions: list[Sequence[int]] = field(default_factory=list)  # per step, ascending
    _rows: dict[str, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.taps = sorted(set(self.hooks.values()))
        self.patterns = any(is_pattern(t) for t in self.taps)
        self.first_wanted = self.positions.first_needed(self.prompt_len)
        self._window = self.positions.window(self.prompt_len) if self.exclude is None else None
        # Taps whose rows need work on the device before they leave it (a readout, a mean, a cast, heads)
        on_device = self.readout is not None or self.sums_on_device or self.dtype is not None
        self.device_taps = frozenset(t for t in self.taps if on_device or t in self.head_taps)

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

    def add(self, positions: Sequence[int], tap_rows: dict[str, object]) -> None:
        self._positions.append(positions)
        for tap, rows in tap_rows.items():
            self._rows.setdefault(tap, []).append(rows)
        if not self.positions.tail:
            return
        newest = positions[-1]
        while len(self._positions) > 1 and self.positions.tail_obsolete(self._positions[0], newest):
            self._positions.pop(0)
            for pieces in self._rows.values():
                pieces.pop(0)

    def result(self, num_rows: int, model_dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, object]]:
        """(positions, {requested name: rows or (ids, logprobs)}) per the spec, once the sequence has
        `num_rows` rows."""
        positions = torch.tensor(list(chain.from_iterable(self._positions)), dtype=torch.long)
        keep = self.positions.keep(positions, num_rows)
        if bool(keep.all()):  # (the usual case: no copy through a mask)
            keep = slice(None)
        kept = positions[keep]
        dtype = self.dtype or model_dtype
        out: dict[str, object] = {}
        for tap in self.taps:
            pieces = self._rows.get(tap)
            if pieces and is_pattern(tap):  # K: the last kept row's context; each piece is as wide as its own
                width = int(kept.max()) + 1 if len(kept) else 0
                pieces = [widen(tap, p[..., :width], width) for p in pieces]
            if not pieces:
                empty = tuple(part.empty() for part in self.parts[tap])
                out[tap] = empty if self.logit_lens or isinstance(self.readout, SAEReadout) else empty[0]
            elif self.sums_on_device:
                out[tap] = (sum(p.double() for p in pieces) / len(positions)).to(dtype)
            elif isinstance(pieces[0], tuple):
                out[tap] = tuple(torch.cat(parts)[keep] for parts in zip(*pieces))
            else:
                rows = torch.cat(pieces)[keep]
                out[tap] = rows.mean(0, keepdim=True) if self.reduce == "mean" and len(rows) else rows
        return kept, {name: out[tap] for name, tap in self.hooks.items()}

    def place(self, out: RequestOutput, results: dict[str, object]) -> None:
        """Put the results where a RequestOutput keeps them: SAE features, logit lens or activations."""
        if isinstance(self.readout, SAEReadout):
            for name, result in results.items():
                self.readout.place(out, name, result)
        else:
            (out.logit_lens if self.logit_lens else out.activations).update(results)
