"""The per-forward state the model reads: the batch layout its attention and rotary need, the attention
backend, and the taps of this forward. Set by the runner (vlens.engine.model_runner) around every forward.

The model files never see sequences, requests, the KV cache or the capture package: they read this
context, and a tap site is one line, `x = tap(self.hook_resid_post, x)`. That is what lets the engine's
paged steps, trace, harvest and a replayed CUDA graph share one model implementation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vlens.attention.metadata import AttentionMetadata


class Tap(Protocol):
    """What a tap site calls (vlens.capture.runtime implements it): edits and/or gathers rows of `x` by
    index tensors armed before the forward, returning `x` itself when it only gathers."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def attend(self, q: torch.Tensor, keys: torch.Tensor, layer: Any) -> None:
        """Attention scores or patterns of the gathered query rows over their keys."""


@dataclass
class ForwardContext:
    attention: AttentionMetadata  # the packed layout: positions, sequences, cache slots
    backend: Any  # the attention backend (vlens.attention) ...
    backend_state: Any  # ... and what it planned for this forward
    taps: Mapping[str, Tap] = field(default_factory=dict)  # tap site -> its work this forward; empty = nothing
    fused: bool = False  # run vlens.layers.fused's compiled chains (the runner's choice: CUDA graphs on)
    # rows of this forward whose embedding is given, not looked up (an image's: vlens.images), those embeddings, and
    # (Qwen3-VL's deepstack) what those rows add after each of the first layers [layers, rows, d]
    embeds: tuple[torch.Tensor, ...] | None = None
    # Gemma 4 E2B/E4B, filled as the forward goes: the keys and values a layer leaves for the later layers that
    # attend to them (by layer), and each layer's own input from the per-layer embeddings [T, layers, size]
    shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    per_layer_inputs: torch.Tensor | None = None
    # which LoRA adapter each row's request runs under (vlens.layers.lora): [T, max_loras] one-hot rows, all zero
    # for a request without one; None: no request of this forward has one
    lora: torch.Tensor | None = None

    @property
    def positions(self) -> torch.Tensor:
        return self.attention.positions


_context: ForwardContext | None = None
_taps: Mapping[str, Tap] = {}
_fused = False
_lora: torch.Tensor | None = None


def set_context(ctx: ForwardContext | None) -> None:
    global _context, _taps, _fused, _lora
    _context, _taps, _fused = ctx, ({} if ctx is None else ctx.taps), ctx is not None and ctx.fused
    _lora = None if ctx is None else ctx.lora


def get_context() -> ForwardContext:
    assert _context is not None, "the model runs only inside a ForwardContext (see vlens.context)"
    return _context


def tap(name: str, x: torch.Tensor) -> torch.Tensor:
    """`x` as the forward's tap at site `name` leaves it; `x` itself when no request uses the site."""
    t = _taps.get(name)
    return x if t is None else t(x)


def tap_widened(name: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x`, kept in a wider dtype than the model's (HF's float32 decays and scans), as the tap at `name` leaves it: the
    tap sees it in `dtype`, as every tap's rows are of the model's dtype; `x` itself unless an edit gives another
    value, which is carried on in x's dtype."""
    t = _taps.get(name)
    if t is None:
        return x
    rounded = x.to(dtype)
    edited = t(rounded)
    return x if edited is rounded else edited.to(x.dtype)


def tapped(name: str) -> bool:
    """Whether some request uses site `name` in this forward (for taps whose value costs work to make)."""
    return name in _taps


def lora_rows() -> torch.Tensor | None:
    """ForwardContext.lora of the forward running (None outside one)."""
    return _lora


def fusing() -> bool:
    """Whether this forward runs the compiled elementwise chains (vlens.layers.fused)."""
    return _fused


def attention_tap(name: str) -> Tap | None:
    """The forward's tap at an attention-score or pattern site, which reads queries and keys, not one tensor."""
    return _taps.get(name)
