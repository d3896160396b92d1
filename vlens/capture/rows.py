"""A request's captured rows as they arrive, step by step, and what it finally returns.

Each step the plan asks every stream which of the step's positions to gather (`select`) and the stream
holds the plan segment's `Held`, where the rows land after the forward (`StepPlan.deliver`); it reads them
only when its result is built. A decode step's one row per stream (`take`) joins the step's `Batch` of the
streams with the same taps, one segment for all, whose rows land in a `Page` that many steps fill: a
stream keeps a run of row numbers per page, so a decode step costs a few integer operations per request
and no tensor op or container, a step that repeats the one before none (`DecodePages.repeat`), and a
result one index per page. Chunked prefill, preemption and recompute never change what a request gets: a
position is offered to a stream once, whatever recomputes it later.
"""

from __future__ import annotations

import math
import weakref
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


# torch dtypes numpy has, and its own: their rows become numpy arrays with one torch op (`.numpy()`), and
# the rest of the work is numpy views, which cost a tenth of a tensor's; the others (bfloat16) go as bytes
_NUMPY = {t: torch.empty(0, dtype=t).numpy().dtype for t in (torch.float32, torch.float16, torch.float64, torch.int64)}


def _bytes(tap_rows: dict[str, torch.Tensor], taps: Sequence[str]) -> np.ndarray:
    """[rows, bytes]: each row's values at `taps`, one after the other, as raw bytes."""
    parts = []
    for tap in taps:
        rows = tap_rows[tap]
        values = rows.numpy() if rows.dtype in _NUMPY else rows.view(torch.uint8).numpy()
        parts.append(values.reshape(len(values), -1).view(np.uint8))
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)


class Layout(NamedTuple):
    """Where one tap's values sit in a row of `_bytes`, and what they are."""

    tap: str
    start: int
    stop: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # of one row

    def rows(self, joined: np.ndarray) -> torch.Tensor:
        """This tap's rows of `joined` [rows, bytes], as a new tensor."""
        values = np.ascontiguousarray(joined[:, self.start : self.stop])
        if self.dtype in _NUMPY:
            return torch.from_numpy(values.view(_NUMPY[self.dtype]).reshape(len(joined), *self.shape))
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
    """One plan segment's rows of one step, as the streams that asked for all of them hold them: positions
    from the plan, rows per tap once the step delivers them (`put`)."""

    positions: Sequence[int]
    tap_rows: dict[str, object] = field(default_factory=dict)

    @property
    def delivered(self) -> bool:
        """Whether the step's rows arrived. A result built before they do is that of a sequence that ended in
        the step before, with this one queued ahead of its end (async scheduling): these rows are not its."""
        return bool(self.tap_rows)

    def put(self, tap: str, rows: object) -> None:
        self.tap_rows[tap] = rows


PAGE_BYTES = 4 << 20  # the size of a page of decode rows, unless a few batches need more
SPARE_PAGES = 4  # memory of pages let go, kept for new ones: fresh memory costs a page fault per 4 KiB


@dataclass(eq=False)  # (no slots: `DecodePages` holds it by weak reference)
class Page:
    """Rows of the decode batches of streams with one set of taps, one batch after the other, each row the
    bytes of all the taps side by side (`layout`). Streams keep where their rows are, so a result is one
    index into each page it has rows in. Once it is full (`retire`) and its rows have all arrived, the
    streams still running copy theirs out (`Run.keep`) and the page goes, its memory back to `spare`: a long
    request keeps its own rows, not the pages of everything that ran beside it."""

    spare: list[np.ndarray]  # (DecodePages': flat buffers of PAGE_BYTES)
    used: int = 0  # rows planned
    arrived: int = 0  # rows written (batches arrive in the order they were planned)
    data: np.ndarray | None = None  # [rows, bytes], made when the first batch arrives (its bytes say how many)
    layout: list[Layout] = field(default_factory=list)
    runs: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # the runs with rows in it
    retired: bool = False  # no batch goes into it any more

    def has_room(self, rows: int) -> bool:
        return self.data is None or self.used + rows <= len(self.data)

    def write(self, offset: int, tap_rows: dict[str, torch.Tensor], taps: tuple[str, ...]) -> None:
        joined = _bytes(tap_rows, taps)
        end, width = offset + len(joined), joined.shape[1]
        if self.data is None:
            self.layout = _layout(tap_rows, taps)
            rows = PAGE_BYTES // width
            if rows >= 4 * end:
                flat = self.spare.pop() if self.spare else np.empty(PAGE_BYTES, np.uint8)
                self.data = flat[: rows * width].reshape(rows, width)
            else:  # (rows too wide for a page of PAGE_BYTES to hold a few batches)
                self.data = np.empty((4 * end, width), np.uint8)
        elif end > len(self.data):  # (batches planned before the first arrived outgrew it)
            self.data = np.concatenate([self.data[:offset], np.empty((2 * end - offset, width), np.uint8)])
        self.data[offset:end] = joined
        self.arrived = end
        self._let_go()

    def retire(self) -> None:
        """It is full: no batch goes into it from now on, and its rows go once they have all arrived."""
        self.retired = True
        self._let_go()

    def _let_go(self) -> None:
        if not self.retired or self.arrived < self.used:
            return
        runs = list(self.runs)
        for run in runs:
            run.keep()
        for run in runs:  # (after every run kept its rows: a repeat's lanes share its offsets)
            if run.shared is not None:
                run.shared.page = run.shared.last = None
        self.runs = weakref.WeakSet()

    def __del__(self) -> None:
        flat = None if self.data is None else self.data.base
        if flat is not None and flat.shape == (PAGE_BYTES,) and len(self.spare) < SPARE_PAGES:
            self.spare.append(flat)


