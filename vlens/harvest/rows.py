"""The device side of a harvest: a shard's windows run in batches, their kept rows sent to host memory.

Each batch's kept rows are taken at their taps by a hook of the packed forward: selected on the device,
cast to the stored dtype, folded into the shard's statistics there (vlens.harvest.stats), and copied
into the shard's host buffers. On CUDA the copies run on a side stream into pinned memory, ordered after
the rows' compute by a stream wait and before the writer by an event: batch i's rows travel while batch
i + 1 runs, and nothing waits for the device but the writer. Host buffers come from a pool of whole-shard
sets (two when a writer thread runs: one fills while the other is written), so a shard that finds them
all out waits for the writer; that is what keeps memory bounded.
"""

from __future__ import annotations

import math
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from vlens.capture.names import tap_dtype
from vlens.engine.model_runner import ModelRunner
from vlens.engine.packed import token_batches
from vlens.harvest import job
from vlens.harvest.edits import HarvestEdits
from vlens.harvest.features import SAE_KEYS, FeatureHarvest
from vlens.harvest.stats import Pieces, ShardStats
from vlens.harvest.windows import Window, document_ids, last_rows, stored_rows
from vlens.images import ImageEncoder, PromptImages


@dataclass
class Shard:
    """One shard whose rows are on their way to host buffers: what the writer needs to store it."""

    index: int
    first: int  # its first window
    windows: list[Window]
    tensors: dict[str, torch.Tensor]  # every key of the shard file; hook rows are views of `buffers`
    stats: dict[str, Pieces]  # per hook, in host memory once `ready` returns
    buffers: dict[str, torch.Tensor]  # to give back to the pool once written
    event: torch.cuda.Event | None  # after the last copy into host memory
    timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)  # each forward's, CUDA
    forward_seconds: float = 0.0  # on a CPU: the wall time of the forwards

    def ready(self) -> None:
        """Wait until every row and statistic is in host memory; the forwards' device time is then known."""
        if self.event is not None:
            self.event.synchronize()
            if self.timings:  # the rows may be in before the last forward's later layers are done
                self.timings[-1][1].synchronize()
            self.forward_seconds = sum(start.elapsed_time(end) for start, end in self.timings) / 1000

    @property
    def tokens(self) -> int:
        return sum(len(w.tokens) for w in self.windows)


