"""Readouts: transforms of a request's captured rows that run on the device, so only their (small)
results are copied off it — a linear probe's projection and the logit lens. (The mean readout is a sum
on the device per step, see rows.RowStream.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vlens.models.base import DecoderLM

Readout = Callable[[torch.Tensor], "torch.Tensor | tuple[torch.Tensor, ...]"]


def project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """A linear probe: rows @ W (+ b)."""
    y = x.flatten(1) @ w
    return y if b is None else y + b


def logit_lens(x: torch.Tensor, model: DecoderLM, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k token ids and log-probabilities of residual rows through the final norm and head."""
    values, ids = model.lens(x).float().log_softmax(dim=-1).topk(k, dim=-1)
    return ids, values
