"""Per-forward batch layout, set by whoever runs the model and read by the attention layers and taps.

The model files never see sequences, requests or the KV cache: they read this context. That is what
lets the engine's paged cache, the trace path and harvest share one model implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vlens.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from vlens.capture.runtime import Tap


@dataclass
class ForwardContext:
    attention: AttentionMetadata  # the packed layout: positions, sequences, cache slots
    backend: Any  # the attention backend (vlens.attention) ...
    backend_state: Any  # ... and what it planned for this forward
    taps: dict[str, Tap] = field(default_factory=dict)  # tap site -> what it does this step; empty = nothing

    @property
    def positions(self) -> torch.Tensor:
        return self.attention.positions


_context: ForwardContext | None = None


def set_context(ctx: ForwardContext | None) -> None:
    global _context
    _context = ctx


def get_context() -> ForwardContext:
    assert _context is not None, "the model runs only inside a ForwardContext (see vlens.context)"
    return _context
