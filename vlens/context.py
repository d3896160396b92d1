"""Per-forward batch layout, set by whoever runs the model and read by the attention backend and taps.

The model files never see sequences, requests or the KV cache: they read this context. That is what
lets the engine's paged cache, the trace path and harvest share one model implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

Tap = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [T] position of each packed token within its sequence
    q_index: torch.Tensor | None  # [T] index of each token in the [B * max_q] query grid; None = identity
    query_positions: torch.Tensor  # [B, max_q] position of each grid slot (0 in unused slots)
    key_slots: torch.Tensor | None = None  # [B, Lk] cache slots of each sequence's keys; None = no cache
    slot_mapping: torch.Tensor | None = None  # [T] cache slot each new key/value is written to
    taps: dict[str, Tap] = field(default_factory=dict)  # hook name -> what to do there; empty = nothing
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return self.query_positions.shape[0]

    @property
    def max_q(self) -> int:
        return self.query_positions.shape[1]

    def mask(self, window: int | None) -> torch.Tensor | None:
        """Boolean [B, 1, max_q, Lk] mask shared by all layers of one window size; None = plain causal.

        Key j of a sequence sits at position j (the cache holds a sequence from position 0), so query
        position p may see keys p - window < j <= p, as in HF's sliding-window mask.
        """
        if window not in self._masks:
            if self.key_slots is None and window is None:
                self._masks[window] = None  # keys are the queries themselves, from position 0: is_causal
            else:
                num_keys = self.max_q if self.key_slots is None else self.key_slots.shape[1]
                key_pos = torch.arange(num_keys, device=self.positions.device)
                q = self.query_positions[:, None, :, None]
                allowed = key_pos <= q
                if window is not None:
                    allowed &= key_pos > q - window
                self._masks[window] = allowed
        return self._masks[window]


_context: ForwardContext | None = None


def set_context(ctx: ForwardContext | None) -> None:
    global _context
    _context = ctx


def get_context() -> ForwardContext:
    assert _context is not None, "the model runs only inside a ForwardContext (see vlens.context)"
    return _context


def packed_context(seq_lens: list[int], device: torch.device, taps: dict[str, Tap] | None = None) -> ForwardContext:
    """Context for a cache-less forward of whole sequences packed back to back (trace, harvest)."""
    lens = torch.tensor(seq_lens, dtype=torch.long)
    starts = torch.cumsum(lens, 0) - lens
    max_q = int(lens.max())
    token_seq = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)
    positions = torch.arange(int(lens.sum())) - starts[token_seq]
    grid = torch.arange(max_q).expand(len(seq_lens), max_q)
    query_positions = torch.where(grid < lens[:, None], grid, 0)
    q_index = None if min(seq_lens) == max_q else token_seq * max_q + positions  # equal lengths: identity
    return ForwardContext(
        positions=positions.to(device),
        q_index=None if q_index is None else q_index.to(device),
        query_positions=query_positions.to(device),
        taps=taps or {},
    )
