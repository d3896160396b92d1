"""Projections of one input fused into one GEMM (q/k/v, gate/up): fewer, larger matmuls per layer.

Checkpoints keep the parts apart (HF's q_proj, k_proj, ...); each part loads into its row range.
"""

from __future__ import annotations

import torch
from torch import nn


class FusedLinear(nn.Linear):
    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts  # checkpoint module name -> output rows, in order

    def part_rows(self) -> dict[str, slice]:
        rows, start = {}, 0
        for name, size in self.parts.items():
            rows[name] = slice(start, start + size)
            start += size
        return rows

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(list(self.parts.values()), dim=-1)
