"""Cache-less forward of whole sequences packed back to back: the path of `trace` and `harvest`.

No KV cache, no sampling, no logits unless a tap asks for them, and no layer past the deepest tap.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from vlens.context import packed_context, set_context
from vlens.engine.capture import CapturePlan, CaptureRequest
from vlens.hooks import FINAL_NORM, LOGITS, layers_needed
from vlens.models.base import DecoderLM


def token_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of sequences whose total length fits the token budget (a longer one goes alone)."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if groups[-1] and used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


@torch.inference_mode()
def packed_forward(
    model: DecoderLM,
    sequences: list[list[int]],
    taps: list[str],
    rows: list[torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> CapturePlan:
    """Run `sequences` as one packed batch and capture `taps` (canonical names) at `rows[i]` of
    sequence i (default: every position). Pieces in the returned plan are owned by sequence index."""
    device = model.lm_head.weight.device
    lens = [len(s) for s in sequences]
    starts = list(accumulate([0] + lens[:-1]))
    if rows is None:
        rows = [torch.arange(n) for n in lens]
    requests = [
        CaptureRequest(owner=i, tap=tap, rows=r + s, dtype=dtype)
        for i, (s, r) in enumerate(zip(starts, rows))
        for tap in taps
    ]
    plan = CapturePlan(requests, device)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    full = FINAL_NORM in taps or LOGITS in taps
    depth = max(layers_needed(t, model.cfg) for t in taps)
    set_context(packed_context(lens, device, plan.taps))
    try:
        hidden = model(ids.to(device, non_blocking=True), num_layers=None if full else depth)
        if LOGITS in taps:
            model.logits(hidden)
    finally:
        set_context(None)
    plan.finish()
    return plan
