"""The layout of one forward as attention kernels take it, built once per step by whoever runs the model.

Sequences are packed back to back: the queries of sequence i are rows cu_seqlens_q[i] .. cu_seqlens_q[i+1]
of the batch, at positions start_i .. start_i + query_len_i - 1, and its keys are positions
0 .. context_len_i - 1 — in the paged KV cache where its block table says, or, for a cache-less forward
of whole sequences (trace, harvest), packed exactly like its queries. Every backend plans from this and
nothing else, so the model code never sees sequences or blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from typing import NamedTuple

import numpy as np
import torch


class LayerKind(NamedTuple):
    """What an attention layer asks of a kernel; layers of one kind share a backend's plan."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None  # sliding window (HF's: keys p - window < j <= p); None: full causal
    scale: float
    softcap: float | None  # Gemma 2: cap * tanh(score / cap)
    sinks: bool = False  # gpt-oss: a learned logit per head (the layer's `sinks`) joins each softmax
    alibi: bool = False  # BLOOM, Falcon-RW, MPT: ALiBi's biases on the scores (Attention.alibi_bias)
    chunk: int | None = None  # Llama 4: the keys of the query's own chunk of positions alone (j // chunk == p // chunk)

    @property
    def reach(self) -> Reach:
        """(window, chunk): what bounds the keys a query sees from below; layers of one reach share a mask."""
        return self.window, self.chunk


Reach = tuple[int | None, int | None]  # LayerKind.reach
FULL_REACH: Reach = (None, None)  # every key up to the query's own


def first_visible(reach: Reach, p):
    """The first key position a query at position `p` (an int, or a numpy array or tensor of them) sees under
    `reach` (LayerKind.reach): p - window + 1 in a sliding window (HF's p - window < j), the first of p's chunk in
    chunked attention, else 0. A query sees the keys from there to its own position."""
    window, chunk = reach
    if window is not None:
        return p - window + 1
    if chunk is not None:
        return p - p % chunk
    return p * 0


CHUNK = 64  # rows a linear-attention layer solves together (vlens.layers.gated_delta; HF's chunk size)
Put = Callable[[str, "torch.Tensor | np.ndarray"], torch.Tensor]  # host values -> the runner's device buffer


