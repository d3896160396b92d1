"""Layers that keep a state per sequence between forwards (a linear-attention layer's recurrent state, a causal
convolution's last inputs), in the runner's state slots beside the paged KV cache.

Such a state is of a sequence's whole prefix, so unlike keys and values it is read and then replaced by each forward
of the sequence: a sequence holds one slot from its first block on (vlens.engine.block_manager), the forward reads
it where the sequence continues (its first position here is past 0) and writes it back. A chunk that starts from a
cached prefix reads that prefix's kept state instead, and a chunk whose state is kept for later prefixes writes it
to a second slot too. A forward with no slots (a cache-less trace or harvest) starts every sequence from zeros and
keeps nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vlens.attention.metadata import AttentionMetadata

# attribute -> (one slot's shape, its dtype; None: the model's)
Shapes = dict[str, tuple[tuple[int, ...], torch.dtype | None]]


class SlotStates(nn.Module):
    """`slot_shapes()` says what one slot holds; the runner allocates each attribute [slots + 1, *shape] (the last
    slot a scratch one, for a static decode step's padding rows) and sets it (None until then)."""

    def slot_shapes(self) -> Shapes:
        raise NotImplementedError


@dataclass
class StepSlots:
    """Where a forward's sequences read their states and write them (AttentionMetadata's state fields)."""

    own: torch.Tensor  # [B] each sequence's slot, which its new state replaces
    source: torch.Tensor  # [B] the slot it starts from: its own, or a cached prefix's kept state
    continues: torch.Tensor  # [B] bool: whether it starts from a state (its first position here is past 0)
    saves: tuple[torch.Tensor, torch.Tensor] | None  # (batch rows, slots): new states kept in those slots too

    def read(self, states: torch.Tensor) -> torch.Tensor:
        """Each sequence's state to start from [B, ...] (zeros where it starts afresh)."""
        return states[self.source] * self.continues.view(-1, *(1,) * (states.dim() - 1))

    def write(self, states: torch.Tensor, new: torch.Tensor) -> None:
        """Each sequence's new state [B, ...] into its slot (and a kept one's into its second)."""
        states[self.own] = new
        if self.saves is not None:
            states[self.saves[1]] = new[self.saves[0]]


def step_slots(layer: SlotStates, name: str, meta: AttentionMetadata) -> StepSlots | None:
    """Where the forward reads and writes `layer`'s states, where it keeps them (its `name` allocated) and the
    forward has slots; None: start from zeros, keep nothing."""
    if getattr(layer, name) is None or meta.state_slots is None:
        return None
    source = meta.state_slots if meta.state_sources is None else meta.state_sources
    continues = meta.positions[meta.cu_seqlens_q[:-1].long()] > 0
    return StepSlots(meta.state_slots, source, continues, meta.state_saves)
