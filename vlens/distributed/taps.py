"""Hooks on sharded activations, read and edited as the whole ones (vlens.distributed).

Under tensor parallelism a rank holds some heads of q, k, v, z, the attention scores and patterns,
and some columns of the MLP's hidden layer; every other hook site (the residual stream, norms,
attention and MLP outputs after their all-reduce) holds the same tensor on every rank, and its `Tap`
runs unchanged on each; the logits are whole on rank 0 alone (the LM head gathers them there), where
their taps and hooks run as in one process. At a sharded site the model calls a
`ShardedTap` instead, which gives the user the unsharded tensor, equal to the one-process value:

- a capture gathers from the ranks only the rows asked for (index_select first, then all_gather),
  keeping one copy of a KV head that several ranks share;
- an edit (Steer, Ablate, Patch, Clamp, per-head or whole) gathers the whole rows, applies the very
  `Tap` of one process to them, identically on every rank, and keeps this rank's slice: an ablation's
  projection or an SAE clamp sees the full row, and a per-head steer lands on the rank holding the head;
- an attention-pattern tap computes this rank's heads and gathers them.

A Python function at a site (`HookedLM.run_with_hooks`, harvest's row takers) runs on rank 0 alone, on
the whole tensor (`RankZeroHook`); when it returns another tensor, rank 0 sends it to every rank, which
keeps its slice, so a function that edits stays one edit of one model.
"""

from __future__ import annotations

import torch

from vlens.capture.names import LOGITS
from vlens.capture.runtime import Tap
from vlens.config import ModelConfig
from vlens.distributed.parallel import Parallel, all_gather, broadcast


def sharded_units(tap: str, cfg: ModelConfig) -> int | None:
    """How many units (heads, MLP columns) the first per-token dimension of `tap` is split in; None for
    a tap every rank holds whole."""
    if not tap.startswith("blocks."):
        return None
    site = tap.split(".", 2)[2]
    return {
        "attn.hook_q": cfg.num_heads,
        "attn.hook_z": cfg.num_heads,
        "attn.hook_attn_scores": cfg.num_heads,
        "attn.hook_pattern": cfg.num_heads,
        "attn.hook_k": cfg.num_kv_heads,
        "attn.hook_v": cfg.num_kv_heads,
        "mlp.hook_post": cfg.intermediate_size,
        "mlp.shared_expert.hook_post": cfg.shared_expert_intermediate_size,
    }.get(site)


def shard_taps(taps: dict, cfg: ModelConfig) -> dict:
    """The step's taps as this rank's model calls them: sharded sites wrapped (the dict itself in one process)."""
    if cfg.parallel.size == 1 or not taps:
        return taps
    out = {}
    for name, tap in taps.items():
        units = sharded_units(name, cfg)
        if name == LOGITS:  # rank 0's alone
            out[name] = tap
        elif isinstance(tap, Tap):
            out[name] = tap if units is None else ShardedTap(tap, units, cfg.parallel)
        else:  # a Python function (rank 0), or a worker's stand-in for one
            out[name] = tap if isinstance(tap, RankZeroHook) else RankZeroHook(tap, units, cfg.parallel)
    return out


class RankZeroHook:
    """`fn` (None on the other ranks) on the whole tensor at its site, on rank 0; its result on every rank.
    A function that returns its input (harvest's row takers) costs one flag sent; one that edits returns a
    new tensor (HookedLM's hooks do), which is sent whole: an edit made in place and returned as the same
    tensor would stay on rank 0."""

    def __init__(self, fn, units: int | None, parallel: Parallel):
        self.fn, self.parallel = fn, parallel
        self.mine, self.owners = (parallel.units(units), parallel.owners(units)) if units else (None, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        whole = x if self.mine is None else all_gather(x, ShardedTap.DIM, self.parallel, self.owners)
        out = whole if self.fn is None else self.fn(whole)
        changed = broadcast(torch.tensor([out is not whole], device=x.device), self.parallel)
        if not changed.item():  # read only (a capture): every rank keeps what it had
            return x
        out = broadcast(out.contiguous() if self.fn is not None else torch.empty_like(whole), self.parallel)
        return out if self.mine is None else out.narrow(ShardedTap.DIM, self.mine.start, len(self.mine)).contiguous()


class ShardedTap:
    DIM = 1  # the split dimension of [rows, units, ...]

    def __init__(self, tap, units: int, parallel: Parallel):
        self.tap, self.parallel = tap, parallel
        self.mine, self.owners = parallel.units(units), parallel.owners(units)

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather(x, self.DIM, self.parallel, self.owners)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        tap = self.tap
        if tap.edit_rows is not None:
            edited = tap(self._whole(x))  # edits, then the capture, on the whole rows as in one process
            return edited.narrow(self.DIM, self.mine.start, len(self.mine)).contiguous()
        if tap.gather_index is not None:
            tap.gather_out.copy_(self._whole(x.index_select(0, tap.gather_index)))
        return x

    def attend(self, q: torch.Tensor, keys: torch.Tensor, attn) -> None:
        """This rank's heads' scores (or pattern) of the gathered rows, then all heads joined."""
        tap = self.tap
        whole = tap.gather_out
        shape = list(whole.shape)
        shape[self.DIM] = attn.num_heads
        tap.gather_out = whole.new_empty(shape)
        try:
            tap.attend(q, keys, attn)
            mine = tap.gather_out
        finally:
            tap.gather_out = whole
        whole.copy_(self._whole(mine))
