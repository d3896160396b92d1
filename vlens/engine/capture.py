"""Capture plans: which rows of which tap belong to whom, gathered on the device, copied off once.

A plan is built per forward from its owners' wishes. Each tap it installs does one `index_select`
of the wanted rows (nothing else runs on the hot path). After the forward, owners' readouts (probe
projections, logit lens, per-step sums) run on the device, and the results leave it in non-blocking
copies into pinned memory; they are handed out only after the copy's event has completed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from vlens.models.base import DecoderLM

Readout = Callable[[torch.Tensor], "torch.Tensor | tuple[torch.Tensor, ...]"]


def project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Readout of a linear probe: rows @ W (+ b)."""
    y = x.flatten(1) @ w
    return y if b is None else y + b


def logit_lens(x: torch.Tensor, model: DecoderLM, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Readout of the logit lens: top-k token ids and log-probabilities through the final norm and head."""
    values, ids = model.lens(x).float().log_softmax(dim=-1).topk(k, dim=-1)
    return ids, values


@dataclass
class CaptureRequest:
    """One owner's wish for one forward: packed rows `rows` (ascending) of tap `tap`."""

    owner: object
    tap: str
    rows: torch.Tensor  # [n] long, CPU: indices into the packed batch (into logit rows for LOGITS)
    dtype: torch.dtype | None = None
    readout: Readout | None = None  # runs on the device on the owner's rows
    reduce: bool = False  # sum the (read-out) rows into one: the owner averages over steps


@dataclass
class CapturePlan:
    requests: list[CaptureRequest]
    device: torch.device
    gathered: dict[str, torch.Tensor] = field(default_factory=dict)
    _rows: dict[str, torch.Tensor] = field(default_factory=dict)
    _by_tap: dict[str, list[CaptureRequest]] = field(default_factory=dict)
    _results: list[tuple[CaptureRequest, object]] = field(default_factory=list)
    _bulk: list[tuple[list[CaptureRequest], torch.Tensor]] = field(default_factory=list)
    _event: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        for r in self.requests:
            if len(r.rows):
                self._by_tap.setdefault(r.tap, []).append(r)
        for tap, reqs in self._by_tap.items():
            self._rows[tap] = torch.cat([r.rows for r in reqs]).to(self.device, non_blocking=True)

    @property
    def taps(self) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """The tap functions to put in the forward context (empty when nothing is captured)."""
        return {tap: self._make_tap(tap) for tap in self._rows}

    def _make_tap(self, tap: str):
        rows = self._rows[tap]

        def gather(x: torch.Tensor) -> torch.Tensor:
            self.gathered[tap] = x.index_select(0, rows)
            return x

        return gather

    def finish(self) -> None:
        """Run readouts and queue the device-to-host copies; returns at once on CUDA."""
        for tap, reqs in self._by_tap.items():
            gathered = self.gathered[tap]
            if all(r.readout is None and not r.reduce and r.dtype in (None, gathered.dtype) for r in reqs):
                self._bulk.append((reqs, gathered))  # one copy for the whole tap, split on the host
                continue
            for r, chunk in zip(reqs, gathered.split([len(r.rows) for r in reqs])):
                out = r.readout(chunk) if r.readout is not None else chunk
                if r.reduce:
                    out = out.sum(0, keepdim=True)
                if r.dtype is not None and isinstance(out, torch.Tensor) and out.is_floating_point():
                    out = out.to(r.dtype)  # integer taps (MoE expert ids) keep their dtype
                self._results.append((r, out))
        if self.device.type == "cuda":
            self._results = [(r, _to_host(out)) for r, out in self._results]
            self._bulk = [(reqs, _to_host(buffer)) for reqs, buffer in self._bulk]
            self._event = torch.cuda.Event()
            self._event.record()

    def pieces(self) -> list[tuple[object, str, torch.Tensor | tuple[torch.Tensor, ...]]]:
        """(owner, tap, CPU result) for every request, after the copies have landed. Results may be
        views of a shared buffer; owners concatenate them into tensors of their own."""
        if self._event is not None:
            self._event.synchronize()
        out = [(r.owner, r.tap, result) for r, result in self._results]
        for reqs, buffer in self._bulk:
            out += [(r.owner, r.tap, rows) for r, rows in zip(reqs, buffer.split([len(r.rows) for r in reqs]))]
        return out


def _to_host(x):
    if isinstance(x, tuple):
        return tuple(_to_host(t) for t in x)
    return torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x, non_blocking=True)
