"""Interventions on the device: each step's steer/ablate/patch rows of every request, applied per tap
in a few vectorised ops (index_add / index_copy over the packed batch), so requests with different
interventions, or none, share one forward."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from vlens.config import ModelConfig
from vlens.engine.rows import RowSelector
from vlens.hooks import LOGITS, resolve_hooks
from vlens.interventions import Ablate, Patch, Steer


@dataclass
class ActiveIntervention:
    """A validated intervention bound to the model: resolved taps and device-ready data."""

    kind: str  # "steer" | "ablate" | "patch"
    taps: list[str]
    selector: RowSelector
    data: torch.Tensor  # [*shape]: scale*vector, unit direction or one patch row; or [n, *shape] patch rows
    value_positions: torch.Tensor | None = None  # patch rows' sorted positions; None: `data` is one row for all

    def step_data(self, positions: torch.Tensor) -> torch.Tensor:
        """The per-row data for these positions: [n, *shape] on the device."""
        if self.value_positions is None:
            return self.data.expand(len(positions), *self.data.shape)
        index = torch.searchsorted(self.value_positions, positions)
        return self.data.index_select(0, index.to(self.data.device, non_blocking=True))


def _patch_positions(iv: Patch, prompt_len: int) -> list[int] | None:
    """The positions a multi-row patch's rows go to, in row order; None when the spec is open-ended."""
    p = iv.positions
    if isinstance(p, list):
        return p
    if p == "prompt":
        return list(range(prompt_len))
    if isinstance(p, slice) and p.stop is not None:
        return list(range(p.start or 0, p.stop, p.step or 1))
    return None


def bind(
    interventions: list, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], prompt_len: int, max_rows: int,
    device: torch.device, dtype: torch.dtype,
) -> list[ActiveIntervention]:
    """Check a request's interventions against the model and put their data on the device."""
    bound = []
    for i, iv in enumerate(interventions):
        field = f"interventions[{i}]"
        taps = sorted(set(resolve_hooks(iv.hook, cfg).values()))
        if LOGITS in taps:
            raise ValueError(f"{field}.hook: interventions on {LOGITS} are not supported; steer the residual instead")
        shape_set = {shapes[t] for t in taps}
        if len(shape_set) > 1:
            raise ValueError(f"{field}.hook: {iv.hook!r} matches taps of different shapes {sorted(shape_set)}")
        shape = shape_set.pop()
        data = iv.vector * iv.scale if isinstance(iv, Steer) else iv.direction if isinstance(iv, Ablate) else iv.values
        value_positions = None
        numel = torch.Size(shape).numel()
        if isinstance(iv, Patch) and data.numel() != numel:
            rows = _patch_positions(iv, prompt_len)
            if rows is None or data.numel() != len(rows) * numel:
                raise ValueError(
                    f"{field}.values: shape {tuple(data.shape)} fits neither one row of {iv.hook} {shape} nor one row "
                    f"per position of {iv.positions!r}" + ("" if rows is None else f" ({len(rows)} rows)")
                )
            order = torch.tensor(rows).argsort()
            value_positions = torch.tensor(rows)[order]
            data = data.reshape(len(rows), *shape)[order]
        elif data.numel() != numel:
            raise ValueError(f"{field}: vector of shape {tuple(data.shape)} does not fit {iv.hook}, whose rows are {shape}")
        else:
            data = data.reshape(shape)
        if isinstance(iv.positions, list):
            bad = [p for p in iv.positions if p >= max_rows]
            if bad:
                raise ValueError(f"{field}.positions: {bad} out of range; this request has at most {max_rows} rows")
        kind = type(iv).__name__.lower()
        selector = RowSelector(sorted(iv.positions) if isinstance(iv.positions, list) else iv.positions, prompt_len)
        bound.append(ActiveIntervention(kind, taps, selector, data.to(device, dtype), value_positions))
    return bound


class InterventionPlan:
    """One step's interventions, grouped by tap and by their order within each request."""

    def __init__(self, items: list[tuple[int, ActiveIntervention, torch.Tensor, torch.Tensor]], device: torch.device):
        # (order within its request, intervention, packed rows, positions)
        groups: dict[str, dict[int, dict[str, list]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
        for order, iv, rows, positions in items:
            data = iv.step_data(positions)
            for tap in iv.taps:
                groups[tap][order][iv.kind].append((rows, data))
        self.ops: dict[str, list[list[tuple[str, torch.Tensor, torch.Tensor]]]] = {}
        for tap, by_order in groups.items():
            self.ops[tap] = [
                [
                    (kind, torch.cat([r for r, _ in parts]).to(device, non_blocking=True), torch.cat([d for _, d in parts]))
                    for kind, parts in by_order[order].items()
                ]
                for order in sorted(by_order)
            ]

    def apply(self, tap: str, x: torch.Tensor) -> torch.Tensor:
        for group in self.ops[tap]:
            for kind, rows, data in group:
                if kind == "steer":
                    x = x.index_add(0, rows, data.to(x.dtype))
                elif kind == "patch":
                    x = x.index_copy(0, rows, data.to(x.dtype))
                else:  # ablate: x - (x . d) d over the whole per-token value
                    coef = (x.index_select(0, rows) * data).flatten(1).sum(1)
                    x = x.index_add(0, rows, -coef.view(-1, *[1] * (x.dim() - 1)) * data)
        return x
