"""What a request asks for: how to sample (vLLM's SamplingParams) and what to capture (Capture).

Everything is validated at construction or, for what needs the model, before the engine runs it, so
a bad request fails alone with a message naming the field and the allowed values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import numpy as np
import torch

PositionSpec = Union[str, int, Sequence[int], slice]
POSITION_KEYWORDS = ("all", "prompt", "generated", "last")
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


def normalize_positions(p: PositionSpec, field: str = "capture.positions") -> PositionSpec:
    """Check a position spec; ints become sorted lists of distinct ints."""
    if isinstance(p, str):
        if p not in POSITION_KEYWORDS:
            raise ValueError(f"{field}: {p!r} is not one of {', '.join(POSITION_KEYWORDS)}, an int list or a slice")
        return p
    if isinstance(p, int) and not isinstance(p, bool):
        return [p]
    if isinstance(p, slice):
        if p.step is not None and p.step <= 0:
            raise ValueError(f"{field}: slice step must be positive, got {p.step}")
        return p
    if isinstance(p, Sequence) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
        return sorted(set(p))
    raise ValueError(f"{field}: expected one of {POSITION_KEYWORDS}, an int, a list of ints or a slice; got {p!r}")


@dataclass
class Capture:
    """Taps to record for one request, at sequence positions chosen by `positions`.

    Row p is the state computed at position p (the one that predicts token p + 1). Rows exist for
    every token fed to the model: positions 0 .. P+G-2 for a P-token prompt and G generated tokens
    (the last sampled token is never fed), exactly as HF generate(output_hidden_states=True) lays out
    its steps. `positions`: "all" | "prompt" | "generated" (P .. P+G-2) | "last" (the final row) |
    int | list of ints | slice, counted over those rows, negative from the end. Rows come back in
    ascending position order; rows whose token is in `exclude_token_ids` are left out.

    Readouts run on the device, so only what they return is copied off it:
    `project=W` ([d, k], or a pair (W, bias [k])) returns x @ W (+ bias) per row (linear probes);
    `reduce="mean"` returns the mean over the selected rows as one row (after any projection);
    `logit_lens=k` returns, per row of a residual-stream tap, the top-k token ids and log-probabilities
    through the final norm and unembedding, in RequestOutput.logit_lens instead of activations.
    """

    hooks: str | Sequence[str] = "blocks.*.hook_resid_post"
    positions: PositionSpec = "all"
    exclude_token_ids: Sequence[int] | None = None
    dtype: str | torch.dtype | None = None
    reduce: str = "none"
    project: Any = None
    logit_lens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.hooks, str):
            self.hooks = [self.hooks]
        self.hooks = list(self.hooks)
        if not self.hooks:
            raise ValueError("capture.hooks: empty; give at least one hook name or glob")
        self.positions = normalize_positions(self.positions)
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


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # log-probabilities of the sampled token and this many top alternatives
    capture: Capture | None = None
    return_hidden_states: bool = False  # shortcut: ln_final.hook_normalized at every position
    interventions: Sequence[Any] | None = None  # vlens.Steer / Ablate / Patch, applied in order
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an int >= 1"),
            (self.temperature >= 0, "temperature", ">= 0 (0 = greedy)"),
            (0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "an int >= 0 (0 or -1 = off)"),
            (0 <= self.min_p <= 1, "min_p", "in [0, 1]"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0), "logprobs", "None or an int >= 0"),
            (self.capture is None or isinstance(self.capture, Capture), "capture", "None or a vlens.Capture"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not allowed; expected {allowed}")
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if any(not isinstance(s, str) or not s for s in self.stop_list):
            raise ValueError(f"stop: expected non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or ())
        from vlens.interventions import Ablate, Patch, Steer  # they import this module

        self.interventions = list(self.interventions or ())
        for i, iv in enumerate(self.interventions):
            if not isinstance(iv, (Steer, Ablate, Patch)):
                raise ValueError(f"interventions[{i}]: expected vlens.Steer, Ablate or Patch, got {type(iv).__name__}")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
