"""One step's plan for the taps, as plain host tensors: which packed rows each tap gathers and for whom,
and which rows each tap edits, with which vector, in which order.

Built once per step from the scheduled chunks (a handful of small tensors per request, no per-token
Python); `runtime.TapRuntime.arm` turns it into the fixed-shape device buffers the taps read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlens.capture.bind import RequestTaps
from vlens.capture.names import LOGITS


@dataclass
class Segment:
    """Rows gathered for one owner in one step: the RowStream that asked (engine), or the index of a
    sequence (trace, harvest)."""

    owner: object
    positions: torch.Tensor  # [n] long: the sequence position of each row


@dataclass
class Chunk:
    """One sequence's tokens in a step: positions [start, start + count), packed rows from `row` on."""

    taps: RequestTaps
    token_ids: list[int]
    start: int
    count: int
    row: int


@dataclass
class Collected:
    """A piece of one step's gathered rows, on the host: `rows` of `tap` for plan segment `segment`."""

    segment: int
    tap: str
    rows: torch.Tensor | tuple[torch.Tensor, ...]


@dataclass
class StepPlan:
    segments: list[Segment] = field(default_factory=list)
    # tap -> [(segment, packed rows)] in segment order
    gathers: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    # tap -> passes, each (rows, vector-table rows, kinds): pass p holds each request's p-th edit at the tap
    edits: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.gathers or self.edits)

    def gather(self, owner: object, positions: torch.Tensor, rows: torch.Tensor, taps: list[str]) -> None:
        self.segments.append(Segment(owner, positions))
        for tap in taps:
            self.gathers.setdefault(tap, []).append((len(self.segments) - 1, rows))

    def deliver(self, collected: list[Collected]) -> None:
        """Hand each stream its rows of this step (the engine's segments are owned by RowStreams)."""
        by_segment: dict[int, dict[str, object]] = {}
        for c in collected:
            by_segment.setdefault(c.segment, {})[c.tap] = c.rows
        for segment, tap_rows in by_segment.items():
            self.segments[segment].owner.add(self.segments[segment].positions, tap_rows)

    def logit_rows(self, sample_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows whose logits are computed — the sampled ones and any a gather of LOGITS wants, once
        each — and where the sampled rows sit among them (None: they are all of them). Gathers of LOGITS
        are re-indexed into the logits rows."""
        parts = self.gathers.get(LOGITS)
        if not parts:
            return sample_rows, None
        rows = torch.unique(torch.cat([sample_rows, *(r for _, r in parts)]))
        self.gathers[LOGITS] = [(segment, torch.searchsorted(rows, r)) for segment, r in parts]
        return rows, torch.searchsorted(rows, sample_rows)


def plan_step(chunks: list[Chunk]) -> StepPlan:
    """The plan of one engine step: each request's streams say which of its positions to gather, its
    interventions which rows to edit."""
    plan = StepPlan()
    edits: dict[str, list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = {}
    for c in chunks:
        end = c.start + c.count
        for stream in c.taps.streams:
            positions = stream.select(c.token_ids, c.start, end)
            if len(positions):
                plan.gather(stream, positions, positions - c.start + c.row, stream.taps)
        depth: dict[str, int] = {}  # edits of this request so far at each tap: its next pass
        for iv in c.taps.interventions:
            positions, vectors = iv.rows_at(c.start, end)
            if not len(positions):
                continue
            entry = (positions - c.start + c.row, vectors, torch.full_like(positions, iv.kind))
            for tap in iv.taps:
                p = depth[tap] = depth.get(tap, -1) + 1
                passes = edits.setdefault(tap, [])
                if p == len(passes):
                    passes.append([])
                passes[p].append(entry)
    plan.edits = {
        tap: [tuple(torch.cat(column) for column in zip(*entries)) for entries in passes]
        for tap, passes in edits.items()
    }
    return plan