@dataclass(slots=True)  # (one per set of taps per decode step)
class Batch:
    """A decode step's single rows of the streams with one set of taps (`RowStream.take`), one segment of the
    plan: rows [offset, offset + n) of `page` once delivered."""

    page: Page
    offset: int
    taps: tuple[str, ...]
    positions: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # the packed row of each position
    tap_rows: dict[str, object] = field(default_factory=dict)  # (until all its taps arrived)
    delivered: bool = False

    def put(self, tap: str, rows: object) -> None:
        self.tap_rows[tap] = rows
        if len(self.tap_rows) == len(self.taps):
            self.page.write(self.offset, self.tap_rows, self.taps)
            self.tap_rows, self.delivered = {}, True


@dataclass(slots=True, eq=False)
class Shared:
    """The decode batches that one batch's streams made again, step after step, all of them, in the same
    order: the page offset of each. Stream i's rows in them are offset + i, so such a step costs no work
    per stream (`DecodePages.repeat`)."""

    page: Page | None  # None once the page let its rows go
    offsets: list[int] = field(default_factory=list)
    last: Batch | None = None  # the newest, which may not have arrived yet


_NO_ROWS = np.empty((0, 0), np.uint8)


@dataclass(eq=False)  # (a few per stream: one per page it has rows in, and one per series of repeats; no slots:
class Run:  # its page holds it by weak reference)
    """A stream's rows at consecutive positions from `start`, in one page: rows `at` of it, then, from its
    batch's repeats (`shared`), its row of each; or, once the page let them go, a copy (`keep`)."""

    page: Page | None
    start: int
    at: list[int]
    last: Batch | None  # the batch of its newest row in `at`
    shared: Shared | None = None
    lane: int = 0  # its row in each of `shared`'s batches
    kept: np.ndarray | None = None  # [rows, bytes] its rows, copied out of the page
    kept_layout: list[Layout] = field(default_factory=list)

    @property
    def stop(self) -> int:
        """The position after its last row."""
        return self.start + len(self.at) + (len(self.shared.offsets) if self.shared is not None else 0)

    def _rows(self) -> tuple[list[int], Batch]:
        """Where its rows are in the page, and the batch of the newest."""
        if self.shared is not None and self.shared.offsets:
            return self.at + [o + self.lane for o in self.shared.offsets], self.shared.last
        return self.at, self.last

    def arrived(self) -> tuple[np.ndarray, list[Layout]]:
        """The bytes of its rows that have arrived — all, or all but the newest (queued ahead of the end) —
        and where each tap's values sit in them."""
        if self.kept is not None:
            return self.kept, self.kept_layout
        at, newest = self._rows()
        if not newest.delivered:
            at = at[:-1]
        return (self.page.data[at], self.page.layout) if at else (_NO_ROWS, self.page.layout)

    def keep(self) -> None:
        """Copy its rows out of its page, whose rows have all arrived: the page may go."""
        self.kept, self.kept_layout = self.page.data[self._rows()[0]], self.page.layout
        self.page = self.last = None


