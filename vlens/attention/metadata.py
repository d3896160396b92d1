"""The layout of one forward as attention kernels take it, built once per step by whoever runs the model.

Sequences are packed back to back: the queries of sequence i are rows cu_seqlens_q[i] .. cu_seqlens_q[i+1]
of the batch, at positions start_i .. start_i + query_len_i - 1, and its keys are positions
0 .. context_len_i - 1 — in the paged KV cache where its block table says, or, for a cache-less forward
of whole sequences (trace, harvest), packed exactly like its queries. Every backend plans from this and
nothing else, so the model code never sees sequences or blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass
class AttentionMetadata:
    query_lens: list[int]  # per sequence (host): tokens fed this step
    context_lens: list[int]  # per sequence (host): keys after this step (start + query_len)
    block_tables: torch.Tensor | None  # [B, pages] (host): each sequence's KV blocks, as many as its keys fill
    # (0 past them); None: no cache
    block_size: int
    positions: torch.Tensor  # [T] position of each packed token in its sequence
    sequence_ends: torch.Tensor  # [T] last position of each token's whole sequence so far (LongRoPE picks its
    # factors by it, as HF does by its input's length: a prefill chunk counts the prompt's end, not its own)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: where each sequence's queries start
    slot_mapping: torch.Tensor | None = None  # [T] cache slot each new key and value is written to
    num_slots: int = 0  # of the cache
    # (from, to) [C] cache slots whose keys and values are copied once the step's new ones are written:
    # a prompt prefix one sequence computes for another in the same step (vlens.engine.sequence.Borrow)
    kv_copy: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def paged(self) -> bool:
        return self.block_tables is not None

    @property
    def starts(self) -> list[int]:
        return [c - q for c, q in zip(self.context_lens, self.query_lens)]

    # Derived layouts some kernels take. Each is computed from the fields above where it is asked for; they
    # are per step, so a runner that builds them once per step may store them in place of these.

    @property
    def query_sequences(self) -> torch.Tensor:
        """[T] (device): the sequence of each packed query row."""
        cu = self.cu_seqlens_q
        lens = (cu[1:] - cu[:-1]).long()
        return torch.repeat_interleave(torch.arange(len(lens), device=cu.device), lens, output_size=len(self.positions))

    @property
    def cu_seqlens_k(self) -> torch.Tensor:
        """[B + 1] int32 (device): where each sequence's keys start when they are packed back to back."""
        cu = torch.tensor([0, *self.context_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return cu.to(self.positions.device, non_blocking=True)

    @property
    def context_lens_tensor(self) -> torch.Tensor:
        """[B] int32 (device): keys of each sequence after this step."""
        return torch.tensor(self.context_lens, dtype=torch.int32).to(self.positions.device, non_blocking=True)

    @property
    def packed_key_slots(self) -> torch.Tensor:
        """[sum of context_lens] (device): the cache slot of every key of every sequence, sequence after
        sequence (key j of sequence i at cu_seqlens_k[i] + j)."""
        lens = torch.tensor(self.context_lens)
        seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
        j = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[seq]
        slots = self.block_tables[seq, j // self.block_size] * self.block_size + j % self.block_size
        return slots.to(self.positions.device, non_blocking=True)

    def key_slots(self, first: int, stop: int) -> torch.Tensor:
        """[stop - first, keys] (host): the cache slot of key j of sequences first .. stop - 1, for j up to
        the longest of their contexts (slots past a shorter context are block 0's, never meant to be read)."""
        keys, bs = max(self.context_lens[first:stop]), self.block_size
        j = torch.arange(keys)
        return self.block_tables[first:stop, j // bs] * bs + j % bs


def _device_tensors(positions: torch.Tensor, ends: torch.Tensor, lens: list[int], device: torch.device):
    cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return (t.to(device, non_blocking=True) for t in (positions, ends, cu))


def paged_metadata(
    starts: list[int], query_lens: list[int], sequence_lens: list[int], block_tables: list[list[int]],
    block_size: int, num_slots: int, device: torch.device,
) -> AttentionMetadata:
    """An engine step: sequence i (sequence_lens[i] tokens so far) feeds query_lens[i] tokens from
    position starts[i] over its block table."""
    lens = torch.tensor(query_lens)
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
    first = torch.cumsum(lens, 0) - lens
    positions = torch.tensor(starts)[seq] + torch.arange(int(lens.sum())) - first[seq]
    context_lens = [s + n for s, n in zip(starts, query_lens)]
    pages = [-(-c // block_size) for c in context_lens]
    width = max(pages)
    # through numpy: torch.tensor of nested lists is several times slower, and this runs every step
    tables = torch.from_numpy(np.array([t[:n] + [0] * (width - n) for t, n in zip(block_tables, pages)], dtype=np.int64))
    slots = tables[seq, positions // block_size] * block_size + positions % block_size
    ends = torch.tensor(sequence_lens)[seq] - 1
    positions, ends, cu = _device_tensors(positions, ends, query_lens, device)
    return AttentionMetadata(
        query_lens, context_lens, tables, block_size, positions, ends, cu, slots.to(device, non_blocking=True),
        num_slots,
    )  # fmt: skip


def packed_metadata(lens: list[int], device: torch.device) -> AttentionMetadata:
    """A cache-less forward of whole sequences packed back to back."""
    lengths = torch.tensor(lens)
    seq = torch.repeat_interleave(torch.arange(len(lens)), lengths)
    positions = torch.arange(int(lengths.sum())) - (torch.cumsum(lengths, 0) - lengths)[seq]
    ends = lengths[seq] - 1
    positions, ends, cu = _device_tensors(positions, ends, lens, device)
    return AttentionMetadata(list(lens), list(lens), None, 0, positions, ends, cu)
