"""What a cache-less forward of whole sequences packed back to back needs besides the runner (the path of
`trace`, `HookedLM` and harvest): batches that fit a token budget, the plan of its taps, and its result.

No KV cache, no sampling, no logits unless a tap asks for them, and no layer past the deepest tap
(vlens.engine.model_runner.ModelRunner.packed runs it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from vlens.capture.bind import BoundIntervention
from vlens.capture.names import is_pattern
from vlens.capture.plan import StepPlan, plan_edits, shift
from vlens.capture.runtime import Collection


def token_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of sequences whose total length fits the token budget (a longer one goes alone), each
    listed shortest first: the order its packed forward takes them in, so that sequences of like length are
    neighbours and share an attention grid (of unlike ones in source order, ~15% of a CPU forward's time)."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if groups[-1] and used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return [sorted(group, key=lengths.__getitem__) for group in groups]


def packed_plan(
    lens: list[int], taps: list[str], rows: list[torch.Tensor] | None, interventions: Sequence[BoundIntervention] = (),
    limits: Sequence[np.ndarray | None] | None = None,
) -> StepPlan:  # fmt: skip
    """Gather `taps` at `rows[i]` of sequence i (default: every position), and apply `interventions` to
    every sequence, its positions counted from its start; the owner of a segment is the index of its sequence.
    `limits[i]`: the last key each position of sequence i sees, where some see past their own (Segment's)."""
    plan = StepPlan()
    patterns = any(is_pattern(t) for t in taps)
    for i, (start, n) in enumerate(zip(accumulate([0] + lens[:-1]), lens)):
        if taps:
            positions = range(n) if rows is None else rows[i].tolist()
            keys = torch.arange(start, start + n) if patterns else None  # packed: key j sits at row start + j
            seen = limits[i] if limits is not None and patterns else None
            plan.gather(i, positions, shift(positions, start), taps, keys,
                        limits=None if seen is None else seen[list(positions)].tolist())  # fmt: skip
        if interventions:
            plan_edits(plan, interventions, 0, n, start)
    return plan


@dataclass
class PackedCapture:
    plan: StepPlan
    collection: Collection

    def pieces(self) -> list[tuple[int, str, torch.Tensor]]:
        """(sequence index, tap, CPU rows) for every sequence and tap, once the copies have landed."""
        return [
            (self.plan.segments[segment].owner, c.tap, rows)
            for c in self.collection.ready()
            for segment, rows in zip(c.segments, c.rows)
        ]
