"""Elementwise chains that run between the GEMMs of every layer — RMSNorm, act(gate) * up, rotary (by halves or,
GPT-J's, by pairs) — as
one kernel each on CUDA.

Each is written once here as plain torch ops, which is what runs everywhere by default. A runner that
replays CUDA graphs, or a harvest's on CUDA (large prefills, where a chain's dynamo call costs little beside its
kernel), compiles them once a process (`fuse`, on CUDA only: `torch.compile(fn, dynamic=True)`, one Triton kernel
instead of 3-8 launches, so a graph has fewer nodes to launch and the GPU fewer passes over the activations) and its
forwards say so in their context (`vlens.context.fusing`); every other forward — another engine with
`enforce_eager`, trace on the CPU — runs the plain ops. A chain that fails to
compile stays eager. Each compiled chain keeps a few variants (dtype, a batch of one, the strides of
q and k), so dynamo's recompile limit is raised to hold them rather than fall back to eager silently (an
H200 profile showed that fallback: 765 device ops a graph step, 290 once they held). Casts are kept where
the eager code has them (`emulate_precision_casts`), so bfloat16 rounds as HF does; float32 sums may
differ in order (the GPU suite checks every tap against HF with them fused).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from vlens.context import fusing

log = logging.getLogger("vlens.engine")
RECOMPILE_LIMIT = 64


class Fusable:
    def __init__(self, fn: Callable):
        self.eager = fn
        self.compiled: Callable | None = None

    def __call__(self, *args):
        return (self.compiled if self.compiled is not None and fusing() else self.eager)(*args)

    def fuse(self, *example) -> bool:
        if self.compiled is None:
            try:
                compiled = torch.compile(self.eager, dynamic=True)
                with torch.inference_mode():  # as the forwards run: no recompile for grad mode
                    compiled(*example)
                self.compiled = compiled
            except Exception as e:  # noqa: BLE001 - a chain inductor cannot build runs as it did
                log.warning("%s stays unfused: %s", self.eager.__name__, e)
        return self.compiled is not None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, kind: str) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, then scale as `kind` says (`scaled`)."""
    h = x.float()
    return scaled(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), weight, kind, x.dtype)


def scaled(h: torch.Tensor, weight: torch.Tensor | None, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """A normalised float32 `h` times an RMSNorm's weight, in `dtype`: "rms" (Llama) casts back then scales,
    "rms_float" (OLMo 2) scales by w in float32 and casts last, "rms_offset" (Gemma) the same with 1 + w;
    "rms_unweighted" (nanochat: no weight) casts back alone."""
    if weight is None:
        return h.to(dtype)
    if kind == "rms":
        return weight * h.to(dtype)
    return (h * (1.0 + weight.float() if kind == "rms_offset" else weight.float())).to(dtype)


def _gated(act: Callable, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's leading cos.shape[-1] dims by the half-split rotary (HF's rotate_half)."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
    return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's leading cos.shape[-1] dims pair by pair, (2i, 2i + 1) by angle i (GPT-J's
    rotate_every_two; cos and sin hold each angle twice, side by side)."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    pairs = rot.unflatten(-1, (-1, 2))
    rotated = rot * cos + torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2) * sin
    return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)


rms_norm, gated = Fusable(_rms_norm), Fusable(_gated)
rotate, rotate_pairs = Fusable(_rotate), Fusable(_rotate_pairs)


def fuse(device: torch.device, dtype: torch.dtype, act: Callable) -> bool:
    """Compile the chains for the runs on `device` (CUDA); a trial call on small tensors compiles each.
    Whether any chain compiled (the runner's forwards then ask for them)."""
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor

    inductor.emulate_precision_casts = True
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    x = torch.randn(3, 64, device=device, dtype=dtype)
    heads = torch.randn(3, 2, 64, device=device, dtype=dtype)
    angles = torch.randn(3, 1, 64, device=device, dtype=dtype)
    done = [
        rms_norm.fuse(x, torch.ones(64, device=device, dtype=dtype), 1e-6, "rms"), gated.fuse(act, x, x),
        rotate.fuse(heads, angles, angles), rotate_pairs.fuse(heads, angles, angles),
    ]  # fmt: skip
    return any(done)
