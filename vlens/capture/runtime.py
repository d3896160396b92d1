"""The taps the model calls, and the device buffers they read and write.

A model tap site is one line, `x = tap(NAME, x)` (vlens.context), which reads the forward's taps: a `Tap`
for every site some request uses in this step and nothing else, so a step in which nobody captures or intervenes runs
no capture code. A `Tap` reads and writes only tensors of fixed shape that the runtime armed before the
forward — rows to gather, rows to edit with their kinds and vector-table rows — so torch.compile and
CUDA graphs keep it: no Python containers are built, no `.item()` runs and no shape depends on data.

Buffers live as long as the runtime (the runner's: trace and harvest reuse it) and only grow: gathered
rows land in a buffer per tap site, the step's indices in one field of the runner's step buffers (sent
with the step's other inputs in one copy), and intervention vectors in a table per row width, written
once when a request arrives, not every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from vlens.attention.metadata import FULL_REACH, Put, first_visible
from vlens.attention.sdpa import probabilities
from vlens.capture.bind import ABLATE, CLAMP, PATCH, STEER, TRANSCODER_CLAMP, BoundIntervention
from vlens.capture.names import is_pattern, tap_dtype
from vlens.capture.plan import Collected, StepPlan
from vlens.capture.rows import Batch, RowStream
from vlens.sae.clamp import PARAMS, clamp_coefficient, clamped
from vlens.sae.readout import SAEReadout, read_group

# new = a * x + b * v + c * (x . v) v, per edit kind: a steer adds v, an ablation takes the component
# along the unit vector v out, a patch replaces the row. Each is exact: the zero terms add exact zeros.
# A clamp keeps x here and is computed apart (vlens.sae.clamp), in the steps that have one.
_COEFFICIENTS = {
    STEER: (1.0, 1.0, 0.0), ABLATE: (1.0, 0.0, -1.0), PATCH: (0.0, 1.0, 0.0), CLAMP: (1.0, 0.0, 0.0),
    TRANSCODER_CLAMP: (1.0, 0.0, 0.0),
}  # fmt: skip


class Tap:
    """One tap site's work in one step: edit passes, the coefficients of the transcoder clamps of later taps
    that read their latents here, then a gather of rows into a static buffer (or, at an attention-pattern
    tap, the scores of the gathered query rows over their keys)."""

    __slots__ = (
        "gather_index", "gather_out", "key_index", "row_positions", "row_limits", "softmax", "edit_rows",
        "edit_vectors", "edit_kinds", "clamps", "table", "coefficients", "latch", "feeds", "source",
    )  # fmt: skip  (what a captured graph or a compiled forward bakes in: vlens.engine.model_runner._signature)

    def __init__(self) -> None:
        self.gather_index: torch.Tensor | None = None  # [R] packed rows to gather (padding repeats a row)
        self.gather_out: torch.Tensor | None = None  # [R, *shape] where they land
        self.key_index: torch.Tensor | None = None  # patterns: [R, K] each row's keys, key j at column j
        self.row_positions: torch.Tensor | None = None  # patterns: [R] each row's position: keys past it are masked
        # patterns: [R] the last key each row sees, where some see past their own (an image's tokens, both ways)
        self.row_limits: torch.Tensor | None = None
        self.softmax = False  # hook_pattern (probabilities) rather than hook_attn_scores
        self.edit_rows: torch.Tensor | None = None  # [P, E]: pass p edits rows edit_rows[p], distinct within a pass
        self.edit_vectors: torch.Tensor | None = None  # [P, E] rows of `table`
        self.edit_kinds: torch.Tensor | None = None  # [P, E] STEER | ABLATE | PATCH | CLAMP
        self.clamps = False  # some edit of this step is a CLAMP
        self.table: VectorTable | None = None
        self.coefficients: torch.Tensor | None = None  # [kinds, 3]: (a, b, c) of each kind
        self.latch: torch.Tensor | None = None  # [P, E] transcoder clamps' coefficients, from where they read
        self.feeds: tuple[Tap, ...] = ()  # the taps whose transcoder clamps read their latents here ...
        self.source: int | None = None  # ... those whose vector-table rows name this source

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.edit_rows is not None:
            x = self._edit(x)
        if self.feeds:
            self._feed(x)
        if self.gather_index is not None:
            # (what a capture gathers is seen, not differentiated: a forward with a graph, HookedLM's backward hooks)
            torch.index_select(x.detach() if x.requires_grad else x, 0, self.gather_index, out=self.gather_out)
        return x

    def _edit(self, x: torch.Tensor) -> torch.Tensor:
        """Passes apply in order (a request's interventions at one tap, in the order it gave them); each
        pass reads its rows, computes their new values and writes them back with one index_copy. Where
        an edit's mask is off (heads it does not touch) the row keeps its value."""
        flat = x.reshape(x.shape[0], -1)
        for p in range(self.edit_rows.shape[0]):
            rows, vectors = self.edit_rows[p], self.edit_vectors[p]
            v = self.table.data.index_select(0, vectors).to(x.dtype)
            a, b, c = self.coefficients.index_select(0, self.edit_kinds[p]).to(x.dtype).unbind(1)
            old = flat.index_select(0, rows)
            dot = (old * v).sum(1)
            new = a[:, None] * old + b[:, None] * v + (c * dot)[:, None] * v
            if self.clamps:
                encoder = self.table.encoder.index_select(0, vectors)[:, : flat.shape[1]].to(x.dtype)
                params = self.table.params.index_select(0, vectors).to(x.dtype)
                is_clamp = (self.edit_kinds[p] == CLAMP)[:, None]
                new = torch.where(is_clamp, clamped(old, v, encoder, params), new)
            if self.latch is not None:
                latched = self.edit_kinds[p] == TRANSCODER_CLAMP
                new = new + torch.where(latched, self.latch[p].to(x.dtype), 0.0)[:, None] * v
            new = torch.where(self.table.mask.index_select(0, vectors), new, old)
            flat = flat.index_copy(0, rows, new)
        return flat.view(x.shape)

    def _feed(self, x: torch.Tensor) -> None:
        """Each fed tap's pass p gets, for its edits whose rows come from this source, the coefficient of the
        clamp on these rows (as this tap leaves them); its other entries keep what they hold."""
        flat = x.reshape(x.shape[0], -1)
        for fed in self.feeds:
            table = fed.table
            for p in range(fed.edit_rows.shape[0]):
                vectors = fed.edit_vectors[p]
                encoder = table.encoder.index_select(0, vectors)[:, : flat.shape[1]].to(x.dtype)
                params = table.params.index_select(0, vectors).to(x.dtype)
                coefficient = clamp_coefficient(flat.index_select(0, fed.edit_rows[p]), encoder, params)
                mine = table.sources.index_select(0, vectors) == self.source
                fed.latch[p].copy_(torch.where(mine, coefficient.to(fed.latch.dtype), fed.latch[p]))

    def attend(self, q: torch.Tensor, keys: torch.Tensor, attn) -> None:
        """Scores [R, heads, K] of the gathered query rows over their sequence's keys, as HF's eager
        attention has them before its softmax: scaled, ALiBi's biases added, soft-capped, -inf where the causal
        mask, the sliding window or the chunk forbids; at hook_pattern their float32 softmax (over the sinks too,
        whose weight is not a key's), in the model's dtype (seen, not differentiated, as every capture)."""
        q, keys = q.detach(), keys.detach()
        rows, width = self.key_index.shape
        k = keys.index_select(0, self.key_index.reshape(-1)).view(rows, width, attn.num_kv_heads, attn.head_dim)
        k = k.repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=2)
        scores = torch.einsum("rhd,rkhd->rhk", q.index_select(0, self.gather_index), k) * attn.scale
        if attn.alibi:  # (BLOOM's, Falcon's: key j sits at position j; MPT's relative to the query)
            scores = scores + attn.alibi_bias(width, q.device, self.row_positions).transpose(0, 1).to(scores.dtype)
        if attn.softcap is not None:
            scores = torch.tanh(scores / attn.softcap) * attn.softcap
        j, p = torch.arange(width, device=q.device), self.row_positions[:, None]
        allowed = j <= (p if self.row_limits is None else self.row_limits[:, None])
        if attn.kind.reach != FULL_REACH:
            allowed &= j >= first_visible(attn.kind.reach, p)
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        self.gather_out.copy_(probabilities(scores, attn.sinks) if self.softmax else scores)


