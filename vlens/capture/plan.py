"""One step's plan for the taps: which packed rows each tap gathers and for whom, and which rows each
tap edits, with which vector, in which order.

Built once per step from the scheduled chunks with a few integer operations per request (rows stay
Python ranges and lists here), and none for a decode step that repeats the one before (`plan_decode`);
`runtime.TapRuntime.arm` turns it into the fixed-shape device buffers the taps read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vlens.capture.bind import RequestTaps
from vlens.capture.names import LOGITS
from vlens.capture.rows import Batch, DecodePages, Held


def shift(rows: Sequence[int], by: int) -> Sequence[int]:
    """Positions of a sequence -> rows of the packed batch (a range stays a range)."""
    if isinstance(rows, range):
        return range(rows.start + by, rows.stop + by, rows.step)
    return [r + by for r in rows]


@dataclass(slots=True)  # (slots: one is made per request per prefill step)
class Segment:
    """Rows gathered for one owner in one step: the RowStream that asked (engine), None for a decode step's
    batch of streams (each holds one row), or the index of a sequence (trace, harvest)."""

    owner: object
    positions: Sequence[int]  # the sequence position of each row, ascending (a batch's: one per stream)
    held: Held | Batch  # where streams find the rows once delivered
    keys: torch.Tensor | None = None  # pattern taps: where key j of the sequence is, for j up to the last row
    # pattern taps: the last key each row sees, where some see past their own position (an image's tokens that attend
    # to each other both ways: vlens.images); None: each its own
    limits: Sequence[int] | None = None


@dataclass(slots=True)
class Chunk:
    """One sequence's tokens in a step: positions [start, start + count), packed rows from `row` on."""

    taps: RequestTaps
    token_ids: list[int]
    start: int
    count: int
    row: int
    block_table: list[int] | None = None  # where the sequence's KV lives (pattern taps read its keys)
    limits: np.ndarray | None = None  # the last key each position sees, where some see past their own (Segment's)


@dataclass
class Edit:
    """One pass of edits at a tap: distinct packed rows, each with a vector-table row and a kind, and the taps
    where its transcoder clamps read their latents."""

    rows: list[int] = field(default_factory=list)
    vectors: list[int] = field(default_factory=list)
    kinds: list[int] = field(default_factory=list)
    reads: set[str] = field(default_factory=set)


@dataclass
class Collected:
    """One tap's gathered rows of one step, on the host: for each plan segment in `segments`, its rows
    (or its readout's result) at the same index of `rows`."""

    tap: str
    segments: list[int]
    rows: list


@dataclass
class StepPlan:
    segments: list[Segment] = field(default_factory=list)
    # tap -> [(segment, packed rows)] in segment order
    gathers: dict[str, list[tuple[int, Sequence[int]]]] = field(default_factory=dict)
    # tap -> passes in order: pass p holds each request's p-th edit at the tap
    edits: dict[str, list[Edit]] = field(default_factory=dict)
    readouts: set[str] = field(default_factory=set)  # taps some segment's stream reads out on the device
    batches: dict[tuple[str, ...], Batch] = field(default_factory=dict)  # taps -> the step's batch of streams

    def __bool__(self) -> bool:
        return bool(self.gathers or self.edits)

    def gather(
        self, owner: object, positions: Sequence[int], rows: Sequence[int], taps: Sequence[str],
        keys: torch.Tensor | None = None, held: Batch | None = None, limits: Sequence[int] | None = None,
    ) -> Segment:  # fmt: skip
        """Gather `rows` (packed) at `taps` for `owner` (None: a batch, which its streams hold already)."""
        segment = Segment(owner, positions, held or Held(positions), keys, limits)
        index = len(self.segments)
        self.segments.append(segment)
        for tap in taps:
            parts = self.gathers.get(tap)
            if parts is None:
                self.gathers[tap] = [(index, rows)]
            else:
                parts.append((index, rows))
        return segment

    def batch(self, taps: tuple[str, ...], pages: DecodePages, room: int) -> Batch:
        """The step's batch of the streams with these taps (at most `room` rows), made by the first."""
        batch = self.batches.get(taps)
        if batch is None:
            batch = self.batches[taps] = pages.batch(taps, room)
        return batch

    def close(self) -> StepPlan:
        """The plan, once its streams have all been asked: each batch with rows is a segment."""
        for taps, batch in self.batches.items():
            if batch.positions:
                batch.page.used = batch.offset + len(batch.positions)
                self.gather(None, batch.positions, batch.rows, taps, held=batch)
        return self

    def deliver(self, collected: list[Collected]) -> None:
        """Hand the streams their rows of this step: each segment's rows, where its streams hold them."""
        for c in collected:
            for segment, rows in zip(c.segments, c.rows):
                self.segments[segment].held.put(c.tap, rows)

    def logit_rows(self, sample_rows: list[int]) -> tuple[list[int], list[int] | None]:
        """The rows whose logits are computed — the sampled ones and any a gather of LOGITS wants, once
        each, ascending — and where the sampled rows sit among them (None: they are all of them).
        Gathers of LOGITS are re-indexed into the logits rows."""
        parts = self.gathers.get(LOGITS)
        if not parts:
            return sample_rows, None
        rows = sorted(set(sample_rows).union(*(r for _, r in parts)))
        at = {r: i for i, r in enumerate(rows)}
        self.gathers[LOGITS] = [(segment, [at[r] for r in wanted]) for segment, wanted in parts]
        return rows, [at[r] for r in sample_rows]


