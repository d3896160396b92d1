"""Which part of the model this process holds, and the two collectives the sharded layers need.

`Parallel(rank, size)` travels in `ModelConfig.parallel`: the layers read it to build their shard
(Megatron's split: heads, MLP columns, vocabulary rows) and call `all_reduce` / `all_gather`, which are
nothing at all when `size` is 1, so the single-process forward runs exactly the code it always ran.

A collective whose peer has died raises `GroupError` naming the rank, never a bare transport error:
the process that started the workers registers what it knows about them (`on_failure`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


class GroupError(RuntimeError):
    """A rank of the tensor-parallel group is gone; the group cannot run another forward."""


@dataclass(frozen=True)
class Parallel:
    rank: int = 0
    size: int = 1

    def units(self, n: int) -> range:
        """This rank's share of `n` units (heads, KV heads, MLP columns): n / size consecutive ones,
        or, when there are fewer units than ranks (KV heads), the one unit it shares with size / n ranks."""
        if n % self.size == 0:
            k = n // self.size
            return range(self.rank * k, (self.rank + 1) * k)
        if self.size % n == 0:
            unit = self.rank // (self.size // n)
            return range(unit, unit + 1)
        raise ValueError(f"tensor_parallel_size: {self.size} neither divides nor is a multiple of {n}")

    def rows(self, n: int) -> tuple[range, int]:
        """Vocabulary rows: (this rank's rows of n, the rows every rank allocates), the last shard short."""
        k = -(-n // self.size)
        return range(min(self.rank * k, n), min((self.rank + 1) * k, n)), k

    def owners(self, n: int) -> list[int]:
        """One rank per distinct share of n units, in unit order: whose pieces make up the whole."""
        seen, owners = set(), []
        for rank in range(self.size):
            start = Parallel(rank, self.size).units(n).start
            if start not in seen:
                seen.add(start)
                owners.append(rank)
        return owners


SINGLE = Parallel()

_failure: list[Callable[[], str | None]] = []  # what the group knows about a dead peer


def on_failure(describe: Callable[[], str | None] | None) -> None:
    """Register (None: forget) what names the dead rank when a collective fails."""
    _failure.clear()
    if describe is not None:
        _failure.append(describe)


def _failed(error: Exception) -> GroupError:
    why = _failure[0]() if _failure else None
    return GroupError(f"tensor parallel group failed: {why or error}")


def all_reduce(x: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """Sum of `x` over the ranks, in place (row-parallel outputs, vocabulary-parallel embeddings)."""
    if parallel.size == 1:
        return x
    try:
        dist.all_reduce(x)
    except RuntimeError as e:
        raise _failed(e) from e
    return x


def broadcast(x: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """Rank 0's `x` on every rank (in place; `x` gives the shape and dtype elsewhere)."""
    if parallel.size == 1:
        return x
    try:
        dist.broadcast(x, src=0)
    except RuntimeError as e:
        raise _failed(e) from e
    return x


def gather_to_first(x: torch.Tensor, dim: int, parallel: Parallel) -> torch.Tensor:
    """On rank 0 the ranks' pieces of `x` joined along `dim`; elsewhere `x` itself, which nobody reads
    (the logits: rank 0 alone samples, so the other ranks receive nothing)."""
    if parallel.size == 1:
        return x
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(parallel.size)] if parallel.rank == 0 else None
    try:
        dist.gather(x, pieces, dst=0)
    except RuntimeError as e:
        raise _failed(e) from e
    return torch.cat(pieces, dim=dim) if pieces is not None else x


def all_gather(x: torch.Tensor, dim: int, parallel: Parallel, ranks: list[int] | None = None) -> torch.Tensor:
    """The ranks' pieces of `x` joined along `dim` (those of `ranks` only, where shares repeat)."""
    if parallel.size == 1:
        return x
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(parallel.size)]
    try:
        dist.all_gather(pieces, x)
    except RuntimeError as e:
        raise _failed(e) from e
    if ranks is not None:
        pieces = [pieces[r] for r in ranks]
    return torch.cat(pieces, dim=dim)
