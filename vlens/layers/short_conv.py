"""LFM2's gated short convolution: one projection gives B, C and x (HF's names), B * x is convolved causally over a
few rows (each sequence's last inputs kept between its forwards: vlens.layers.causal_conv), C gates the result, and
an output projection maps it back. Its taps, under `blocks.L.conv.`: hook_b, hook_c, hook_x, hook_conv_out (the
convolution's output) and hook_z (C times it: the output projection's input, as an attention layer's attn.hook_z is),
each [d_model]. Under tensor parallelism each rank holds its share of the channels: their rows of B, C and x, of the
convolution and of its kept inputs, and out_proj's matching columns (summed over the ranks)."""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.context import get_context, tap
from vlens.layers.causal_conv import CausalConv
from vlens.layers.checkpoint import Slot, checkpoint_slots
from vlens.layers.linear import FusedLinear, RowLinear


class GatedShortConv(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        d, parallel = cfg.hidden_size, cfg.parallel
        self.channels = parallel.units(d)  # this rank's
        self.in_proj = FusedLinear(d, {"b": d, "c": d, "x": d}, cfg.conv_bias, stored_fused=True, parallel=parallel)
        self.conv = CausalConv(len(self.channels), cfg.conv_kernel, cfg.conv_bias)
        self.out_proj = RowLinear(d, d, cfg.conv_bias, parallel)
        p = f"blocks.{layer}.conv."
        self.hook_b, self.hook_c, self.hook_x = p + "hook_b", p + "hook_c", p + "hook_x"
        self.hook_conv_out, self.hook_z = p + "hook_conv_out", p + "hook_z"

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        """The convolution's rows of this rank's channels (the projections read theirs themselves)."""
        mine = (slice(self.channels.start, self.channels.stop),)
        conv = {f"{path}.conv.{leaf}": Slot(p, source=mine) for leaf, p in self.conv.named_parameters()}
        return conv | checkpoint_slots(self.in_proj, f"{path}.in_proj") | checkpoint_slots(self.out_proj,
                                                                                             f"{path}.out_proj")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, c, x = self.in_proj.split(self.in_proj(h))
        b, c, x = tap(self.hook_b, b), tap(self.hook_c, c), tap(self.hook_x, x)
        y = tap(self.hook_conv_out, self.conv(b * x, get_context().attention))
        return self.out_proj(tap(self.hook_z, c * y))