class BufferPool:
    """Sets of host tensors, one per shard key, for whole shards; pinned on CUDA, reused shard after shard,
    grown to the largest shard seen. `take` waits while every set is out."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], pinned: bool, size: int) -> None:
        self.specs, self.pinned = specs, pinned
        self.free: queue.Queue[dict[str, torch.Tensor]] = queue.Queue()
        for _ in range(size):
            self.free.put({})

    def take(self, rows: int) -> dict[str, torch.Tensor]:
        buffers = self.free.get()
        if not buffers or len(next(iter(buffers.values()))) < rows:
            buffers = {
                key: torch.empty(rows, *shape, dtype=dtype, pin_memory=self.pinned)
                for key, (shape, dtype) in self.specs.items()
            }
        return buffers

    def give(self, buffers: dict[str, torch.Tensor]) -> None:
        self.free.put(buffers)


class DeviceRows:
    """Runs shards' windows through the model (edited by `edits`) and sends their kept rows, statistics and
    SAE latents on their way to host buffers; one per run (it owns the pool, the side stream and, until
    `close`, the edits' vectors on the device)."""

    def __init__(
        self, runner: ModelRunner, wanted: dict[str, str], shapes: dict[str, tuple[int, ...]], out_dtype: torch.dtype,
        excluded: torch.Tensor, batch_tokens: int, features: FeatureHarvest | None, edits: HarvestEdits | None,
        buffer_sets: int, row_keys: tuple[str, ...], pool: str | None = None, encoder: ImageEncoder | None = None,
    ) -> None:  # fmt: skip
        """`encoder`: the vision tower of a run whose windows have images (vlens.harvest.windows)."""
        self.runner, self.out_dtype, self.excluded, self.batch_tokens = runner, out_dtype, excluded, batch_tokens
        self.row_keys, self.pool, self.encoder = row_keys, pool, encoder
        self.features, self.edits = features, edits
        if edits is not None:
            runner.taps.upload(edits.bound)
        self.device = runner.device
        self.widths = {name: math.prod(shapes[name]) for name in wanted}
        self.names_of: dict[str, list[str]] = {}
        for name, tap in wanted.items():
            self.names_of.setdefault(tap, []).append(name)
        specs = {name: (tuple(shapes[name]), tap_dtype(tap, out_dtype)) for name, tap in wanted.items()}
        if features is not None:
            specs.update(zip(SAE_KEYS, (((features.top_k,), torch.int32), ((features.top_k,), out_dtype))))
        cuda = self.device.type == "cuda"
        self.buffers = BufferPool(specs, pinned=cuda, size=buffer_sets)
        self.side = torch.cuda.Stream(self.device) if cuda else None

    def shard(self, index: int, first: int, windows: list[Window]) -> Shard:
        """Launch the forwards of one shard; its rows are in `Shard.tensors` once `Shard.ready()` returns."""
        lens = [len(w.tokens) for w in windows]
        flat, keep = stored_rows(windows, self.excluded)
        # The rows stored; pooled, one a window, standing at its last stored row. Read: those, or for a mean
        # every stored row (averaged per window by one matrix product a batch).
        stored = last_rows(keep, lens) if self.pool is not None else keep
        read = keep if self.pool == "mean" else stored
        kept_before = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(stored, 0)]).tolist()
        read_before = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(read, 0)]).tolist()
        read_at = read.nonzero().squeeze(1)  # the rows read, as positions in the shard's tokens
        n_rows = kept_before[-1]
        buffers = self.buffers.take(n_rows)
        stats = {name: ShardStats(width, self.device) for name, width in self.widths.items()}
        shard = Shard(index, first, windows, {}, {}, buffers, None)
        starts = [0, *torch.cumsum(torch.tensor(lens), 0).tolist()]
        lens_t, starts_t = torch.tensor(lens), torch.tensor(starts)
        window = torch.repeat_interleave(torch.arange(len(windows)), lens_t)
        for batch in token_batches(lens, self.batch_tokens):  # (consecutive windows, listed shortest first)
            lo, hi = starts[min(batch)], starts[max(batch) + 1]  # the batch's tokens in the shard
            out = slice(kept_before[lo], kept_before[hi])  # and its rows, which keep the shard's order
            if out.start == out.stop:
                continue
            moved = torch.zeros(len(windows), dtype=torch.long)  # a window's start in the forward less in the shard
            moved[batch] = torch.tensor([0, *accumulate(lens[i] for i in batch[:-1])]) - starts_t[batch] + lo
            at = read_at[read_before[lo] : read_before[hi]]
            mean = _averaging(window[at]).to(self.device, non_blocking=True) if self.pool == "mean" else None
            rows = (at - lo + moved[window[at]]).to(self.device, non_blocking=True)
            hooks = {tap: self._hook(tap, rows, out, buffers, stats, mean) for tap in self._taps()}
            self._forward(shard, [windows[i] for i in batch], hooks)
        shard.stats = {name: self._stats_to_host(s.finish()) for name, s in stats.items()}
        if self.side is not None:
            shard.event = torch.cuda.Event()
            shard.event.record(self.side)
        position = torch.arange(len(flat)) - torch.repeat_interleave(starts_t[:-1], lens_t)
        shard.tensors = {key: buffer[:n_rows] for key, buffer in buffers.items()}
        meta = {"token_ids": flat.to(torch.int32), "window": window + first, "position": position}
        if "document" in self.row_keys:
            meta["document"] = document_ids(windows)
        shard.tensors.update({key: meta[key][stored] for key in self.row_keys})
        return shard

    def close(self) -> None:
        """Give the runner back the edits' vector rows (the model may serve on: an LLM passed to harvest)."""
        if self.edits is not None:
            self.runner.taps.release(self.edits.bound)

    def _taps(self) -> list[str]:
        taps = list(self.names_of)
        if self.features is not None and self.features.tap not in self.names_of:
            taps.append(self.features.tap)
        return taps

    def _forward(self, shard: Shard, windows: list[Window], hooks: dict[str, Callable]) -> None:
        """The forward of `windows`, after the vision tower has made their images' rows (timed with it)."""
        if self.side is None:
            started = time.perf_counter()
            job.forward(self.runner, [w.tokens for w in windows], hooks, self.edits, self._images(windows))
            shard.forward_seconds += time.perf_counter() - started
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(self.device)
        start.record(stream)
        job.forward(self.runner, [w.tokens for w in windows], hooks, self.edits, self._images(windows))
        end.record(stream)
        shard.timings.append((start, end))

    def _images(self, windows: list[Window]) -> list[PromptImages | None] | None:
        """The rows each window's images give (None for a window of none; None for a forward without any)."""
        given = [w.images for w in windows if w.images is not None]
        if not given:
            return None
        rows = iter(self.encoder.rows(given, ["image_field"] * len(given)))
        return [None if w.images is None else next(rows) for w in windows]

    def _hook(
        self, tap: str, rows: torch.Tensor, out: slice, buffers: dict[str, torch.Tensor],
        stats: dict[str, ShardStats], mean: torch.Tensor | None,
    ) -> Callable[[torch.Tensor], torch.Tensor]:  # fmt: skip
        """The tap hook of one batch: its kept rows of `tap` (averaged by `mean` per window) into rows `out` of
        the shard's buffers."""

        def take(x: torch.Tensor) -> torch.Tensor:
            kept = x.index_select(0, rows)
            if mean is not None:
                kept = (mean @ kept.flatten(1).float()).reshape(len(mean), *kept.shape[1:])
            if tap in self.names_of:
                stored = kept.to(tap_dtype(tap, self.out_dtype))  # integer taps (MoE expert ids) keep their ids
                for name in self.names_of[tap]:
                    stats[name].add(stored)
                    self._to_host(stored, buffers[name][out])
            if self.features is not None and tap == self.features.tap:
                for key, value in zip(SAE_KEYS, self.features.encode(kept, self.out_dtype)):
                    self._to_host(value, buffers[key][out])
            return x

        return take

    def _to_host(self, x: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy device rows into host memory: at once on a CPU; on CUDA queued on the side stream."""
        if self.side is None:
            dest.copy_(x)
            return
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            dest.copy_(x, non_blocking=True)
        x.record_stream(self.side)  # the allocator keeps it until the side stream is done with it

    def _stats_to_host(self, pieces: Pieces) -> Pieces:
        if self.side is None:
            return pieces
        host = torch.empty(pieces.values.shape, dtype=pieces.values.dtype, pin_memory=True)
        self._to_host(pieces.values, host)
        return Pieces(host, pieces.rows)


def _averaging(window: torch.Tensor) -> torch.Tensor:
    """[windows, rows] float32: row i of `window` (each row's window, ascending) weighted 1 / its window's count in
    its window's line, so that a product with the rows is each window's mean row (a product, not a scatter: the
    same sums in the same order on every device and run)."""
    _, line, counts = torch.unique_consecutive(window, return_inverse=True, return_counts=True)
    weights = torch.zeros(len(counts), len(window))
    weights[line, torch.arange(len(window))] = 1 / counts[line].float()
    return weights
