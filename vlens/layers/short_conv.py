"""LFM2's gated short convolution: one projection gives B, C and x (HF's names), B * x is convolved causally over a
few rows (each sequence's last inputs kept between its forwards: vlens.layers.causal_conv), C gates the result, and
an output projection maps it back. Its taps, under `blocks.L.conv.`: hook_b, hook_c, hook_x, hook_conv_out (the
convolution's output) and hook_z (C times it: the output projection's input, as an attention layer's attn.hook_z is),
each [d_model]."""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.context import get_context, tap
from vlens.layers.causal_conv import CausalConv


class GatedShortConv(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        d = cfg.hidden_size
        self.in_proj = nn.Linear(d, 3 * d, bias=cfg.conv_bias)
        self.conv = CausalConv(d, cfg.conv_kernel, cfg.conv_bias)
        self.out_proj = nn.Linear(d, d, bias=cfg.conv_bias)
        p = f"blocks.{layer}.conv."
        self.hook_b, self.hook_c, self.hook_x = p + "hook_b", p + "hook_c", p + "hook_x"
        self.hook_conv_out, self.hook_z = p + "hook_conv_out", p + "hook_z"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, c, x = self.in_proj(h).chunk(3, -1)
        b, c, x = tap(self.hook_b, b), tap(self.hook_c, c), tap(self.hook_x, x)
        y = tap(self.hook_conv_out, self.conv(b * x, get_context().attention))
        return self.out_proj(tap(self.hook_z, c * y))
