"""Per-hook statistics for normalising activations later (mean vector, mean and max L2 norm).

Computed on the device, from the stored values (after the cast to the output dtype), in float64, in
blocks of `BLOCK` consecutive rows of a shard. A block's sum, norm sum and max norm are one piece; the
run's totals add the pieces in shard and block order. Blocks are cut by the shard, never by the forward
batches, so every reduction sees the same shapes and the same rows whatever the batch split, the backend
or the thread that folds them: the numbers do not depend on how the rows reached the device's memory.
The running sums live in the manifest, so a resumed run continues from exactly the numbers an
uninterrupted run had at that shard and ends with the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

BLOCK = 4096  # rows per block: a [BLOCK, d] float64 buffer per hook on the device (64 MiB at d = 2048)


@dataclass
class HookStats:
    """One hook's running totals over the shards committed so far."""

    rows: int
    total: torch.Tensor  # [d] float64 sum of rows (flattened per row)
    norm_total: float
    max_norm: float

    @classmethod
    def empty(cls, width: int) -> HookStats:
        return cls(0, torch.zeros(width, dtype=torch.float64), 0.0, 0.0)

    def fold(self, pieces: Pieces) -> None:
        """Add a shard's pieces, block by block, in order."""
        width = len(self.total)
        for piece, rows in zip(pieces.values, pieces.rows):
            self.total += piece[:width]
            self.norm_total += float(piece[width])
            self.max_norm = max(self.max_norm, float(piece[width + 1]))
            self.rows += rows

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


@dataclass
class Pieces:
    """A shard's statistics of one hook, a block a row: [blocks, d + 2] float64 (the block's sum of rows,
    then its sum of row norms and its largest norm), and the rows of each block."""

    values: torch.Tensor
    rows: list[int]


class ShardStats:
    """One hook's pieces of one shard, computed on the device as the shard's rows arrive, in any batches."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.block = torch.empty(BLOCK, width, dtype=torch.float64, device=device)  # rows of the open block
        self.filled = 0
        self.pieces: list[torch.Tensor] = []
        self.rows: list[int] = []

    def add(self, x: torch.Tensor) -> None:
        """Rows [n, ...] as stored (the output dtype), on the device; converted to float64 exactly."""
        flat = x.reshape(len(x), self.block.shape[1])
        start = 0
        while start < len(flat):
            take = min(BLOCK - self.filled, len(flat) - start)
            self.block[self.filled : self.filled + take].copy_(flat[start : start + take])
            self.filled += take
            start += take
            if self.filled == BLOCK:
                self._close()

    def _close(self) -> None:
        block = self.block[: self.filled]
        norms = torch.linalg.vector_norm(block, dim=1)
        self.pieces.append(torch.cat([block.sum(0), norms.sum().view(1), norms.max().view(1)]))
        self.rows.append(self.filled)
        self.filled = 0

    def finish(self) -> Pieces:
        """The shard's pieces, on the device (the last block may be short: its length is the shard's)."""
        if self.filled:
            self._close()
        width = self.block.shape[1]
        values = torch.stack(self.pieces) if self.pieces else self.block.new_empty(0, width + 2)
        return Pieces(values, self.rows)
