"""What ranks 1.. of a tensor-parallel group run: load this rank's shard, then run each forward rank 0
sends, in order, until rank 0 says stop or goes away (its end of the pipe closes).

A forward arrives as a `Forward` (pickled over a pipe: the packed token ids, the attention layout, the
step's armed taps and the intervention vectors its edits read) and runs through the same
`ModelRunner` forward as on rank 0. Commands travel over pipes, not over the
process group, so an idle worker waits on no collective and no collective timeout runs out while the
engine has nothing to do; the collectives happen inside the forward, where the layers call them.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from vlens.attention import make_backend
from vlens.attention.metadata import AttentionMetadata
from vlens.capture.runtime import Tap
from vlens.distributed.parallel import Parallel
from vlens.distributed.taps import HookFailed, RankZeroHook, sharded_units
from vlens.engine.lora import LoRARequest, LoraSlots
from vlens.engine.model_runner import ModelRunner
from vlens.loader import load_model

TIMEOUT = timedelta(seconds=120)  # a collective that waits longer on a live peer: the group is broken


@dataclass
class Mirrored:
    """A worker's copy of the rows of rank 0's intervention table of one width that the edits read, at the
    same row ids (what `Tap._edit` reads of a `VectorTable`)."""

    data: torch.Tensor
    mask: torch.Tensor
    encoder: torch.Tensor
    params: torch.Tensor
    sources: torch.Tensor

    def write(self, ids: torch.Tensor, rows: tuple[torch.Tensor, ...]) -> None:
        need = int(ids.max()) + 1
        for name, values in zip(("data", "mask", "encoder", "params", "sources"), rows):
            table = getattr(self, name)
            if need > len(table) or table.shape[1:] != values.shape[1:]:  # (rank 0's encoders grow wider too)
                grown = table.new_zeros(max(need, len(table)), *values.shape[1:])
                grown[tuple(slice(0, n) for n in table.shape)] = table
                table = grown
                setattr(self, name, table)
            table[ids.to(table.device)] = values.to(table.device, table.dtype)


# The fields of an armed `Tap` that are index tensors (views of rank 0's index buffer), sent as copies.
INDEX_FIELDS = (
    "gather_index", "key_index", "row_positions", "row_limits", "edit_rows", "edit_vectors", "edit_kinds",
)  # fmt: skip


@dataclass
class ArmedTap:
    """What a worker needs of one of rank 0's armed taps: its indices, the shape of what it gathers (None:
    it gathers nothing here), for edits the width of its vector table and the edit coefficients, and for
    transcoder clamps the taps it feeds (by name) with its source id, or the shape of its own coefficients."""

    index: dict[str, torch.Tensor]
    softmax: bool
    gather: tuple[tuple[int, ...], torch.dtype] | None
    clamps: bool
    width: int | None
    coefficients: torch.Tensor | None
    feeds: tuple[str, ...] = ()
    source: int | None = None
    latch: tuple[int, ...] | None = None

    @classmethod
    def of(cls, t: Tap, gathers: bool, names: dict[int, str]) -> ArmedTap:
        """`names`: the step's site of each armed tap, by id (what a feeding tap's `feeds` are)."""
        index = {f: getattr(t, f).clone() for f in INDEX_FIELDS if getattr(t, f) is not None}
        if not gathers:
            index = {f: v for f, v in index.items() if f.startswith("edit_")}
        gather = (tuple(t.gather_out.shape), t.gather_out.dtype) if gathers and t.gather_index is not None else None
        edits = t.edit_rows is not None
        width = t.table.data.shape[1] if edits else None
        feeds = tuple(names[id(fed)] for fed in t.feeds)
        latch = None if t.latch is None else tuple(t.latch.shape)
        coefficients = t.coefficients.cpu() if edits else None
        return cls(index, t.softmax, gather, t.clamps, width, coefficients, feeds, t.source, latch)


@dataclass
class Forward:
    """One forward as rank 0 runs it: the packed token ids over the layout `meta` (tensors compacted to the
    host), the taps the other ranks need (edits everywhere, gathers only at sharded sites), the sites of
    rank 0's Python hooks, the vector rows the edits read, how deep to run, whose logits (the LM head
    gathers over the ranks), which backend, and the rows images give (rank 0 alone runs the vision tower)."""

    ids: torch.Tensor
    meta: AttentionMetadata
    taps: dict[str, ArmedTap]
    hooks: list[str]  # sites where a Python function runs on rank 0 (vlens.distributed.taps.RankZeroHook)
    vectors: dict[int, tuple[torch.Tensor, ...]]  # table width -> (row ids, data, mask, encoder, params)
    num_layers: int | None
    logit_rows: torch.Tensor | slice | None
    decode: bool  # the static decode step's backend (vlens.attention.decode), not the engine's
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # an image's rows and what they read (ForwardContext's)
    lora: torch.Tensor | None = None  # each row's LoRA slot (ModelRunner._forward's), where some row has one


@dataclass
class Lens:
    residual: torch.Tensor  # rows rank 0 reads through the final norm and unembedding (logit lens)


@dataclass
class LoadLora:
    """Rank 0 put a LoRA adapter in a slot (vlens.engine.lora): this rank puts its shard of it in the same one."""

    request: LoRARequest
    slot: int
    max_loras: int
    max_rank: int


HOST_FIELDS = frozenset({"block_tables"})  # AttentionMetadata's (the layouts derived from it stay on the host too)


def _moved(value, device):
    if isinstance(value, tuple):
        return tuple(_moved(v, device) for v in value)
    return value.to(device, copy=True) if isinstance(value, torch.Tensor) else value


def portable(meta: AttentionMetadata) -> AttentionMetadata:
    """The layout with every tensor a compact host copy (its device fields are views of rank 0's buffers); without
    the linear-attention chunks, which each rank plans from the query lengths (ModelRunner._forward)."""
    fields = {f.name: _moved(getattr(meta, f.name), "cpu") for f in dataclasses.fields(meta)}
    return dataclasses.replace(meta, **fields | {"linear_chunks": None})


def table_rows(taps: dict[str, Tap]) -> dict[int, tuple[torch.Tensor, ...]]:
    """Rank 0's intervention-table rows that the armed edits read, per table width, on the host."""
    wanted: dict[int, tuple[object, set[int]]] = {}
    for t in taps.values():
        if t.edit_rows is not None:
            table = t.table
            wanted.setdefault(table.data.shape[1], (table, set()))[1].update(t.edit_vectors.reshape(-1).tolist())
    out = {}
    for width, (table, ids) in wanted.items():
        index = torch.tensor(sorted(ids), dtype=torch.long)
        tensors = (table.data, table.mask, table.encoder, table.params, table.sources)
        rows = (t.index_select(0, index.to(t.device)).cpu() for t in tensors)
        out[width] = (index, *rows)
    return out


class Worker:
    """One rank's model and KV cache, run through the same `ModelRunner` forward as rank 0's."""

    def __init__(self, model, backend, kernels: bool):
        self.runner = ModelRunner(model, backend, 1, 1, kernels=kernels)
        self.device, self.dtype = self.runner.device, self.runner.dtype
        self.tables: dict[int, Mirrored] = {}

    def _taps(self, work: Forward) -> dict[str, Tap]:
        for width, (ids, *rows) in work.vectors.items():
            if width not in self.tables:
                self.tables[width] = Mirrored(*(r[:0].to(self.device) for r in rows))
            self.tables[width].write(ids, tuple(rows))
        taps = {}
        for name, armed in work.taps.items():
            t = taps[name] = Tap()
            for field, value in armed.index.items():
                setattr(t, field, value.to(self.device))
            t.softmax, t.clamps = armed.softmax, armed.clamps
            if armed.gather is not None:
                shape, dtype = armed.gather
                t.gather_out = torch.empty(shape, dtype=dtype, device=self.device)
            if armed.width is not None:
                t.table, t.coefficients = self.tables[armed.width], armed.coefficients.to(self.device)
            if armed.latch is not None:
                t.latch = torch.zeros(armed.latch, dtype=self.dtype, device=self.device)
        for name, armed in work.taps.items():
            taps[name].feeds, taps[name].source = tuple(taps[fed] for fed in armed.feeds), armed.source
        cfg = self.runner.cfg
        taps.update({name: RankZeroHook(None, sharded_units(name, cfg), cfg.parallel) for name in work.hooks})
        return taps

    @torch.inference_mode()
    def run(self, work: Forward | Lens | LoadLora) -> None:
        runner = self.runner
        if isinstance(work, Lens):
            runner.model.lens(work.residual.to(self.device))
            return
        if isinstance(work, LoadLora):
            if runner.loras is None:
                runner.loras = LoraSlots(runner.model, work.max_loras, work.max_rank)
            runner.loras.load(work.request, work.slot)
            return
        meta = dataclasses.replace(work.meta, **{
            f.name: _moved(getattr(work.meta, f.name), self.device)
            for f in dataclasses.fields(work.meta) if f.name not in HOST_FIELDS
        })  # fmt: skip
        if meta.paged and runner.num_slots != meta.num_slots:  # rank 0's cache, this rank's KV heads (and states)
            blocks = meta.num_slots // meta.block_size - 1  # less the scratch block
            runner.allocate_kv_cache(blocks, meta.block_size, meta.block_size, meta.num_states)
        rows = work.logit_rows.to(self.device) if isinstance(work.logit_rows, torch.Tensor) else work.logit_rows
        backend = runner.decode_backend if work.decode else None
        # rank 0's function at a hook may raise: every rank leaves the forward there, and rank 0 reports it
        embeds = None if work.embeds is None else tuple(t.to(self.device) for t in work.embeds)
        lora = None if work.lora is None else work.lora.to(self.device)
        with suppress(HookFailed):
            runner._forward(meta, work.ids.to(self.device), self._taps(work), work.num_layers, rows, backend,
                            embeds=embeds, lora=lora)  # fmt: skip


def start(rank: int, size: int, init: str, spec: dict) -> Worker:
    """Join the group as `rank` and load this rank's shard (`spec`: what the executor says of the model and
    the machine; `spec["device_per_rank"]`: cuda:rank, else the one device this process sees; `spec["environ"]`,
    where given: rank 0's environment, which a forked worker takes in place of its fork server's)."""
    if "environ" in spec:
        os.environ.clear()
        os.environ.update(spec["environ"])
    torch.set_num_threads(spec["threads"])
    device = torch.device("cpu")
    if spec["device"] == "cuda":
        device = torch.device("cuda", rank if spec["device_per_rank"] else 0)
        torch.cuda.set_device(device)
    dist.init_process_group(spec["group"], init_method=init, rank=rank, world_size=size, timeout=TIMEOUT)
    loaded = load_model(spec["model"], dtype=spec["dtype"], device=str(device), parallel=Parallel(rank, size),
                        latent_kv_cache=spec["latent_kv_cache"], hf_overrides=spec["hf_overrides"])  # fmt: skip
    kinds = {attn.kind for attn in loaded.model.attention_layers()}  # every rank's: the same heads per rank
    backend = make_backend(spec["backend"], device, spec["compiled"], kinds, loaded.model.lm_head.weight.dtype,
                           spec["block_size"])  # fmt: skip
    return Worker(loaded.model, backend, spec["compiled"])


def main(rank: int, size: int, init: str, spec: dict, conn) -> None:
    """A worker process: join the group, load the shard, say ready, then serve forwards."""
    try:
        worker = start(rank, size, init, spec)
        conn.send(("ready", None))
    except Exception:  # noqa: BLE001 - any failure to start is rank 0's to report
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
