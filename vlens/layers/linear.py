"""Linear layers that know how their checkpoint stores them, and projections of one input fused
into one GEMM (q/k/v, gate/up): fewer, larger matmuls per layer.

Llama-style checkpoints keep the fused parts apart (q_proj, k_proj, ...): each part loads into its
row range. Phi-3, GPT-2 and GPT-NeoX store them fused; GPT-2 stores weights transposed (Conv1D) and
NeoX interleaves q/k/v per head, which `transforms` undo at load time so the forward stays plain.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from vlens.layers.checkpoint import Slot, Transform


class StoredLinear(nn.Linear):
    """nn.Linear whose checkpoint tensors need a transform per leaf ("weight", "bias") to load."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, transforms: Mapping[str, Transform] | None = None
    ):
        super().__init__(in_features, out_features, bias=bias)
        self.transforms = dict(transforms or {})

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        return {f"{path}.{leaf}": Slot(p, None, self.transforms.get(leaf)) for leaf, p in self.named_parameters()}


class FusedLinear(StoredLinear):
    """Several projections of one input as one GEMM; `split` cuts the output back into the parts.

    `stored_fused`: the checkpoint holds one tensor under this module's own name (Phi-3, GPT-2,
    NeoX); otherwise one tensor per part, named by the keys of `parts` next to this module."""

    def __init__(
        self,
        in_features: int,
        parts: dict[str, int],
        bias: bool,
        stored_fused: bool = False,
        transforms: Mapping[str, Transform] | None = None,
    ):
        super().__init__(in_features, sum(parts.values()), bias, transforms)
        self.parts = parts  # part name -> output rows, in order
        self.stored_fused = stored_fused

    def part_rows(self) -> dict[str, slice]:
        rows, start = {}, 0
        for name, size in self.parts.items():
            rows[name] = slice(start, start + size)
            start += size
        return rows

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        if self.stored_fused:
            return super().checkpoint_slots(path)
        parent = path.rpartition(".")[0]
        return {
            f"{parent}.{part}.{leaf}": Slot(p, rows, self.transforms.get(leaf))
            for part, rows in self.part_rows().items()
            for leaf, p in self.named_parameters()
        }

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(list(self.parts.values()), dim=-1)
