"""Per-hook statistics for normalising activations later (mean vector, mean and max L2 norm).

Computed from the stored values (after the cast to the output dtype), in float64, shard by shard
in a fixed order of row blocks. The running sums live in the manifest, so a resumed run continues
from exactly the numbers an uninterrupted run had at that shard and ends with the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_BLOCK = 1 << 16  # rows converted to float64 at a time


@dataclass
class HookStats:
    rows: int
    total: torch.Tensor  # [d] float64 sum of rows (flattened per row)
    norm_total: float
    max_norm: float

    @classmethod
    def empty(cls, width: int) -> HookStats:
        return cls(0, torch.zeros(width, dtype=torch.float64), 0.0, 0.0)

    def add(self, x: torch.Tensor) -> None:
        flat = x.reshape(len(x), -1)
        for start in range(0, len(flat), _BLOCK):
            block = flat[start : start + _BLOCK].double()
            norms = block.norm(dim=1)
            self.total += block.sum(0)
            self.norm_total += norms.sum().item()
            self.max_norm = max(self.max_norm, norms.max().item())
        self.rows += len(flat)

    def to_json(self) -> dict[str, Any]:
        n = max(self.rows, 1)
        return {
            "rows": self.rows,
            "mean": (self.total / n).tolist(),
            "mean_norm": self.norm_total / n,
            "max_norm": self.max_norm,
            "sum": self.total.tolist(),
            "norm_sum": self.norm_total,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HookStats:
        return cls(data["rows"], torch.tensor(data["sum"], dtype=torch.float64), data["norm_sum"], data["max_norm"])

    @classmethod
    def pieces(cls, x: torch.Tensor) -> list[HookStats]:
        """The statistics of each row block that `add` would fold in, one by one.

        Folding these in order (`fold`), on another machine than the one that computed them, adds exactly
        the same float64 block sums in the same order as `add(x)` (a block's sum added to zeros is itself),
        so the result is bit-identical; merging whole-shard sums would round differently."""
        pieces = []
        for start in range(0, len(x), _BLOCK):
            piece = cls.empty(x[0].numel())
            piece.add(x[start : start + _BLOCK])
            pieces.append(piece)
        return pieces

    def fold(self, pieces: list[HookStats]) -> None:
        for piece in pieces:
            self.total += piece.total
            self.norm_total += piece.norm_total
            self.max_norm = max(self.max_norm, piece.max_norm)
            self.rows += piece.rows
