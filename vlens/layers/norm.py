"""The norms of the supported families, with HF's numerics.

RMSNorm normalises in float32. Llama-style models cast back and then scale; Gemma scales by
(1 + w) while still in float32 and casts last. In float32 the two orders agree; in bfloat16 they
round differently, so each family gets its own. LayerNorm (GPT-2, NeoX) is torch's, as in HF.
"""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset  # Gemma: the weight is stored as w with the scale 1 + w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The model's norm over `dim` features (default: the residual width)."""
    dim = cfg.hidden_size if dim is None else dim
    if cfg.norm == "layer":
        return nn.LayerNorm(dim, eps=cfg.norm_eps)
    return RMSNorm(dim, cfg.norm_eps, offset=cfg.norm == "rms_offset")
