"""Attention backends, behind one seam: the engine (or trace) builds an `AttentionMetadata` once per
forward, the backend plans from it once (`prepare`), and every attention layer calls
`backend.forward(q, k, v, layer, state)` with its own kind (heads, window, scale, soft-cap).

- `sdpa`: PyTorch's scaled_dot_product_attention over per-group grids; the exact reference, and the
  CPU default. On CUDA it never runs cuDNN's kernel (a plan per shape).
- `varlen`: Flash Attention's variable-length kernel (`torch.nn.attention.varlen`), reading the paged
  cache in place where the installed torch takes block tables; CUDA, float16/bfloat16, no soft-cap.
- `flex`: FlexAttention over the step's own keys with a block mask from the packed layout; compiled
  unless the engine runs eagerly. Runs on CPU and CUDA.
- `flashinfer`: FlashInfer's paged kernels; CUDA only, `pip install 'vlens[cuda]'`.

`auto` is chosen by `choose`.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from vlens.attention.flashinfer import problem as flashinfer_problem
from vlens.attention.metadata import AttentionMetadata, LayerKind, layout
from vlens.attention.varlen import PAGE_MULTIPLE, takes_pages, varlen_function
from vlens.attention.varlen import problem as varlen_problem

BACKENDS = ("auto", "sdpa", "varlen", "flex", "flashinfer")

__all__ = ["AttentionMetadata", "BACKENDS", "LayerKind", "available_backends", "check_backend", "choose", "layout",
           "make_backend"]  # fmt: skip

log = logging.getLogger("vlens.engine")


def available_backends(device: torch.device) -> list[str]:
    names = ["sdpa", "flex"]
    if device.type == "cuda" and varlen_function() is not None:
        names.append("varlen")
    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        names.append("flashinfer")
    return names


def check_backend(name: str, device: torch.device) -> str:
    """`name` when it can run on `device` (and with this torch), before any model is loaded; a ValueError
    naming the choices available here when it cannot. "auto" is resolved by `choose`, with the model."""
    here = available_backends(device)
    if name != "auto" and name not in here:
        if name == "flashinfer":
            why = "needs CUDA and `pip install 'vlens[cuda]'`"
        elif name == "varlen":
            why = "needs CUDA and a torch with torch.nn.attention.varlen.varlen_attn"
        else:
            why = f"is not one of {', '.join(BACKENDS)}"
        raise ValueError(
            f"attention_backend: {name!r} {why}; available on this {device.type} machine: auto, {', '.join(here)}"
        )
    return name


def choose(device: torch.device, kinds: set[LayerKind], dtype: torch.dtype, block_size: int) -> tuple[str, str]:
    """What "auto" means for this model on `device`, and why: the fastest backend that is exact there.

    - CPU: sdpa. FlexAttention is exact too, but slow uncompiled and a compile per padded size; varlen and
      FlashInfer do not run there.
    - CUDA at float32 (exactness runs): sdpa without cuDNN (the memory-efficient kernel; 1.1e-6 of HF on an
      H200); Flash Attention and FlashInfer take only float16/bfloat16.
    - CUDA at float16/bfloat16: FlashInfer when installed (paged kernels, planned once per step); else varlen
      when it reads the cache in place (a torch whose varlen_attn takes block tables, blocks of a multiple of
      256 slots, layers Flash Attention can run): no key gather, no grid, no mask; else sdpa without cuDNN.
      Measured on an H200 (torch 2.11, no paged varlen; Llama-3.2-1B shape, eager decode steps): varlen
      over gathered keys and sdpa were alike (13-18 ms a step at batch 1 and 64 either way, within the run's
      noise; 42 vs 48 us of host time a call), as close to a float32 reference as each other, so without
      paging there is no reason to leave the reference kernel.
    """
    if not kinds:
        return "sdpa", "no layer attends (a Mamba): no attention kernel runs"
    if device.type != "cuda":
        return "sdpa", "the exact reference; the other kernels are CUDA-only or compile per shape"
    if dtype == torch.float32:
        return "sdpa", "float32: Flash Attention and FlashInfer take only float16/bfloat16"
    here = available_backends(device)
    if "flashinfer" in here and flashinfer_problem(kinds, dtype) is None:
        return "flashinfer", "installed; paged kernels planned once per step"
    if "varlen" not in here:
        return "sdpa", "this torch has no varlen_attn"
    why_not = varlen_problem(kinds, dtype)
    if why_not is not None:
        return "sdpa", f"varlen {why_not}"
    if not takes_pages(varlen_function()):
        return "sdpa", "this torch's varlen_attn takes no block tables (it would gather keys, as sdpa does)"
    if block_size % PAGE_MULTIPLE:
        return "sdpa", f"varlen reads a paged cache in blocks of a multiple of {PAGE_MULTIPLE} slots, not {block_size}"
    return "varlen", "Flash Attention reading the paged cache in place, one call per layer"


def make_backend(
    name: str, device: torch.device, compiled: bool, kinds: set[LayerKind], dtype: torch.dtype, block_size: int
):
    """The backend `name` means for a model with these layer kinds at `dtype` on `device`, over a cache of
    `block_size`-slot blocks ("auto": `choose`'s, logged); a ValueError when a named one cannot run this model
    (varlen, FlashInfer: at float32), rather than a kernel's error at the first step."""
    name = check_backend(name, device)
    if name == "auto":
        name, why = choose(device, kinds, dtype, block_size)
        log.info("attention backend: %s (auto on %s: %s)", name, device.type, why)
    if name == "varlen":
        from vlens.attention.varlen import VarlenBackend

        why_not = varlen_problem(kinds, dtype)
        if why_not is not None:
            raise ValueError(f"attention_backend: 'varlen' {why_not}; use sdpa")
        return VarlenBackend()
    if name == "flex":
        from vlens.attention.flex import FlexBackend

        if any(kind.alibi for kind in kinds):
            raise ValueError("attention_backend: 'flex' (as vlens builds its scores) adds no ALiBi biases, which this "
                             "model's layers have; use sdpa")  # fmt: skip

        return FlexBackend(compiled)
    if name == "flashinfer":
        from vlens.attention.flashinfer import FlashInferBackend

        why_not = flashinfer_problem(kinds, dtype)
        if why_not is not None:
            raise ValueError(f"attention_backend: 'flashinfer' {why_not}; use sdpa")
        return FlashInferBackend(device)
    from vlens.attention.sdpa import SdpaBackend

    return SdpaBackend()