def cache_slots(block_table: list[int], block_size: int, count: int) -> torch.Tensor:
    """The KV-cache slots of a sequence's first `count` positions."""
    j = torch.arange(count)
    return torch.tensor(block_table)[j // block_size] * block_size + j % block_size


def plan_step(chunks: list[Chunk], block_size: int, pages: DecodePages) -> StepPlan:
    """The plan of one engine step: each request's streams say which of its positions to gather, its
    interventions which rows to edit. A chunk's one row (a decode step) joins the step's batch of the
    streams with the same taps: one segment for all of them, so no container is made per stream."""
    plan = StepPlan()
    for c in chunks:
        _plan_chunk(plan, c, block_size, pages, len(chunks))
    return plan.close()


def plan_decode(seqs: list, positions: list[int], block_size: int, pages: DecodePages) -> StepPlan:
    """`plan_step` of a decode step, where sequence i (a vlens.engine.sequence.Sequence) feeds row i at
    `positions[i]`. A sequence whose streams batch and whose interventions edit one run of rows (most
    that capture or steer) makes no Chunk; a step that repeats the one before (`DecodePages.repeat`)
    asks no stream and no intervention."""
    plan = StepPlan()
    repeated = pages.repeat(seqs, positions)
    if repeated is not None:
        plan.batches, plan.edits = repeated
        return plan.close()
    # Whether the next step may repeat this one: every stream batched its row or is past its window, every
    # intervention edits its row or is past its run; and how many times at most, by the interventions' runs.
    steady, limit = True, math.inf
    lanes: dict[tuple[str, ...], list] = {}  # taps -> the streams of its batch, in its order
    for row, (seq, position) in enumerate(zip(seqs, positions)):
        taps = seq.taps
        if taps.batched:
            for stream in taps.streams:
                if stream.take(position, row, plan.batch(stream.tap_key, pages, len(seqs))):
                    lanes.setdefault(stream.tap_key, []).append(stream)
                else:
                    steady &= position >= stream.window_end
            if taps.interventions:
                for iv in taps.interventions:
                    first, end = iv.window
                    steady &= first <= position
                    limit = min(limit, end - position - 1) if position < end else limit
                plan_edits(plan, taps.interventions, position, position + 1, row - position)
        elif taps.streams or taps.interventions:
            steady = False
            chunk = Chunk(taps, seq.token_ids, position, 1, row, seq.block_table)
            _plan_chunk(plan, chunk, block_size, pages, len(seqs))
    plan.close()
    pages.remember(seqs, positions, (plan.batches, lanes, plan.edits) if steady else None, limit)
    return plan


def _plan_chunk(plan: StepPlan, c: Chunk, block_size: int, pages: DecodePages, room: int) -> None:
    """`room`: the most single rows the step may have."""
    end, offset = c.start + c.count, c.row - c.start
    for stream in c.taps.streams:
        if c.count == 1 and stream.batched:
            stream.take(c.start, c.row, plan.batch(stream.tap_key, pages, room))
            continue
        positions = stream.select(c.token_ids, c.start, end)
        if len(positions):
            keys = limits = None
            if stream.patterns:
                limits = None if c.limits is None else c.limits[np.asarray(positions) - c.start].tolist()
                keys = cache_slots(c.block_table, block_size, (limits or positions)[-1] + 1)
            segment = plan.gather(stream, positions, shift(positions, offset), stream.gathered, keys, limits=limits)
            stream.hold(segment.held)
            if stream.device_taps:
                plan.readouts |= stream.device_taps
    if c.taps.interventions:
        plan_edits(plan, c.taps.interventions, c.start, end, offset)


def plan_edits(plan: StepPlan, interventions: list, start: int, end: int, offset: int) -> None:
    """A request's edits of its positions [start, end) (packed rows: + `offset`), in the order it gave them."""
    depth: dict[str, int] = {}  # edits of this request so far at each tap: its next pass
    for iv in interventions:
        positions, vectors = iv.rows_at(start, end)
        if not len(positions):
            continue
        rows = shift(positions, offset)
        for tap in iv.taps:
            p = depth[tap] = depth.get(tap, -1) + 1
            passes = plan.edits.setdefault(tap, [])
            if p == len(passes):
                passes.append(Edit())
            passes[p].rows += rows
            passes[p].vectors += vectors
            passes[p].kinds += [iv.kind] * len(rows)
            if iv.reads is not None:
                passes[p].reads.add(iv.reads)