@dataclass
class AttentionMetadata:
    """Everything a backend reads, derived once per forward (`layout`): backends plan from these fields and
    never re-derive sequences or pages. Device tensors are fronts of the runner's buffers."""

    query_lens: list[int]  # per sequence (host): tokens fed this step
    context_lens: list[int]  # per sequence (host): keys after this step (start + query_len)
    pages: list[int]  # per sequence (host): KV blocks its keys fill (0 without a cache)
    block_tables: torch.Tensor | None  # [B, max pages] (host): each sequence's KV blocks, 0 past its pages;
    # None: no cache
    block_size: int
    positions: torch.Tensor  # [T] position of each packed token in its sequence
    sequence_ends: torch.Tensor  # [T] last position of each token's whole sequence so far (LongRoPE picks its
    # factors by it, as HF does by its input's length: a prefill chunk counts the prompt's end, not its own)
    token_seq: torch.Tensor  # [T] which sequence each packed token belongs to
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: where each sequence's queries start
    slot_mapping: torch.Tensor | None = None  # [T] cache slot each new key and value is written to
    num_slots: int = 0  # of the cache
    block_tables_device: torch.Tensor | None = None  # [B, table width] the block tables, for the static decode
    context_lens_device: torch.Tensor | None = None  # [B] ... and the context lengths (vlens.attention.decode)
    # (from, to) [C] cache slots whose keys and values are copied once the step's new ones are written:
    # a prompt prefix one sequence computes for another in the same step (vlens.engine.sequence.Borrow)
    kv_copy: tuple[torch.Tensor, torch.Tensor] | None = None
    # [B] (device): each sequence's state slot, where layers that keep states per sequence keep them (Qwen 3.5's linear
    # attention, LFM2's short convolutions); None: no states (a cache-less forward, or a model without such layers)
    state_slots: torch.Tensor | None = None
    # [B] (device): the slot each sequence's state is read from, where some sequence starts from a cached prefix's
    # kept state (vlens.engine.block_manager); None: each its own
    state_sources: torch.Tensor | None = None
    # (batch rows, slots) [S] (device): sequences whose state after this forward is kept in a second slot too, for
    # later sequences to start from; None: none
    state_saves: tuple[torch.Tensor, torch.Tensor] | None = None
    # (from, to) [C] (device): state slots copied before the forward advances them (a sequence's state at a block
    # boundary, kept for when it ends: vlens.engine.block_manager); None: none
    state_copies: tuple[torch.Tensor, torch.Tensor] | None = None
    num_states: int = 0  # ... of how many slots (and a scratch one after them): what the other ranks allocate
    # how linear-attention layers lay out a forward's rows where some sequence feeds several (`chunk_layout`); None:
    # none does, or no such layers
    linear_chunks: LinearChunks | None = None
    # [T] (host): the last key position each query sees, where some see past their own (the tokens of an image that
    # attend to each other both ways, Gemma 3's: vlens.images); None: every query sees up to its own position
    key_limits: np.ndarray | None = None
    # [3, T] (device): each row's three rotary positions (time, height, width) where the model's rotary reads three
    # (ModelConfig.mrope_section) and some row's differ from its position (an image's, or any row after one:
    # vlens.images); None: `positions`, thrice
    rope_positions: torch.Tensor | None = None

    @property
    def paged(self) -> bool:
        return self.block_tables is not None

    # Layouts only some kernels take (varlen, flex): derived from the fields above the first time a backend's
    # `prepare` asks, once per step.

    @cached_property
    def page_indptr(self) -> torch.Tensor:
        """[B + 1] int32 (host): where each sequence's pages start in `page_indices`."""
        return torch.tensor([0, *self.pages], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    @cached_property
    def page_indices(self) -> torch.Tensor:
        """[pages] int32 (host): every sequence's blocks, in order."""
        held = torch.arange(self.block_tables.shape[1]) < torch.tensor(self.pages)[:, None]
        return self.block_tables[held].to(torch.int32)

    @cached_property
    def last_page_lens(self) -> torch.Tensor:
        """[B] int32 (host): keys in each sequence's last block."""
        pages, context = torch.tensor(self.pages), torch.tensor(self.context_lens)
        return (context - (pages - 1) * self.block_size).to(torch.int32)

    @cached_property
    def cu_seqlens_k(self) -> torch.Tensor:
        """[B + 1] int32 (device): where each sequence's keys start when they are packed back to back."""
        cu = torch.tensor([0, *self.context_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return cu.to(self.positions.device, non_blocking=True)

    @cached_property
    def context_lens_tensor(self) -> torch.Tensor:
        """[B] int32 (device): keys of each sequence after this step."""
        return torch.tensor(self.context_lens, dtype=torch.int32).to(self.positions.device, non_blocking=True)

    @cached_property
    def packed_key_slots(self) -> torch.Tensor:
        """[sum of context_lens] (device): the cache slot of every key of every sequence, sequence after
        sequence (key j of sequence i at cu_seqlens_k[i] + j)."""
        lens = torch.tensor(self.context_lens)
        seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
        j = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[seq]
        slots = self.block_tables[seq, j // self.block_size] * self.block_size + j % self.block_size
        return slots.to(self.positions.device, non_blocking=True)

    def key_slots(self, first: int, stop: int) -> np.ndarray:
        """[stop - first, keys] (host): the cache slot of key j of sequences first .. stop - 1, for j up to
        the longest of their contexts (slots past a shorter context are block 0's, never meant to be read)."""
        keys, bs = max(self.context_lens[first:stop]), self.block_size
        j = np.arange(keys)
        return self.block_tables.numpy()[first:stop, j // bs] * bs + j % bs


class LinearChunks(NamedTuple):
    """(device) How a forward's rows go through linear-attention layers where some sequence feeds several: those
    sequences' rows in chunks of CHUNK, each sequence's from its first row (vlens.layers.gated_delta), and the rows of
    sequences that feed one each (decodes beside a prompt) through the recurrence itself."""

    rows: torch.Tensor  # [N, CHUNK] the row at each place of each chunk (T past its sequence's last row)
    table: torch.Tensor  # [Bc, most chunks] each chunked sequence's chunks in order (N past its last)
    place: torch.Tensor  # [Tc] each chunked row's place among the N * CHUNK
    chunked_rows: torch.Tensor  # [Tc] which rows those are
    chunked_seqs: torch.Tensor  # [Bc] ... and which sequences
    single_rows: torch.Tensor  # [Bs] the row of each sequence that feeds one
    single_seqs: torch.Tensor  # [Bs] ... and which sequence it is

    def of(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [N, CHUNK, ...]: the rows of each chunk, zeros past a sequence's last row (index T)."""
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[self.rows]


def chunk_layout(query_lens: list[int], device: torch.device) -> LinearChunks:
    """The LinearChunks of a forward whose sequences feed `query_lens` rows each, on `device`."""
    lens = np.asarray(query_lens, dtype=np.int64)
    first_row = np.cumsum(lens) - lens
    chunked, single = np.flatnonzero(lens > 1), np.flatnonzero(lens == 1)
    mine, start = lens[chunked], first_row[chunked]
    counts = -(-mine // CHUNK)
    first_chunk = np.cumsum(counts) - counts
    seq = np.repeat(np.arange(len(chunked)), counts)  # each chunk's sequence, among the chunked ones
    nth = np.arange(len(seq)) - first_chunk[seq]
    offsets = nth[:, None] * CHUNK + np.arange(CHUNK)
    rows = np.where(offsets < mine[seq, None], start[seq, None] + offsets, lens.sum())
    table = np.full((len(chunked), counts.max(initial=0)), len(seq), dtype=np.int64)
    table[seq, nth] = np.arange(len(seq))
    row_seq = np.repeat(np.arange(len(chunked)), mine)
    within = np.arange(len(row_seq)) - (np.cumsum(mine) - mine)[row_seq]  # each chunked row's index in its sequence
    parts = (rows, table, first_chunk[row_seq] * CHUNK + within, start[row_seq] + within, chunked, first_row[single],
             single)  # fmt: skip
    return LinearChunks(*(torch.from_numpy(np.ascontiguousarray(x, np.int64)).to(device, non_blocking=True)
                          for x in parts))  # fmt: skip


def layout(
    starts: list[int], query_lens: list[int], sequence_lens: list[int], block_tables: list[list[int]] | None,
    block_size: int, num_slots: int, put: Put, table_width: int | None = None, state_slots: list[int] | None = None,
) -> AttentionMetadata:
    """The metadata of one forward: sequence i (sequence_lens[i] tokens so far) feeds query_lens[i] tokens from
    position starts[i], over its block table (None: a cache-less forward of whole sequences packed back to
    back, whose keys are its queries). Host arithmetic in numpy, one `put` per device field. `table_width`:
    the block tables also go to the device, that many pages wide (the static decode step's page bucket).
    `state_slots`: each sequence's state slot, for a model whose layers keep states (vlens.layers.slot_states)."""
    n = len(query_lens)
    lens = np.asarray(query_lens, dtype=np.int64)
    begin = np.asarray(starts, dtype=np.int64)
    context = begin + lens
    if n and max(query_lens) == 1:  # every sequence decodes: one row each (the common step)
        seq, positions = np.arange(n), begin
    else:
        seq = np.repeat(np.arange(n), lens)
        positions = begin[seq] + np.arange(len(seq)) - (np.cumsum(lens) - lens)[seq]
    ends = np.asarray(sequence_lens, dtype=np.int64)[seq] - 1
    cu = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    context_lens = context.tolist()
    common = dict(
        query_lens=list(query_lens), context_lens=context_lens, block_size=block_size,
        positions=put("positions", positions), sequence_ends=put("sequence_ends", ends),
        token_seq=put("token_seq", seq), cu_seqlens_q=put("cu_seqlens_q", cu),
        state_slots=None if state_slots is None else put("state_slots", np.asarray(state_slots, np.int64)),
    )  # fmt: skip
    if block_tables is None:
        return AttentionMetadata(pages=[0] * n, block_tables=None, **common)
    pages = -(-context // block_size)
    width = int(pages.max()) if table_width is None else table_width
    # each table's first pages, flattened in C (no per-sequence numpy call), then laid into [B, width] rows
    held = np.arange(width) < pages[:, None]
    page_list = pages.tolist()
    used = np.fromiter(chain.from_iterable(t[:p] for t, p in zip(block_tables, page_list)), np.int64, int(pages.sum()))
    tables = np.zeros((n, width), dtype=np.int64)
    tables[held] = used
    slots = tables[seq, positions // block_size] * block_size + positions % block_size
    if table_width is not None:
        common["block_tables_device"] = put("block_tables", tables)
        common["context_lens_device"] = put("context_lens", context)
    return AttentionMetadata(
        pages=page_list, block_tables=torch.from_numpy(tables), slot_mapping=put("slot_mapping", slots),
        num_slots=num_slots, **common,
    )  # fmt: skip
