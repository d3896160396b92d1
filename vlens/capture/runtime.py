"""The taps the model calls, and the device buffers they read and write.

A model tap site is one line, `if NAME in taps: x = taps[NAME](x)`. `taps` holds a `Tap` for every site
some request uses in this step and nothing else, so a step in which nobody captures or intervenes runs
no capture code. A `Tap` reads and writes only tensors of fixed shape that the runtime armed before the
forward — rows to gather, rows to edit with their kinds and vector-table rows — so torch.compile and
CUDA graphs keep it: no Python containers are built, no `.item()` runs and no shape depends on data.

Buffers live as long as the runtime and only grow: gathered rows land in a buffer per tap site, the
step's indices in one index buffer (one host-to-device copy per step), and intervention vectors in a
table per row width, written once when a request arrives, not every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain

import torch

from vlens.capture.bind import ABLATE, PATCH, STEER, BoundIntervention
from vlens.capture.names import tap_dtype
from vlens.capture.plan import Collected, StepPlan
from vlens.capture.rows import RowStream

# new = a * x + b * v + c * (x . v) v, per edit kind: a steer adds v, an ablation takes the component
# along the unit vector v out, a patch replaces the row. Each is exact: the zero terms add exact zeros.
_COEFFICIENTS = {STEER: (1.0, 1.0, 0.0), ABLATE: (1.0, 0.0, -1.0), PATCH: (0.0, 1.0, 0.0)}


class Tap:
    """One tap site's work in one step: edit passes, then a gather of rows into a static buffer."""

    def __init__(self) -> None:
        self.gather_index: torch.Tensor | None = None  # [R] packed rows to gather (padding repeats a row)
        self.gather_out: torch.Tensor | None = None  # [R, *shape] where they land
        self.edit_rows: torch.Tensor | None = None  # [P, E]: pass p edits rows edit_rows[p], distinct within a pass
        self.edit_vectors: torch.Tensor | None = None  # [P, E] rows of `table`
        self.edit_kinds: torch.Tensor | None = None  # [P, E] STEER | ABLATE | PATCH
        self.table: torch.Tensor | None = None  # [N, width] intervention vectors
        self.coefficients: torch.Tensor | None = None  # [kinds, 3]: (a, b, c) of each kind

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.edit_rows is not None:
            x = self._edit(x)
        if self.gather_index is not None:
            torch.index_select(x, 0, self.gather_index, out=self.gather_out)
        return x

    def _edit(self, x: torch.Tensor) -> torch.Tensor:
        """Passes apply in order (a request's interventions at one tap, in the order it gave them); each
        pass reads its rows, computes their new values and writes them back with one index_copy."""
        flat = x.reshape(x.shape[0], -1)
        for p in range(self.edit_rows.shape[0]):
            rows = self.edit_rows[p]
            v = self.table.index_select(0, self.edit_vectors[p]).to(x.dtype)
            a, b, c = self.coefficients.index_select(0, self.edit_kinds[p]).to(x.dtype).unbind(1)
            old = flat.index_select(0, rows)
            dot = (old * v).sum(1)
            new = a[:, None] * old + b[:, None] * v + (c * dot)[:, None] * v
            flat = flat.index_copy(0, rows, new)
        return flat.view(x.shape)


class VectorTable:
    """Intervention vectors of one row width, on the device; a request's rows stay until it ends."""

    def __init__(self, width: int, device: torch.device, dtype: torch.dtype):
        self.data = torch.zeros(16, width, device=device, dtype=dtype)
        self.free = list(range(16))

    def put(self, rows: torch.Tensor) -> list[int]:
        if len(rows) > len(self.free):
            old = self.data
            grown = max(2 * len(old), len(old) + len(rows))
            self.data = torch.zeros(grown, old.shape[1], device=old.device, dtype=old.dtype)
            self.data[: len(old)] = old
            self.free += range(len(old), grown)
        ids, self.free = self.free[: len(rows)], self.free[len(rows) :]
        index = torch.tensor(ids, dtype=torch.long, device=self.data.device)
        self.data[index] = rows.to(self.data.device, self.data.dtype)
        return ids

    def release(self, ids: list[int]) -> None:
        self.free += ids