class VectorTable:
    """Intervention vectors of one row width on the device, with the mask of the elements each one
    edits (all of them, or the heads it names) and, for a clamp, its SAE encoder row and parameters (for a
    transcoder's, the source id of the tap it reads at, -1 for the rest; its encoder row is as wide as the rows
    there, so the encoders are as wide as the widest, zero-padded); a request's rows stay until it ends."""

    def __init__(self, width: int, device: torch.device, dtype: torch.dtype):
        self.data = torch.zeros(16, width, device=device, dtype=dtype)
        self.mask = torch.ones(16, width, device=device, dtype=torch.bool)
        self.encoder = torch.zeros(16, width, device=device, dtype=dtype)
        self.params = torch.zeros(16, PARAMS, device=device, dtype=dtype)
        self.sources = torch.full((16,), -1, device=device, dtype=torch.long)
        self.free = list(range(16))

    def put(
        self, rows: torch.Tensor, mask: torch.Tensor | None, encoder: torch.Tensor | None = None,
        params: torch.Tensor | None = None, source: int = -1,
    ) -> list[int]:  # fmt: skip
        if len(rows) > len(self.free):
            n = len(self.data)
            grown = max(2 * n, n + len(rows))
            self.data, self.encoder, self.params = (
                torch.cat([t, t.new_zeros(grown - n, t.shape[1])]) for t in (self.data, self.encoder, self.params)
            )
            self.mask = torch.cat([self.mask, self.mask.new_ones(grown - n, self.mask.shape[1])])
            self.sources = torch.cat([self.sources, self.sources.new_full((grown - n,), -1)])
            self.free += range(n, grown)
        ids, self.free = self.free[: len(rows)], self.free[len(rows) :]
        index = torch.tensor(ids, dtype=torch.long, device=self.data.device)
        self.data[index] = rows.to(self.data.device, self.data.dtype)
        self.mask[index] = True if mask is None else mask.to(self.mask.device)
        self.sources[index] = source
        if encoder is not None:
            extra = encoder.shape[1] - self.encoder.shape[1]
            if extra > 0:
                self.encoder = torch.cat([self.encoder, self.encoder.new_zeros(len(self.encoder), extra)], 1)
            self.encoder[index] = 0.0
            self.encoder[index, : encoder.shape[1]] = encoder.to(self.encoder.device, self.encoder.dtype)
            self.params[index] = params.to(self.params.device, self.params.dtype)
        return ids

    def release(self, ids: list[int]) -> None:
        self.free += ids


