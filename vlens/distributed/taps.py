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
keeps its slice, so a function that edits stays one edit of one model. When it raises, the flag rank 0
sends anyway says so, and every rank leaves the forward there (`HookFailed`): no collective is left
waiting, the group stays usable, and rank 0 raises the function's own exception, as one process does.
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
    _, layer, site = tap.split(".", 2)
    kv_heads = cfg.kv_heads_at(int(layer))
    return {
        "attn.hook_q": cfg.num_heads,
        "attn.hook_z": cfg.num_heads,
        "attn.hook_attn_scores": cfg.num_heads,
        "attn.hook_pattern": cfg.num_heads,
        "attn.hook_k": kv_heads,
        "attn.hook_v": kv_heads,
        "attn.hook_result": cfg.num_heads,  # (TransformerLens's optional per-head hooks)
        "hook_attn_in": cfg.num_heads,
        "hook_q_input": cfg.num_heads,
        "hook_k_input": kv_heads,
        "hook_v_input": kv_heads,
        "attn.hook_gate": cfg.num_heads,
        "mlp.hook_post": cfg.intermediate_size_at(int(layer)),
        "mlp.shared_expert.hook_post": cfg.shared_expert_intermediate_size,
        **{f"conv.hook_{name}": cfg.hidden_size for name in ("b", "c", "x", "conv_out", "z")},  # (LFM2's channels)
        # (a Mamba 2 mixer's heads, and the groups of B and C they read; Mamba's channels, B and C whole)
        **{f"mamba.hook_{name}": cfg.ssm_inner or cfg.ssm_heads for name in ("x", "dt", "ssm_out", "gate", "z")},
        "mamba.hook_b": cfg.ssm_groups or None,
        "mamba.hook_c": cfg.ssm_groups or None,
        # (a linear-attention layer's key heads, and the value heads they serve)
        "linear_attn.hook_q": cfg.linear_key_heads,
        "linear_attn.hook_k": cfg.linear_key_heads,
        **{f"linear_attn.hook_{name}": cfg.linear_value_heads
           for name in ("v", "beta", "decay", "core_out", "gate", "z")},  # fmt: skip
    }.get(site)


def shard_taps(taps: dict, cfg: ModelConfig) -> dict:
    """The step's taps as this rank's model calls them: sharded sites wrapped (the dict itself in one process)."""
    if cfg.parallel.size == 1 or not taps:
        return taps
    out = {}
    for name, tap in taps.items():
        units = sharded_units(name, cfg)
        if name == LOGITS:  # rank 0's alone, after the last collective: a function there fails alone
            out[name] = tap if isinstance(tap, Tap) else _alone(tap)
        elif isinstance(tap, Tap):
            out[name] = tap if units is None else ShardedTap(tap, units, cfg.parallel)
        else:  # a Python function (rank 0), or a worker's stand-in for one
            out[name] = tap if isinstance(tap, RankZeroHook) else RankZeroHook(tap, units, cfg.parallel)
    return out


class HookFailed(Exception):
    """A Python function at a site raised on rank 0 (`error`; None on the other ranks), and every rank left the
    forward at that site together: the group is in step, and only the caller's call fails."""

    def __init__(self, error: BaseException | None):
        super().__init__("a hook function raised on rank 0")
        self.error = error


def _alone(fn):
    """`fn` where rank 0 alone runs (the logits): its exception as a `HookFailed`, the other ranks being done."""

    def call(x: torch.Tensor) -> torch.Tensor:
        try:
            return fn(x)
        except BaseException as e:  # noqa: BLE001 - an interrupt in it leaves the group in step too
            raise HookFailed(e) from None

    return call


KEPT, REPLACED, FAILED = 0, 1, 2  # what rank 0 says of its function's call (`RankZeroHook`)


class RankZeroHook:
    """`fn` (None on the other ranks) on the whole tensor at its site, on rank 0; its result on every rank.
    A function that returns its input (harvest's row takers) costs one flag sent; one that edits returns a
    new tensor (HookedLM's hooks do), which is sent whole: an edit made in place and returned as the same
    tensor would stay on rank 0. One that raises, or returns what the other ranks cannot receive in place of
    the input, costs the flag too, and every rank raises `HookFailed`."""

    def __init__(self, fn, units: int | None, parallel: Parallel):
        self.fn, self.parallel = fn, parallel
        self.mine, self.owners = (parallel.units(units), parallel.owners(units)) if units else (None, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        whole = x if self.mine is None else all_gather(x, ShardedTap.DIM, self.parallel, self.owners)
        out, error = whole, None
        if self.fn is not None:
            try:
                out = _receivable(self.fn(whole), whole)
            except BaseException as e:  # noqa: BLE001 - raised below, once every rank knows
                out, error = whole, e
        said = FAILED if error is not None else REPLACED if out is not whole else KEPT
        said = broadcast(torch.tensor([said], device=x.device), self.parallel).item()
        if said == FAILED:
            raise HookFailed(error)
        if said == KEPT:  # read only (a capture): every rank keeps what it had
            return x
        out = broadcast(out.contiguous() if self.fn is not None else torch.empty_like(whole), self.parallel)
        return out if self.mine is None else out.narrow(ShardedTap.DIM, self.mine.start, len(self.mine)).contiguous()


def _receivable(out: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`out`, when the other ranks can receive it into a tensor like `whole` (else a broadcast would not pair)."""
    if out is not whole and (out.shape != whole.shape or out.dtype != whole.dtype or out.device != whole.device):
        raise ValueError(
            f"a hook function returned a {out.dtype} tensor of shape {tuple(out.shape)} on {out.device}; under "
            f"tensor parallelism it must be like its input: {whole.dtype}, {tuple(whole.shape)}, on {whole.device}"
        )
    return out


class ShardedTap:
    DIM = 1  # the split dimension of [rows, units, ...]

    def __init__(self, tap, units: int, parallel: Parallel):
        self.tap, self.parallel = tap, parallel
        self.mine, self.owners = parallel.units(units), parallel.owners(units)

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather(x, self.DIM, self.parallel, self.owners)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        tap = self.tap
        if tap.edit_rows is not None or tap.feeds:
            edited = tap(self._whole(x))  # edits, clamps' latents, the capture: on the whole rows as in one process
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
