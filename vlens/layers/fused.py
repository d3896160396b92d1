"""Elementwise chains that run between the GEMMs of every layer — RMSNorm, act(gate) * up, rotary — as
one kernel each on CUDA.

Each is written once here as plain torch ops, which is what runs everywhere by default. When the runner
replays CUDA graphs (`fuse`, on CUDA only), each becomes `torch.compile(fn, dynamic=True)`: one Triton
kernel instead of 3-8 launches, so a graph has fewer nodes to launch and the GPU fewer passes over the
activations. A chain that fails to compile stays eager. Casts are kept where the eager code has them
(`emulate_precision_casts`), so bfloat16 rounds as HF does; float32 sums may differ in order (the GPU
suite checks every tap against HF with them fused).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("vlens.engine")


class Fusable:
    def __init__(self, fn: Callable):
        self.eager = self.run = fn

    def __call__(self, *args):
        return self.run(*args)

    def fuse(self, *example) -> None:
        try:
            compiled = torch.compile(self.eager, dynamic=True)
            compiled(*example)
            self.run = compiled
        except Exception as e:  # noqa: BLE001 - a chain inductor cannot build runs as it did
            log.warning("%s stays unfused: %s", self.eager.__name__, e)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32; Llama-style casts back then scales, Gemma scales by (1 + w) in
    float32 and casts last."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(dtype) if offset else weight * h.to(dtype)


def _gated(act: Callable, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's leading cos.shape[-1] dims by the half-split rotary (HF's rotate_half)."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
    return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)


rms_norm, gated, rotate = Fusable(_rms_norm), Fusable(_gated), Fusable(_rotate)


def fuse(device: torch.device, dtype: torch.dtype, act: Callable) -> None:
    """Compile the chains for the runs on `device` (CUDA); a trial call on small tensors compiles each."""
    import torch._inductor.config as inductor

    inductor.emulate_precision_casts = True
    x = torch.randn(3, 64, device=device, dtype=dtype)
    rms_norm.fuse(x, torch.ones(64, device=device, dtype=dtype), 1e-6, False)
    gated.fuse(act, x, x)
    heads = torch.randn(3, 2, 64, device=device, dtype=dtype)
    rotate.fuse(heads, torch.randn(3, 1, 64, device=device, dtype=dtype), torch.randn(3, 1, 64, device=device, dtype=dtype))
