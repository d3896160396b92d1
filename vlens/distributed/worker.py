"""What ranks 1.. of a tensor-parallel group run: load this rank's shard, then run each forward rank 0
sends, in order, until rank 0 says stop or goes away (its end of the pipe closes).

A forward arrives as a `Forward` (pickled over a pipe: the packed token ids, the attention layout, the
step's tap plan and the intervention vectors its edits read). Commands travel over pipes, not over the
process group, so an idle worker waits on no collective and no collective timeout runs out while the
engine has nothing to do; the collectives happen inside the forward, where the layers call them.
"""

from __future__ import annotations

import dataclasses
import math
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from vlens.attention.metadata import AttentionMetadata
from vlens.capture.names import hook_shapes
from vlens.capture.plan import StepPlan
from vlens.capture.runtime import TapRuntime
from vlens.context import ForwardContext, set_context
from vlens.distributed.parallel import Parallel

TIMEOUT = timedelta(seconds=120)  # a collective that waits longer on a live peer: the group is broken


@dataclass
class Mirrored:
    """A worker's copy of the rows of rank 0's intervention tables that a step's edits read, at the
    same row ids (what `Tap._edit` reads of a `VectorTable`)."""

    data: torch.Tensor
    mask: torch.Tensor
    encoder: torch.Tensor
    params: torch.Tensor

    def write(self, ids: torch.Tensor, rows: tuple[torch.Tensor, ...]) -> None:
        need = int(ids.max()) + 1
        for name, values in zip(("data", "mask", "encoder", "params"), rows):
            table = getattr(self, name)
            if need > len(table):
                table = torch.cat([table, table.new_zeros(need - len(table), *table.shape[1:])])
                setattr(self, name, table)
            table[ids.to(table.device)] = values.to(table.device, table.dtype)


@dataclass
class Forward:
    ids: torch.Tensor  # [T] packed token ids (host)
    meta: AttentionMetadata  # its tensors on the host; `on_device` names those the model reads on the device
    on_device: tuple[str, ...]
    plan: StepPlan | None  # the taps the workers arm: edits, and gathers of sharded sites only
    num_layers: int | None  # stop after this many layers (None: all, then the final norm)
    logit_rows: list[int] | None  # rows whose logits rank 0 computes (the LM head gathers over the ranks)
    vectors: dict[int, tuple[torch.Tensor, ...]]  # table width -> (row ids, data, mask, encoder, params)


@dataclass
class Lens:
    residual: torch.Tensor  # rows rank 0 reads through the final norm and unembedding (logit lens)


def portable(meta: AttentionMetadata) -> tuple[AttentionMetadata, tuple[str, ...]]:
    """The layout with its device tensors on the host, and the names of those fields."""
    moved, names = {}, []
    for f in dataclasses.fields(meta):
        value = getattr(meta, f.name)
        if _on_device(value):
            moved[f.name] = _to(value, "cpu")
            names.append(f.name)
    return dataclasses.replace(meta, **moved), tuple(names)


def _on_device(value) -> bool:
    if isinstance(value, tuple):
        return any(_on_device(v) for v in value)
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def _to(value, device):
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value.to(device) if isinstance(value, torch.Tensor) else value


class Worker:
    """One rank's model, KV cache and taps; `run` executes what rank 0 sent."""

    def __init__(self, model, backend):
        self.model, self.cfg, self.backend = model, model.cfg, backend
        self.device, self.dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        self.kinds = {attn.kind for attn in model.attention_layers()}
        self.taps = TapRuntime(hook_shapes(self.cfg), self.device, self.dtype)
        self.kv_cache: torch.Tensor | None = None

    def _cache(self, num_slots: int) -> None:
        """The KV cache, as many slots as rank 0's and this rank's KV heads, made at the first step."""
        if self.kv_cache is not None and self.kv_cache.shape[2] == num_slots:
            return
        layers = self.model.attention_layers()
        shape = (len(layers), 2, num_slots, layers[0].num_kv_heads, layers[0].head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(layers):
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]

    @torch.inference_mode()
    def run(self, work: Forward | Lens) -> None:
        if isinstance(work, Lens):
            self.model.lens(work.residual.to(self.device))
            return
        moved = {name: _to(getattr(work.meta, name), self.device) for name in work.on_device}
        meta = dataclasses.replace(work.meta, **moved)
        if meta.paged:
            self._cache(meta.num_slots)
        for width, (ids, *rows) in work.vectors.items():
            table = self.taps.tables.get(width)
            if table is None:
                table = self.taps.tables[width] = Mirrored(*(r[:0].to(self.device) for r in rows))
            table.write(ids, tuple(rows))
        taps = self.taps.arm(work.plan) if work.plan else {}
        set_context(ForwardContext(meta, self.backend, self.backend.prepare(meta, self.kinds, self.dtype), taps))
        try:
            hidden = self.model(work.ids.to(self.device), num_layers=work.num_layers)
            if work.logit_rows is not None:
                rows = torch.tensor(work.logit_rows, dtype=torch.long, device=self.device)
                self.model.logits(hidden.index_select(0, rows))
        finally:
            set_context(None)


def table_rows(plan: StepPlan, taps: TapRuntime) -> dict[int, tuple[torch.Tensor, ...]]:
    """Rank 0's intervention-table rows that the edits of `plan` read, per table width, on the host."""
    wanted: dict[int, set[int]] = {}
    for tap, passes in plan.edits.items():
        wanted.setdefault(math.prod(taps.shapes[tap]), set()).update(v for e in passes for v in e.vectors)
    out = {}
    for width, ids in wanted.items():
        table, index = taps.tables[width], torch.tensor(sorted(ids), dtype=torch.long)
        rows = (t.index_select(0, index.to(t.device)).cpu() for t in (table.data, table.mask, table.encoder, table.params))
        out[width] = (index, *rows)
    return out


def main(rank: int, size: int, init: str, spec: dict, conn) -> None:
    """A worker process: join the group, load the shard, say ready, then serve forwards."""
    from vlens.attention import make_backend
    from vlens.loader import load_model

    try:
        torch.set_num_threads(spec["threads"])
        device = torch.device("cuda", rank) if spec["device"] == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(spec["group"], init_method=init, rank=rank, world_size=size, timeout=TIMEOUT)
        loaded = load_model(spec["model"], dtype=spec["dtype"], device=str(device), parallel=Parallel(rank, size))
        worker = Worker(loaded.model, make_backend(spec["backend"], device, compiled=False))
        conn.send(("ready", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            work = conn.recv()
        except EOFError:  # rank 0 is gone
            break
        if work is None:
            break
        worker.run(work)
    dist.destroy_process_group()