@dataclass(slots=True)
class _Repeat:
    """What the last decode step's batches and edits were, to know the next one as their repeat."""

    seqs: list  # the step's sequences, in order (compared by identity)
    next: list[int]  # each one's position in the next step, if it repeats
    batches: dict[tuple[str, ...], tuple[Shared, list[int]]]  # taps -> (its repeats, its packed rows)
    edits: dict  # the step's edits (vlens.capture.plan.StepPlan.edits): a repeat's are the same
    steps_left: float  # repeats before a stream's window or an intervention's run ends


class DecodePages:
    """The current page of each set of taps that decode batches use, and what the last decode step did (the
    runner's: both outlive steps)."""

    def __init__(self) -> None:
        # the streams with rows in a page keep it, not this: it goes with them
        self._pages: weakref.WeakValueDictionary[tuple[str, ...], Page] = weakref.WeakValueDictionary()
        self._spare: list[np.ndarray] = []
        self._last: _Repeat | None = None
        self.repeats = 0  # decode steps planned as repeats (EngineStats.repeated_steps)

    def batch(self, taps: tuple[str, ...], room: int) -> Batch:
        """A new decode step's batch for `taps` of at most `room` rows, in the current page or, where that has
        no room left, a new one. Its rows are counted in the page when the step's plan is done (`StepPlan.close`)."""
        page = self._pages.get(taps)
        if page is None or not page.has_room(room):
            if page is not None:
                page.retire()
            page = self._pages[taps] = Page(self._spare)
        return Batch(page, page.used, taps)

    def forget(self, seq: object) -> None:
        """`seq` ended: a last decode step it was in is repeated no more, and its rows are let go."""
        if self._last is not None and seq in self._last.seqs:
            self._last = None

    def remember(self, seqs: list, positions: list[int], steady: tuple | None, limit: float) -> None:
        """After a decode step of `seqs` at `positions`, `steady`: (its batches, the streams of each batch in
        its order, its edits) where every stream batched its row and every intervention edited its row (or
        is past its window), else None; the next step may repeat it, `limit` times at most. (A step where
        nobody captures or intervenes repeats too, with nothing in it: it skips a loop over the sequences.)"""
        self._last = None
        if steady is None:
            return
        batches, lanes, edits = steady
        repeats, steps_left = {}, limit
        for taps, batch in batches.items():
            if not batch.positions:  # (its streams are all past their windows, for good)
                continue
            shared = Shared(batch.page)
            for lane, stream in enumerate(lanes[taps]):
                stream.share(shared, lane)
                steps_left = min(steps_left, stream.window_end - batch.positions[lane] - 1)
            repeats[taps] = (shared, batch.rows)
        self._last = _Repeat(list(seqs), [p + 1 for p in positions], repeats, edits, steps_left)

    def repeat(self, seqs: list, positions: list[int]) -> tuple[dict[tuple[str, ...], Batch], dict] | None:
        """The batches and edits of a decode step that repeats the last one — the same sequences, each one
        position on, each stream and intervention still in its window, room in the pages — or None."""
        last = self._last
        if last is None or last.steps_left < 1 or positions != last.next or seqs != last.seqs:
            return None
        if any(shared.page is not self._pages.get(taps) or not shared.page.has_room(len(rows))
               for taps, (shared, rows) in last.batches.items()):  # fmt: skip
            return None
        batches = {}
        for taps, (shared, rows) in last.batches.items():
            batch = batches[taps] = Batch(shared.page, shared.page.used, taps, [positions[r] for r in rows], rows)
            shared.offsets.append(batch.offset)
            shared.last = batch
        last.next, last.steps_left = [p + 1 for p in positions], last.steps_left - 1
        self.repeats += 1
        return batches, last.edits


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
    # A tap gathered at the same rows for the readout alone, which returns nothing of it: the output of a
    # transcoder, which its error compares with its reconstruction (vlens.sae.readout)
    paired: str | None = None
    _offered: int = 0  # positions below this were offered to the stream already (but see `offered_upto`)
    _pieces: list[Held | Run] = field(default_factory=list)  # in the order of their positions
    _run: Run | None = None  # the newest piece, where it is a run that the next decode row may extend

    def __post_init__(self) -> None:
        self.taps = sorted(set(self.hooks.values()))
        self.gathered = self.taps if self.paired is None else [*self.taps, self.paired]
        self.patterns = any(is_pattern(t) for t in self.taps)
        self.first_wanted = self.positions.first_needed(self.prompt_len)
        self._window = self.positions.window(self.prompt_len) if self.exclude is None else None
        # Taps whose rows need work on the device before they leave it (a readout, a mean, a cast, heads)
        on_device = self.readout is not None or self.sums_on_device or self.dtype is not None
        self.device_taps = frozenset(t for t in self.gathered if on_device or t in self.head_taps)
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

    @property
    def offered_upto(self) -> int:
        """Positions below this were offered to the stream already, counting its batch's repeats."""
        run = self._run
        return self._offered if run is None or run.shared is None else max(self._offered, run.stop)

    @property
    def window_end(self) -> float:
        return self._window[1]

    def first_needed(self) -> int:
        """Rows below this are never wanted again: their KV may come from the prefix cache."""
        return max(self.offered_upto, self.first_wanted)

    def select(self, token_ids: list[int], start: int, end: int) -> Sequence[int]:
        """Positions of a step's rows [start, end) to gather: wanted, new, and not excluded."""
        offered = self.offered_upto
        start, self._offered = max(start, offered), max(offered, end)
        if self._window is not None:  # (every step of most captures: one range, no call)
            return range(max(start, self._window[0]), min(end, self._window[1]))
        pos = self.positions.candidates(start, end, self.prompt_len)
        if self.exclude is not None and len(pos):
            at = torch.as_tensor(pos)
            pos = at[~torch.isin(torch.tensor(token_ids)[at], self.exclude)].tolist()
        return pos

    def take(self, position: int, row: int, batch: Batch) -> bool:
        """`select` of a step's one row at `position` (packed row `row`), for a stream with a window
        (`batched`): if it is wanted, it joins the step's `batch`, and the stream's run in the batch's page.
        Whether it joined."""
        if position < self.offered_upto:
            return False
        self._offered = position + 1
        if not self._window[0] <= position < self._window[1]:
            return False
        at, run = batch.offset + len(batch.positions), self._run
        if run is None or run.shared is not None or run.page is not batch.page or run.stop != position:
            self._run = Run(batch.page, position, [at], batch)
            self._pieces.append(self._run)
            batch.page.runs.add(self._run)
        else:
            run.at.append(at)
            run.last = batch
        batch.positions.append(position)
        batch.rows.append(row)
        return True

    def share(self, shared: Shared, lane: int) -> None:
        """This step's row was the newest of its run: its next ones are its `lane` of `shared`'s batches."""
        self._run.shared, self._run.lane = shared, lane

    def hold(self, held: Held) -> None:
        """Rows of this step are all of `held`'s; a tail drops older rows it no longer needs. (A batched
        stream has no tail: its rows are all kept.)"""
        self._run = None  # (pieces stay in the order of their positions; `select` counted its rows as offered)
        self._pieces.append(held)
        if not self.positions.tail:
            return
        newest = held.positions[-1] - 1  # (the step before: this one may be queued ahead of the sequence's end)
        while len(self._pieces) > 1 and self.positions.tail_obsolete(self._pieces[0].positions, newest):
            self._pieces.pop(0)

    def _collected(self) -> tuple[list[int], dict[str, list]]:
        """Every collected position, and each tap's pieces of rows in the same order (a batched stream's:
        one tensor, joined from the bytes of its rows)."""
        pieces = self._pieces
        if pieces and isinstance(pieces[-1], Held) and not pieces[-1].delivered:  # (queued ahead of the end)
            pieces = pieces[:-1]
        positions: list[int] = []
        if not self.batched:
            for held in pieces:
                positions.extend(held.positions)
            return positions, {tap: [held.tap_rows[tap] for held in pieces] for tap in self.taps}
        taps, joined, layout = self.tap_key, [], None
        for piece in pieces:
            if isinstance(piece, Run):
                rows, run_layout = piece.arrived()
                if not len(rows):
                    continue
                positions.extend(range(piece.start, piece.start + len(rows)))
                joined.append(rows)
                layout = run_layout
            else:
                positions.extend(piece.positions)
                joined.append(_bytes(piece.tap_rows, taps))
                layout = _layout(piece.tap_rows, taps)
        if layout is None:
            return positions, {tap: [] for tap in self.taps}
        joined = joined[0] if len(joined) == 1 else np.concatenate(joined)
        return positions, {part.tap: [part.rows(joined)] for part in layout}

    def result(self, num_rows: int, model_dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, object]]:
        """(positions, {requested name: rows or (ids, logprobs)}) per the spec, once the sequence has
        `num_rows` rows."""
        collected, pieces_of = self._collected()
        positions = torch.from_numpy(np.array(collected, dtype=np.int64))
        keep = self.positions.keep(collected, num_rows)

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
