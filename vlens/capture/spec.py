"""`Capture`: what one request asks to record, validated when it is built (what needs the model is
checked when the request is bound to it, see bind.py)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlens.capture.positions import Positions
from vlens.capture.tuned_lens import TunedLens
from vlens.sae.model import SAE

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
    through the final norm and unembedding, in RequestOutput.logit_lens instead of activations;
    `tuned_lens=TunedLens.load(path)` with it puts each row through its layer's translator first (a tuned lens,
    at a layer's input or output: vlens.capture.tuned_lens).
    `heads=[h, ...]` keeps those heads (in that order) at the per-head taps: attn.hook_q/k/v/z, the
    attention scores and patterns and TransformerLens's per-head optional hooks (attn.hook_result, the per-head
    inputs); for hook_k/v (hook_k/v_input) of a model with fewer KV heads, those KV heads.
    `sae=SAE` reads the rows through a sparse autoencoder at the hook it was trained on (`hooks` may
    then be left out), into RequestOutput.sae_features instead of activations: `top_k=k` the k largest
    latents per row as (ids int32, values), or `features=[...]` those latents [rows, n]; `sae_error=True`
    adds ‖x − x̂‖²/‖x‖² per row in RequestOutput.sae_errors (a transcoder's latents are read at its input hook,
    and its error is ‖y − ŷ‖²/‖y‖², y the model's rows at the hook it writes, gathered at the same positions).
    """

    hooks: str | Sequence[str] | None = None  # default: the SAE's hook, else "blocks.*.hook_resid_post"
    positions: Any = "all"
    exclude_token_ids: Sequence[int] | None = None
    dtype: str | torch.dtype | None = None
    reduce: str = "none"
    project: Any = None
    logit_lens: int | None = None
    tuned_lens: TunedLens | None = None
    heads: Sequence[int] | None = None
    sae: SAE | None = None
    top_k: int | None = None
    features: Sequence[int] | None = None
    sae_error: bool = False

    def __post_init__(self) -> None:
        self._check_sae()
        if self.hooks is None:
            self.hooks = self.sae.hook if self.sae is not None else "blocks.*.hook_resid_post"
        if self.hooks is None:
            raise ValueError("capture.hooks: required, since this SAE names no hook (load it with SAE.load(path, hook=...))")
        self.hooks = [self.hooks] if isinstance(self.hooks, str) else list(self.hooks)
        if not self.hooks:
            raise ValueError("capture.hooks: empty; give at least one hook name or glob")
        self.positions = Positions.parse(self.positions, "capture.positions")
        if self.dtype is not None:  # a name or a torch dtype, of the three a row may be cast to
            dtype = CAPTURE_DTYPES.get(self.dtype) if isinstance(self.dtype, str) else self.dtype
            if dtype not in CAPTURE_DTYPES.values():
                raise ValueError(f"capture.dtype: {self.dtype!r} is not one of {', '.join(CAPTURE_DTYPES)}")
            self.dtype = dtype
        excluded = () if self.exclude_token_ids is None else self.exclude_token_ids
        self.exclude_token_ids = check_token_ids(excluded, "capture.exclude_token_ids")
        if self.reduce not in ("none", "mean"):
            raise ValueError(f"capture.reduce: {self.reduce!r} is not one of none, mean")
        if self.project is not None:
            weight, bias = self.project if isinstance(self.project, tuple) else (self.project, None)
            weight = to_tensor(weight, "capture.project")
            if weight.dim() != 2:
                raise ValueError(f"capture.project: expected a [d, k] matrix, got shape {tuple(weight.shape)}")
            if bias is not None:
                bias = to_tensor(bias, "capture.project_bias")
                if bias.shape != (weight.shape[1],):
                    raise ValueError(f"capture.project_bias: expected shape ({weight.shape[1]},), got {tuple(bias.shape)}")
            self.project = (weight, bias)
        if self.logit_lens is not None:
            if not isinstance(self.logit_lens, int) or isinstance(self.logit_lens, bool) or self.logit_lens < 1:
                raise ValueError(f"capture.logit_lens: expected an int >= 1 (top-k), got {self.logit_lens!r}")
            if self.project is not None or self.reduce != "none":
                raise ValueError("capture.logit_lens: cannot be combined with project or reduce")
        if self.tuned_lens is not None:
            if not isinstance(self.tuned_lens, TunedLens):
                raise ValueError(f"capture.tuned_lens: expected a vlens.TunedLens (TunedLens.load(path)), got "
                                 f"{type(self.tuned_lens).__name__}")  # fmt: skip
            if self.logit_lens is None:
                raise ValueError("capture.tuned_lens: with logit_lens=k, the top-k tokens it reads each row as")
        if self.heads is not None:
            self.heads = check_heads(self.heads, "capture.heads")

    def _check_sae(self) -> None:
        """An SAE readout: what to return, within the SAE's width; nothing another readout would change."""
        if self.sae is None:
            given = [name for name in ("top_k", "features") if getattr(self, name) is not None]
            if given or self.sae_error:
                raise ValueError(f"capture.{(given or ['sae_error'])[0]}: only with capture.sae (an SAE to read through)")
            return
        if not isinstance(self.sae, SAE):
            raise ValueError(f"capture.sae: expected a vlens.SAE (SAE.load(path)), got {type(self.sae).__name__}")
        others = {"project": self.project is not None, "logit_lens": self.logit_lens is not None,
                  "reduce": self.reduce != "none", "heads": self.heads is not None}  # fmt: skip
        clash = [name for name, given in others.items() if given]
        if clash:
            raise ValueError(f"capture.{clash[0]}: cannot be combined with capture.sae (the SAE is the readout)")
        d_sae = self.sae.d_sae
        if self.top_k is not None and self.features is not None:
            raise ValueError("capture.features: give top_k or features, not both")
        if self.top_k is None and self.features is None and not self.sae_error:
            raise ValueError("capture.sae: say what to return: top_k=k, features=[...] and/or sae_error=True")
        if self.top_k is not None and not (_is_int(self.top_k) and 1 <= self.top_k <= d_sae):
            raise ValueError(f"capture.top_k: expected an int in 1..{d_sae} (the SAE's d_sae), got {self.top_k!r}")
        if self.features is not None:
            self.features = check_features(self.features, d_sae, "capture.features")
        if not isinstance(self.sae_error, bool):
            raise ValueError(f"capture.sae_error: expected true or false, got {self.sae_error!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_feature(feature: Any, d_sae: int, field: str) -> int:
    """One latent index of an SAE with d_sae latents."""
    if not (_is_int(feature) and 0 <= feature < d_sae):
        raise ValueError(f"{field}: {feature!r} is not a latent of this SAE; expected an int in 0..{d_sae - 1}")
    return feature


def check_features(features: Any, d_sae: int, field: str) -> list[int]:
    """A non-empty list of distinct latent indices."""
    if isinstance(features, (str, bytes)) or not isinstance(features, Sequence) or not len(features):
        raise ValueError(f"{field}: expected a non-empty list of latent indices, got {features!r}")
    chosen = [check_feature(f, d_sae, field) for f in features]
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"{field}: {chosen!r} names a latent more than once")
    return chosen


def check_token_ids(ids: Any, field: str) -> frozenset[int]:
    """A collection of token ids (ints >= 0, numpy's and torch's included), refused here rather than when a
    request is bound."""
    try:
        chosen = None if isinstance(ids, (str, bytes)) else frozenset(operator.index(t) for t in ids)
    except TypeError:
        chosen = None
    if chosen is None or any(t < 0 for t in chosen):
        raise ValueError(f"{field}: expected a list of token ids (ints >= 0), got {ids!r}")
    return chosen


def check_heads(heads: Any, field: str) -> list[int]:
    """A non-empty list of distinct head indices (their range is checked against the model later)."""
    ok = isinstance(heads, Sequence) and not isinstance(heads, str) and len(heads) > 0
    if not ok or not all(_is_int(h) for h in heads):
        raise ValueError(f"{field}: expected a non-empty list of head indices (ints), got {heads!r}")
    if len(set(heads)) != len(heads):
        raise ValueError(f"{field}: {list(heads)!r} names a head more than once")
    return list(heads)
