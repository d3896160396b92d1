"""`Capture`: what one request asks to record, validated when it is built (what needs the model is
checked when the request is bound to it, see bind.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlens.capture.positions import Positions

CAPTURE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_tensor(value: Any, field: str) -> torch.Tensor:
    """list / numpy / torch -> float32 CPU tensor, refusing non-numbers and NaN/inf."""
    try:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value, dtype=np.float32))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field}: expected numbers (list, numpy array or torch tensor): {e}") from e
    t = t.detach().to("cpu", torch.float32)
    if t.numel() == 0:
        raise ValueError(f"{field}: empty")
    if not torch.isfinite(t).all():
        raise ValueError(f"{field}: contains NaN or infinite values")
    return t


@dataclass
class Capture:
    """Taps to record for one request, at the rows chosen by `positions` (see vlens.capture.positions:
    "all" | "prompt" | "generated" | "last" | int | list of ints | slice, negative from the end). Rows
    come back in ascending position order; rows whose token is in `exclude_token_ids` are left out.

    Readouts run on the device, so only what they return is copied off it:
    `project=W` ([d, k], or a pair (W, bias [k])) returns x @ W (+ bias) per row (linear probes);
    `reduce="mean"` returns the mean over the selected rows as one row (after any projection);
    `logit_lens=k` returns, per row of a residual-stream tap, the top-k token ids and log-probabilities
    through the final norm and unembedding, in RequestOutput.logit_lens instead of activations.
    `heads=[h, ...]` keeps those heads (in that order) at the per-head taps: attn.hook_q/k/v/z and the
    attention scores and patterns (for hook_k/v of a model with fewer KV heads, those KV heads).
    """

    hooks: str | Sequence[str] = "blocks.*.hook_resid_post"
    positions: Any = "all"
    exclude_token_ids: Sequence[int] | None = None
    dtype: str | torch.dtype | None = None
    reduce: str = "none"
    project: Any = None
    logit_lens: int | None = None
    heads: Sequence[int] | None = None

    def __post_init__(self) -> None:
        self.hooks = [self.hooks] if isinstance(self.hooks, str) else list(self.hooks)
        if not self.hooks:
            raise ValueError("capture.hooks: empty; give at least one hook name or glob")
        self.positions = Positions.parse(self.positions, "capture.positions")
        if isinstance(self.dtype, str):
            if self.dtype not in CAPTURE_DTYPES:
                raise ValueError(f"capture.dtype: {self.dtype!r} is not one of {', '.join(CAPTURE_DTYPES)}")
            self.dtype = CAPTURE_DTYPES[self.dtype]
        self.exclude_token_ids = frozenset(self.exclude_token_ids or ())
        if self.reduce not in ("none", "mean"):
            raise ValueError(f"capture.reduce: {self.reduce!r} is not one of none, mean")
        if self.project is not None:
            weight, bias = self.project if isinstance(self.project, tuple) else (self.project, None)
            weight = to_tensor(weight, "capture.project")
            if weight.dim() != 2:
                raise ValueError(f"capture.project: expected a [d, k] matrix, got shape {tuple(weight.shape)}")
            if bias is not None:
                bias = to_tensor(bias, "capture.project bias")
                if bias.shape != (weight.shape[1],):
                    raise ValueError(f"capture.project bias: expected shape ({weight.shape[1]},), got {tuple(bias.shape)}")
            self.project = (weight, bias)
        if self.logit_lens is not None:
            if not isinstance(self.logit_lens, int) or isinstance(self.logit_lens, bool) or self.logit_lens < 1:
                raise ValueError(f"capture.logit_lens: expected an int >= 1 (top-k), got {self.logit_lens!r}")
            if self.project is not None or self.reduce != "none":
                raise ValueError("capture.logit_lens: cannot be combined with project or reduce")
        if self.heads is not None:
            self.heads = check_heads(self.heads, "capture.heads")


def check_heads(heads: Any, field: str) -> list[int]:
    """A non-empty list of distinct head indices (their range is checked against the model later)."""
    ok = isinstance(heads, Sequence) and not isinstance(heads, str) and len(heads) > 0
    if not ok or not all(isinstance(h, int) and not isinstance(h, bool) for h in heads):
        raise ValueError(f"{field}: expected a non-empty list of head indices (ints), got {heads!r}")
    if len(set(heads)) != len(heads):
        raise ValueError(f"{field}: {list(heads)!r} names a head more than once")
    return list(heads)
