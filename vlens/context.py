"""Per-forward batch layout, set by whoever runs the model and read by the attention backend and taps.

The model files never see sequences, requests or the KV cache: they read this context. That is what
lets the engine's paged cache, the trace path and harvest share one model implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vlens.capture.runtime import Tap



@dataclass
class AttentionGroup:
    """Sequences whose queries share one [B, max_q] grid for one SDPA call; their tokens are the
    contiguous packed rows `rows`. Decodes (max_q = 1) and long prefills go in separate groups so
    that no grid is mostly padding."""

    rows: slice
    query_positions: torch.Tensor  # [B, max_q] position of each grid slot (0 in unused slots)
    q_index: torch.Tensor | None = None  # [rows] slot of each token in the flattened grid; None = identity
    key_slots: torch.Tensor | None = None  # [B, Lk] cache slot of key j of each sequence; None = no cache
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)  # window -> mask (see add_masks)

    @property
    def batch(self) -> int:
        return self.query_positions.shape[0]

    @property
    def max_q(self) -> int:
        return self.query_positions.shape[1]

    def add_masks(self, windows: set[int | None]) -> AttentionGroup:
        """Build the boolean [B, 1, max_q, Lk] mask of each window size the model's layers use, before
        the forward (None: plain causal, SDPA's is_causal), so the forward only reads them.

        Key j of a sequence sits at position j (the cache holds a sequence from position 0), so query
        position p may see keys p - window < j <= p, as in HF's sliding-window mask."""
        for window in windows:
            if self.key_slots is None and window is None:
                self.masks[window] = None  # keys are the queries themselves, from position 0: is_causal
                continue
            num_keys = self.max_q if self.key_slots is None else self.key_slots.shape[1]
            key_pos = torch.arange(num_keys, device=self.query_positions.device)
            q = self.query_positions[:, None, :, None]
            allowed = key_pos <= q
            if window is not None:
                allowed &= key_pos > q - window
            self.masks[window] = allowed
        return self


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [T] position of each packed token within its sequence
    groups: list[AttentionGroup]
    slot_mapping: torch.Tensor | None = None  # [T] cache slot each new key/value is written to
    taps: dict[str, Tap] = field(default_factory=dict)  # tap site -> what it does this step; empty = nothing
    sequence_ends: torch.Tensor | None = None  # [T] last position of each token's whole sequence so far

    def last_positions(self) -> torch.Tensor:
        """[T] the last position of each token's sequence: LongRoPE picks its factors by the length of
        the sequence (as HF does), not by what else is in the batch. The engine says it (a chunk of a
        prefill does not reach the end); a cache-less forward holds whole sequences."""
        if self.sequence_ends is not None:
            return self.sequence_ends
        out = torch.empty_like(self.positions)
        for g in self.groups:
            last = g.query_positions.max(dim=1).values  # unused grid slots hold 0, never the max
            n = g.rows.stop - g.rows.start
            grid_slot = torch.arange(n, device=last.device) if g.q_index is None else g.q_index
            out[g.rows] = last[grid_slot // g.max_q]
        return out


_context: ForwardContext | None = None


def set_context(ctx: ForwardContext | None) -> None:
    global _context
    _context = ctx


def get_context() -> ForwardContext:
    assert _context is not None, "the model runs only inside a ForwardContext (see vlens.context)"
    return _context


def grid_layout(starts: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Positions [T], grid positions [B, max_q] and grid index [T] (None when all lengths are equal)
    for sequences whose new tokens start at positions `starts` and number `lens` (CPU tensors)."""
    max_q = int(lens.max())
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
    offset = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[seq]
    grid = torch.arange(max_q).expand(len(lens), max_q)
    query_positions = torch.where(grid < lens[:, None], starts[:, None] + grid, 0)
    q_index = None if int(lens.min()) == max_q else seq * max_q + offset
    return starts[seq] + offset, query_positions, q_index


def packed_context(seq_lens: list[int], device: torch.device, windows: set[int | None]) -> ForwardContext:
    """Context for a cache-less forward of whole sequences packed back to back (trace, harvest)."""
    lens = torch.tensor(seq_lens, dtype=torch.long)
    positions, query_positions, q_index = grid_layout(torch.zeros_like(lens), lens)
    group = AttentionGroup(
        rows=slice(0, len(positions)),
        query_positions=query_positions.to(device),
        q_index=None if q_index is None else q_index.to(device),
    )
    return ForwardContext(positions=positions.to(device), groups=[group.add_masks(windows)])
