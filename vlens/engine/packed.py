"""Cache-less forward of whole sequences packed back to back: the path of `trace` and `harvest`.

No KV cache, no sampling, no logits unless a tap asks for them, and no layer past the deepest tap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from vlens.attention import packed_metadata
from vlens.attention.sdpa import SdpaBackend
from vlens.capture.names import LOGITS, forward_depth, hook_shapes, is_pattern
from vlens.capture.plan import StepPlan, shift
from vlens.capture.runtime import Collection, TapRuntime
from vlens.context import ForwardContext, set_context
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


@dataclass
class PackedCapture:
    plan: StepPlan
    collection: Collection

    def pieces(self) -> list[tuple[int, str, torch.Tensor]]:
        """(sequence index, tap, CPU rows) for every sequence and tap, once the copies have landed."""
        return [(self.plan.segments[c.segment].owner, c.tap, c.rows) for c in self.collection.ready()]


@torch.inference_mode()
def packed_forward(
    model: DecoderLM,
    sequences: list[list[int]],
    taps: list[str],
    rows: list[torch.Tensor] | None = None,
    hooks: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    backend=None,
) -> PackedCapture:
    """Run `sequences` as one packed batch and capture `taps` (canonical names) at `rows[i]` of
    sequence i (default: every position). `hooks` are user functions run at their taps before the
    capture sees the value (HookedLM.run_with_hooks: the one eager path that runs user Python in a forward).
    `backend`: the attention backend (default: SDPA)."""
    backend = backend or SdpaBackend()
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    lens = [len(s) for s in sequences]
    starts = list(accumulate([0] + lens[:-1]))
    plan = StepPlan()
    patterns = any(is_pattern(t) for t in taps)
    for i, (start, n) in enumerate(zip(starts, lens)):
        positions = range(n) if rows is None else rows[i].tolist()
        keys = torch.arange(start, start + n) if patterns else None  # packed: key j sits at row start + j
        plan.gather(i, positions, shift(positions, start), taps, keys)
    if hooks and model.executor is not None:
        raise ValueError("hooks: Python hooks run in one process; not with tensor_parallel_size > 1")
    runtime = TapRuntime(hook_shapes(model.cfg), device, dtype)
    armed = runtime.arm(plan)
    for name, fn in (hooks or {}).items():
        armed[name] = fn if name not in armed else _then(fn, armed[name])
    sites = [*taps, *(hooks or {})]
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    meta = packed_metadata(lens, device)
    kinds = {attn.kind for attn in model.attention_layers()}
    depth = forward_depth(sites, model.cfg)
    if model.executor is not None:  # the other tensor-parallel ranks run the same forward
        model.executor.launch(ids, meta, plan, depth, list(range(len(ids))) if LOGITS in sites else None, runtime)
    set_context(ForwardContext(meta, backend, backend.prepare(meta, kinds, dtype), armed))
    try:
        hidden = model(ids.to(device, non_blocking=True), num_layers=depth)
        if LOGITS in sites:
            model.logits(hidden)
    finally:
        set_context(None)
    return PackedCapture(plan, runtime.collect(plan))


def _then(first: Callable, second: Callable) -> Callable:
    return lambda x: second(first(x))