class TapRuntime:
    """Owns the taps' device buffers; arms the taps for a step's plan and collects what they gathered.

    `fixed_shapes` pads every per-step size to a power of two, so a compiled forward (or a CUDA graph)
    meets the same shapes again in later steps; eager forwards take the exact sizes."""

    def __init__(
        self, shapes: dict[str, tuple[int, ...]], device: torch.device, dtype: torch.dtype, fixed_shapes: bool = False
    ):
        self.shapes, self.device, self.dtype, self.fixed_shapes = shapes, device, dtype, fixed_shapes
        self._taps: dict[str, Tap] = {}
        self._out: dict[str, torch.Tensor] = {}
        self._index = torch.zeros(0, dtype=torch.long, device=device)
        self.tables: dict[int, VectorTable] = {}
        kinds = max(_COEFFICIENTS) + 1
        coefficients = torch.zeros(kinds, 3)
        for kind, abc in _COEFFICIENTS.items():
            coefficients[kind] = torch.tensor(abc)
        self._coefficients = coefficients.to(device, dtype)

    # -- interventions, once per request ----------------------------------------------------------

    def upload(self, interventions: list[BoundIntervention]) -> None:
        for iv in interventions:
            table = self.tables.get(iv.width)
            if table is None:
                table = self.tables[iv.width] = VectorTable(iv.width, self.device, self.dtype)
            iv.table_rows = table.put(iv.data)

    def release(self, interventions: list[BoundIntervention]) -> None:
        for iv in interventions:
            if iv.table_rows is not None:
                self.tables[iv.width].release(iv.table_rows)
                iv.table_rows = None

    # -- each step ----------------------------------------------------------------------------------

    def _size(self, n: int) -> int:
        return 1 << max(0, n - 1).bit_length() if self.fixed_shapes else n

    def arm(self, plan: StepPlan) -> dict[str, Tap]:
        """The taps of this step's plan, their indices written into the device buffers in one copy."""
        flat: list[int] = []
        layout: list[tuple[str, str, int, tuple[int, ...]]] = []  # (tap, field, offset, shape)

        def add(tap: str, name: str, values: list[int], shape: tuple[int, ...]) -> None:
            layout.append((tap, name, len(flat), shape))
            flat.extend(values)

        for tap, parts in plan.gathers.items():
            rows = list(chain.from_iterable(r for _, r in parts))
            size = self._size(len(rows))
            add(tap, "gather_index", rows + [0] * (size - len(rows)), (size,))
        for tap, passes in plan.edits.items():
            size = self._size(max(len(e.rows) for e in passes))
            for name, column in (("edit_rows", "rows"), ("edit_vectors", "vectors"), ("edit_kinds", "kinds")):
                # a pass is padded by repeating its last edit: the same write twice is the same write
                lists = [getattr(e, column) for e in passes]
                add(tap, name, [x for v in lists for x in v + v[-1:] * (size - len(v))], (len(passes), size))
        if len(flat) > len(self._index):
            self._index = torch.zeros(max(len(flat), 2 * len(self._index)), dtype=torch.long, device=self.device)
        if flat:
            self._index[: len(flat)].copy_(torch.tensor(flat), non_blocking=True)
        taps = {}
        for tap, name, start, shape in layout:
            t = taps.get(tap) or self._reset(tap)
            taps[tap] = t
            setattr(t, name, self._index[start : start + torch.Size(shape).numel()].view(shape))
        for tap in plan.gathers:
            taps[tap].gather_out = self._gather_buffer(tap, len(taps[tap].gather_index))
        for tap in plan.edits:
            t = taps[tap]
            t.table, t.coefficients = self.tables[math.prod(self.shapes[tap])].data, self._coefficients
        return taps

    def _reset(self, tap: str) -> Tap:
        t = self._taps.get(tap)
        if t is None:
            t = self._taps[tap] = Tap()
        t.gather_index = t.gather_out = t.edit_rows = t.edit_vectors = t.edit_kinds = t.table = None
        return t

    def _gather_buffer(self, tap: str, rows: int) -> torch.Tensor:
        buf = self._out.get(tap)
        if buf is None or len(buf) < rows:
            size = max(rows, 2 * len(buf)) if buf is not None else rows
            buf = self._out[tap] = torch.empty(size, *self.shapes[tap], dtype=tap_dtype(tap, self.dtype), device=self.device)
        return buf[:rows]

    def collect(self, plan: StepPlan) -> Collection:
        """After the forward: each segment's rows of each tap, read out on the device where its stream
        asks for it, then copied to the host (pinned and non-blocking on CUDA: see Collection.ready)."""
        out: list[Collected] = []
        for tap, parts in plan.gathers.items():
            counts = [len(rows) for _, rows in parts]
            gathered = self._taps[tap].gather_out[: sum(counts)]
            streams = [plan.segments[segment].owner for segment, _ in parts]
            if not any(_reads_out(s) for s in streams):  # one copy for the whole tap, split on the host
                out += [Collected(s, tap, r) for (s, _), r in zip(parts, _to_host(gathered).split(counts))]
                continue
            for (segment, _), stream, chunk in zip(parts, streams, gathered.split(counts)):
                out.append(Collected(segment, tap, _to_host(_read_out(stream, chunk) if _reads_out(stream) else chunk)))
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return Collection(out, event)


@dataclass
class Collection:
    """A step's gathered rows on their way to the host; never read before the copies' event."""

    items: list[Collected]
    event: torch.cuda.Event | None = None

    def ready(self) -> list[Collected]:
        if self.event is not None:
            self.event.synchronize()
        return self.items


def _reads_out(owner: object) -> bool:
    return isinstance(owner, RowStream) and bool(owner.readout or owner.sums_on_device or owner.dtype)


def _read_out(stream: RowStream, chunk: torch.Tensor):
    result = stream.readout(chunk) if stream.readout is not None else chunk
    if stream.sums_on_device:
        result = result.sum(0, keepdim=True)
    if stream.dtype is not None and isinstance(result, torch.Tensor) and result.is_floating_point():
        result = result.to(stream.dtype)  # integer taps (MoE expert ids) keep their dtype
    return result


def _to_host(x):
    """A host copy that outlives the device buffer it came from (the next step overwrites it)."""
    if isinstance(x, tuple):
        return tuple(_to_host(t) for t in x)
    if x.device.type == "cpu":
        return x.clone()
    return torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x, non_blocking=True)
