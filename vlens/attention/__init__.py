"""Attention backends, behind one seam: the engine (or trace) builds an `AttentionMetadata` once per
forward, the backend plans from it once (`prepare`), and every attention layer calls
`backend.forward(q, k, v, layer, state)` with its own kind (heads, window, scale, soft-cap).

- `sdpa`: PyTorch's scaled_dot_product_attention over per-group grids; the exact reference, and the
  CPU default.
- `flex`: FlexAttention over the paged cache with a block mask from the block tables; compiled unless
  the engine runs eagerly. Runs on CPU and CUDA.
- `flashinfer`: FlashInfer's paged kernels; CUDA only, `pip install 'vlens[cuda]'`. The default on
  CUDA when it imports.
"""

from __future__ import annotations

import importlib.util

import torch

from vlens.attention.metadata import AttentionMetadata, LayerKind, layout

BACKENDS = ("auto", "sdpa", "flex", "flashinfer")

__all__ = ["AttentionMetadata", "BACKENDS", "LayerKind", "available_backends", "layout", "make_backend"]


def available_backends(device: torch.device) -> list[str]:
    names = ["sdpa", "flex"]
    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        names.append("flashinfer")
    return names


def check_backend(name: str, device: torch.device) -> str:
    """The backend `name` means on `device` ("auto": FlashInfer on CUDA when installed, else SDPA); a
    ValueError naming the choices available here when it cannot run."""
    here = available_backends(device)
    if name == "auto":
        return "flashinfer" if "flashinfer" in here else "sdpa"
    if name not in here:
        why = "needs CUDA and `pip install 'vlens[cuda]'`" if name == "flashinfer" else f"is not one of {', '.join(BACKENDS)}"
        raise ValueError(
            f"attention_backend: {name!r} {why}; available on this {device.type} machine: auto, {', '.join(here)}"
        )
    return name


def make_backend(name: str, device: torch.device, compiled: bool):
    name = check_backend(name, device)
    if name == "flex":
        from vlens.attention.flex import FlexBackend

        return FlexBackend(compiled)
    if name == "flashinfer":
        from vlens.attention.flashinfer import FlashInferBackend

        return FlashInferBackend(device)
    from vlens.attention.sdpa import SdpaBackend

    return SdpaBackend()
