"""Layers that keep a state per sequence between forwards (a linear-attention layer's recurrent state, a causal
convolution's last inputs), in the runner's state slots beside the paged KV cache.

Such a state is of a sequence's whole prefix, so unlike keys and values it is read and then replaced by each forward
of the sequence: a sequence holds one slot from its first block on (vlens.engine.block_manager), the forward reads
it where the sequence continues (its first position here is past 0) and writes it back. A forward with no slots (a
cache-less trace or harvest) starts every sequence from zeros and keeps nothing.
"""

from __future__ import annotations

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


def step_slots(layer: SlotStates, name: str, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(each sequence's slot [B], whether it continues its state [B] bool) where `layer` keeps states (its `name`
    allocated) and the forward has slots; None: start from zeros, keep nothing."""
    if getattr(layer, name) is None or meta.state_slots is None:
        return None
    return meta.state_slots, meta.positions[meta.cu_seqlens_q[:-1].long()] > 0
