"""Capture plans: which rows of which tap belong to whom, gathered on the device, copied off once.

A plan is built per forward from its owners' wishes. Each tap it installs does one `index_select`
of the wanted rows (nothing else runs on the hot path); after the forward the gathered rows leave the
device in one non-blocking copy per tap into pinned memory, and are split among owners only after
the copy's event has completed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlens.hooks import LOGITS


@dataclass
class CaptureRequest:
    """One owner's wish for one forward: packed rows `rows` (ascending) of tap `tap`."""

    owner: object
    tap: str
    rows: torch.Tensor  # [n] long, CPU: indices into the packed batch (into logit rows for LOGITS)
    dtype: torch.dtype | None = None


@dataclass
class CapturePlan:
    requests: list[CaptureRequest]
    device: torch.device
    gathered: dict[str, torch.Tensor] = field(default_factory=dict)
    _rows: dict[str, torch.Tensor] = field(default_factory=dict)
    _pieces: dict[str, list[tuple[object, int, torch.dtype | None]]] = field(default_factory=dict)
    _event: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        by_tap: dict[str, list[CaptureRequest]] = {}
        for r in self.requests:
            if len(r.rows):
                by_tap.setdefault(r.tap, []).append(r)
        for tap, reqs in by_tap.items():
            rows = torch.cat([r.rows for r in reqs])
            self._rows[tap] = rows.to(self.device, non_blocking=True)
            self._pieces[tap] = [(r.owner, len(r.rows), r.dtype) for r in reqs]

    @property
    def taps(self) -> dict:
        """The tap functions to put in the forward context (empty when nothing is captured)."""
        return {tap: self._make_tap(tap) for tap in self._rows}

    def _make_tap(self, tap: str):
        rows = self._rows[tap]

        def gather(x: torch.Tensor) -> torch.Tensor:
            self.gathered[tap] = x.index_select(0, rows)
            return x

        return gather

    def needs_logits(self) -> bool:
        return LOGITS in self._rows

    def start_copy(self) -> None:
        """Queue device-to-host copies of everything gathered; returns at once on CUDA."""
        if self.device.type != "cuda":
            return
        for tap, x in self.gathered.items():
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self.gathered[tap] = host.copy_(x, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def pieces(self) -> list[tuple[object, str, torch.Tensor]]:
        """(owner, tap, CPU rows) for every request, after the copy has landed. The rows may be views
        of one per-tap buffer; owners concatenate them into tensors of their own."""
        if self._event is not None:
            self._event.synchronize()
        out = []
        for tap, parts in self._pieces.items():
            chunks = torch.split(self.gathered[tap], [n for _, n, _ in parts])
            for (owner, _, dtype), chunk in zip(parts, chunks):
                out.append((owner, tap, chunk if dtype in (None, chunk.dtype) else chunk.to(dtype)))
        return out