class TapRuntime:
    """Owns the taps' device buffers; arms the taps for a step's plan and collects what they gathered.

    `fixed_shapes` pads every per-step size to a power of two, so a compiled forward (or a CUDA graph)
    meets the same shapes again in later steps; eager forwards take the exact sizes."""

    def __init__(
        self, shapes: dict[str, tuple[int, ...]], device: torch.device, dtype: torch.dtype, put: Put,
        fixed_shapes: bool = False,
    ):  # fmt: skip
        """`put`: the runner's step buffers (vlens.engine.buffers), field "tap_index": a step's indices travel
        to the device in the step's one copy."""
        self.shapes, self.device, self.dtype, self.fixed_shapes = shapes, device, dtype, fixed_shapes
        self._put = put
        self._taps: dict[str, Tap] = {}
        self._out: dict[str, torch.Tensor] = {}
        self._armed: tuple[tuple, dict[str, Tap]] | None = None  # the last gathers armed, and their taps
        self.armed_version = 0  # counts the times `arm` armed taps anew (a step that repeats the one before does not)
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None  # device-to-host copies
        self.tables: dict[int, VectorTable] = {}
        self._sources: dict[str, int] = {}  # taps where transcoder clamps read -> their id in the tables
        self._latches: dict[str, torch.Tensor] = {}  # taps with transcoder clamps -> their coefficients' buffer
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
            source = -1 if iv.reads is None else self._sources.setdefault(iv.reads, len(self._sources))
            iv.table_rows = table.put(iv.data, iv.mask, iv.encoder, iv.params, source)

    def release(self, interventions: list[BoundIntervention]) -> None:
        for iv in interventions:
            if iv.table_rows is not None:
                self.tables[iv.width].release(iv.table_rows)
                iv.table_rows = None

    # -- each step ----------------------------------------------------------------------------------

    def arm(self, plan: StepPlan, fixed_shapes: bool | None = None) -> dict[str, Tap]:
        """The taps of this step's plan, their indices put in the step's buffers as one field (sent with the
        step's one copy), `fixed_shapes`: as the runtime's, unless given; the static decode step always pads."""
        fixed = self.fixed_shapes if fixed_shapes is None else fixed_shapes
        # A decode step that repeats the one before (vlens.capture.rows.DecodePages.repeat) gathers and edits
        # the same rows: its taps are those armed then, whose indices are still in the buffer (only `arm`
        # writes there)
        key = None
        if not any(is_pattern(tap) for tap in plan.gathers):
            gathers = [(tap, [rows for _, rows in parts]) for tap, parts in plan.gathers.items()]
            edits = [(tap, [(e.rows, e.vectors, e.kinds) for e in passes]) for tap, passes in plan.edits.items()]
            key = (fixed, gathers, edits)
            if self._armed is not None and self._armed[0] == key:  # (the same lists: `is` before `==`)
                return dict(self._armed[1])  # (a caller may add hooks to its dict)
        self._armed = None
        self.armed_version += 1

        def size(n: int) -> int:
            return 1 << max(0, n - 1).bit_length() if fixed else n

        pieces: list[np.ndarray] = []
        layout: list[tuple[str, str, int, tuple[int, ...]]] = []  # (tap, field, offset, shape)

        def add(tap: str, name: str, values: np.ndarray) -> None:
            offset = sum(len(p) for p in pieces)
            pieces.append(values.reshape(-1))
            layout.append((tap, name, offset, values.shape))

        widths: dict[str, int] = {}
        indices: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}  # a gather's row lists -> its index
        for tap, parts in plan.gathers.items():
            lists = tuple(id(rows) for _, rows in parts)  # (a stream's taps gather the same lists: one index)
            if lists in indices:
                layout.append((tap, "gather_index", *indices[lists]))
            else:
                listed = parts[0][1] if len(parts) == 1 else chain.from_iterable(r for _, r in parts)
                rows = np.fromiter(listed, np.int64)
                index = rows
                if size(len(rows)) > len(rows):
                    index = np.zeros(size(len(rows)), dtype=np.int64)
                    index[: len(rows)] = rows
                add(tap, "gather_index", index)
                indices[lists] = layout[-1][2:]
            if is_pattern(tap):
                segments = [plan.segments[s] for s, _ in parts]
                widths[tap] = size(max((seg.limits or seg.positions)[-1] for seg in segments) + 1)
                keys, positions = _pattern_rows(segments, layout[-1][3][0], widths[tap])
                add(tap, "key_index", keys.numpy())
                add(tap, "row_positions", positions.numpy())
                if any(seg.limits is not None for seg in segments):
                    add(tap, "row_limits", _row_limits(segments, len(positions)))
        for tap, passes in plan.edits.items():
            edits_padded = size(max(len(e.rows) for e in passes))
            for name, column in (("edit_rows", "rows"), ("edit_vectors", "vectors"), ("edit_kinds", "kinds")):
                # a pass is padded by repeating its last edit: the same write twice is the same write
                lists = [getattr(e, column) for e in passes]
                add(tap, name, np.array([v + v[-1:] * (edits_padded - len(v)) for v in lists], dtype=np.int64))
        taps: dict[str, Tap] = {}
        if not pieces:
            return taps
        flat = self._put("tap_index", pieces[0] if len(pieces) == 1 else np.concatenate(pieces))
        for tap, name, start, shape in layout:
            t = taps.get(tap) or self._reset(tap)
            taps[tap] = t
            setattr(t, name, flat[start : start + math.prod(shape)].view(shape))
        for tap in plan.gathers:
            t = taps[tap]
            t.gather_out = self._gather_buffer(tap, t.gather_index.shape[0], widths.get(tap))
            t.softmax = tap.endswith("hook_pattern")
        for tap, passes in plan.edits.items():
            taps[tap].table, taps[tap].coefficients = self.tables[math.prod(self.shapes[tap])], self._coefficients
            taps[tap].clamps = any(CLAMP in e.kinds for e in passes)
            reads = set().union(*(e.reads for e in passes))
            if reads:  # its transcoder clamps' coefficients come from the taps where they read
                fed = taps[tap]
                fed.latch = self._latch(tap, fed.edit_rows.shape)
                for source in sorted(reads):
                    t = taps[source] = taps.get(source) or self._reset(source)
                    t.feeds, t.source = (*t.feeds, fed), self._sources[source]
        if key is not None:
            self._armed = (key, dict(taps))
        return taps

    def _reset(self, tap: str) -> Tap:
        t = self._taps.get(tap)
        if t is None:
            t = self._taps[tap] = Tap()
        t.gather_index = t.gather_out = t.key_index = t.row_positions = t.row_limits = None
        t.edit_rows = t.edit_vectors = t.edit_kinds = t.table = t.latch = t.source = None
        t.clamps, t.feeds = False, ()
        return t

    def _latch(self, tap: str, shape: tuple[int, int]) -> torch.Tensor:
        """A view of the tap's buffer of transcoder-clamp coefficients for `shape` [passes, edits]; it only grows."""
        buf = self._latches.get(tap)
        if buf is None or shape[0] > buf.shape[0] or shape[1] > buf.shape[1]:
            grown = shape if buf is None else (max(shape[0], buf.shape[0]), max(shape[1], buf.shape[1]))
            with torch.inference_mode(False):  # (as a gather buffer: a forward keeping a graph writes it too)
                buf = self._latches[tap] = torch.zeros(grown, dtype=self.dtype, device=self.device)
        return buf[: shape[0], : shape[1]]

    def _gather_buffer(self, tap: str, rows: int, width: int | None) -> torch.Tensor:
        """A view of the tap's buffer for `rows` rows (pattern taps: `width` keys each); buffers only grow."""
        buf = self._out.get(tap)
        if width is None and buf is not None and rows <= buf.shape[0]:  # (the usual case: one slice)
            return buf[:rows]
        shape = [rows, *self.shapes[tap]]
        if width is not None:
            shape[-1] = width
        if buf is None or any(want > have for want, have in zip(shape, buf.shape)):
            grown = shape if buf is None else [max(want, have) for want, have in zip(shape, buf.shape)]
            with torch.inference_mode(False):  # (a normal tensor: a forward keeping a graph writes it too)
                buf = self._out[tap] = torch.empty(grown, dtype=tap_dtype(tap, self.dtype), device=self.device)
        return buf[tuple(slice(0, n) for n in shape)]

    def collect(self, plan: StepPlan) -> Collection:
        """After the forward: each segment's rows of each tap (pattern rows cut to the segment's own
        context), read out on the device where its stream asks for it, then copied to the host. A tap no
        segment reads out (or every segment only casts, to one dtype) is one clone and one copy, split on
        the host (no torch op per request on the device). On CUDA the copies run on a side stream into pinned
        memory and overlap whatever the device does next; `Collection.ready` waits for them. On the CPU a
        decode step's batch goes to its page at once (vlens.capture.rows.Page)."""
        whole: list[tuple[str, list[int], torch.Tensor, list[int]]] = []  # (tap, segments, rows, counts)
        single: list[tuple[str, list[int], list]] = []  # (tap, segments, value of each) read out per segment
        for tap, parts in plan.gathers.items():
            counts = [len(rows) for _, rows in parts]
            gathered = self._taps[tap].gather_out[: sum(counts)]
            # On the CPU a step's batches (its last segments at a tap) go to their pages now, which copy them:
            # all the taps of a batch arrive in this call, before the next forward writes the buffers again
            while self._side is None and parts and isinstance(plan.segments[parts[-1][0]].held, Batch):
                end = sum(counts)
                plan.segments[parts[-1][0]].held.put(tap, gathered[end - counts[-1] : end])
                parts, counts = parts[:-1], counts[:-1]
            if not parts:
                continue
            gathered = gathered[: sum(counts)]
            segments = [segment for segment, _ in parts]
            if tap not in plan.readouts:
                whole.append((tap, segments, gathered.clone(), counts))
                continue
            owners = [plan.segments[segment].owner for segment in segments]  # None: a batch (no readout)
            casts = {owner.cast_only(tap) if owner is not None else None for owner in owners}
            if len(casts) == 1 and None not in casts:  # every segment only casts, to one dtype: once for all
                whole.append((tap, segments, _cast(gathered, casts.pop()), counts))
                continue
            pieces = gathered.split(counts)
            paired = [self._paired_rows(plan, owner, segment, tap) for owner, segment in zip(owners, segments)]
            shared = _shared_readouts(tap, owners, pieces, paired)  # one encoding per SAE for all its segments
            values, kept = [], []
            for i, (segment, owner, chunk) in enumerate(zip(segments, owners, pieces)):
                if getattr(owner, "paired", None) == tap:  # rows its readout at another tap reads, not its own
                    continue
                kept.append(segment)
                if i in shared:
                    values.append(shared[i])
                else:
                    reads = owner is not None and tap in owner.device_taps
                    values.append(_read_out(owner, tap, chunk) if reads else chunk.clone())
            single.append((tap, kept, values))
        event = None
        if self.device.type == "cuda":  # the clones above free the gather buffers for the next forward at once
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                side = self._side
                whole = [(tap, segments, _to_host(rows, side), counts) for tap, segments, rows, counts in whole]
                single = [(tap, segments, [_to_host(v, side) for v in values]) for tap, segments, values in single]
                event = torch.cuda.Event()
                event.record(self._side)
        out = [Collected(tap, segments, values) for tap, segments, values in single]
        out += [
            Collected(tap, segments, list(rows.split(counts)) if len(counts) > 1 else [rows])
            for tap, segments, rows, counts in whole
        ]
        for c in out:
            if is_pattern(c.tap):  # as wide as the segment's own last row's context
                c.rows = [rows[..., : plan.segments[s].positions[-1] + 1] for s, rows in zip(c.segments, c.rows)]
        return Collection(out, event)

    def _paired_rows(self, plan: StepPlan, owner: object, segment: int, at: str) -> torch.Tensor | None:
        """The rows a stream's segment gathered at its paired tap (RowStream.paired), for its readout at `at`;
        None where it has none."""
        tap = getattr(owner, "paired", None)
        if tap is None or tap == at:
            return None
        start = 0
        for other, rows in plan.gathers[tap]:
            if other == segment:
                return self._taps[tap].gather_out[start : start + len(rows)]
            start += len(rows)
        raise AssertionError(f"segment {segment} gathered nothing at {tap}")


