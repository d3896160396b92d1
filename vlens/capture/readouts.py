"""Readouts: transforms of a request's captured rows at a tap that run on the device, so only their (small)
results are copied off it — a linear probe's projection and the logit lens (tuned or not). (The mean readout is a
sum on the device per step, see rows.RowStream.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vlens.models.base import DecoderLM

Readout = Callable[[torch.Tensor, str], "torch.Tensor | tuple[torch.Tensor, ...]"]  # (rows, their tap)


def project(x: torch.Tensor, tap: str, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """A linear probe: rows @ W (+ b)."""
    y = x.flatten(1) @ w
    return y if b is None else y + b


def logit_lens(
    x: torch.Tensor, tap: str, model: DecoderLM, k: int,
    translators: dict[str, tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Top-k token ids and log-probabilities of residual rows through the final norm and head; with a tuned lens's
    `translators` (vlens.capture.tuned_lens), each row first becomes x + W x + b by its tap's."""
    translator = None if translators is None else translators[tap]
    if translator is not None:
        w, b = translator
        x = x + torch.addmm(b, x, w.T)
    values, ids = model.lens(x).float().log_softmax(dim=-1).topk(k, dim=-1)
    return ids, values