@dataclass
class Collection:
    """A step's gathered rows on their way to the host; never read before the copies' event."""

    items: list[Collected]
    event: torch.cuda.Event | None = None

    def ready(self) -> list[Collected]:
        if self.event is not None:
            self.event.synchronize()
        return self.items


def _pattern_rows(segments: list, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, width] key index (each row's keys 0.. of its own sequence) and [rows] row positions."""
    keys = torch.zeros(rows, width, dtype=torch.long)
    positions = torch.zeros(rows, dtype=torch.long)
    at = 0
    for seg in segments:
        n, k = len(seg.positions), seg.keys[:width]
        keys[at : at + n, : len(k)] = k
        positions[at : at + n] = torch.as_tensor(seg.positions)
        at += n
    return keys, positions


def _row_limits(segments: list, rows: int) -> np.ndarray:
    """[rows] the last key each row sees: its segment's limits, else its position (padding rows: 0)."""
    limits = np.zeros(rows, dtype=np.int64)
    at = 0
    for seg in segments:
        n = len(seg.positions)
        limits[at : at + n] = seg.positions if seg.limits is None else seg.limits
        at += n
    return limits


def _shared_readouts(
    tap: str, owners: list[object], pieces: tuple[torch.Tensor, ...], paired: list[torch.Tensor | None]
) -> dict[int, tuple]:  # fmt: skip
    """Results of the SAE readouts among a tap's segments: all those of one SAE from one encoding (`paired`:
    each segment's rows at its stream's paired tap, a transcoder's output)."""
    groups: dict[int, list[int]] = {}
    for i, owner in enumerate(owners):
        if isinstance(owner, RowStream) and isinstance(owner.readout, SAEReadout) and owner.paired != tap:
            groups.setdefault(id(owner.readout.sae), []).append(i)
    shared = {}
    for members in groups.values():
        readouts = [owners[i].readout for i in members]
        results = read_group(readouts, [pieces[i] for i in members], [paired[i] for i in members])
        shared.update(zip(members, results))
    return shared


def _read_out(stream: RowStream, tap: str, chunk: torch.Tensor):
    if tap in stream.head_taps:
        chunk = chunk.index_select(1, stream.heads.to(chunk.device))
    result = stream.readout(chunk, tap) if stream.readout is not None else chunk
    if stream.sums_on_device:  # in float32, cast once at the end: a sum rounded each step depends on the steps
        return result.sum(0, keepdim=True, dtype=torch.float32)
    if stream.dtype is not None and isinstance(result, torch.Tensor):
        result = _cast(result, stream.dtype)
    return result


def _cast(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of `rows` in `dtype` (integer rows, ids, keep int64): never a view of the gather buffer,
    which the next forward overwrites."""
    return rows.to(dtype, copy=True) if rows.is_floating_point() else rows.clone()


def _to_host(x, stream: torch.cuda.Stream):
    """A pinned host copy of device rows, made on `stream` (which already waits for their compute)."""
    if isinstance(x, tuple):  # a readout's (ids, values)
        return tuple(_to_host(t, stream) for t in x)
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    x.record_stream(stream)  # the allocator keeps it until the side stream is done with it
    return host
