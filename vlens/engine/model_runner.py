"""One engine step on the device: lay out the scheduled chunks, plan the taps, run the model over the
paged cache, collect captured rows, compute logits only where needed (sampled rows, prompt rows whose
log-probabilities are asked for, captured logits), and sample.

Everything per step is built as a handful of host tensors (no per-token Python), moved once, and the
only host sync is the copy of the sampled token ids back.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from vlens.attention import paged_metadata
from vlens.capture.names import hook_shapes
from vlens.capture.plan import Chunk, StepPlan, plan_step
from vlens.capture.runtime import Collection, TapRuntime
from vlens.context import ForwardContext, set_context
from vlens.engine.logprobs import PromptRows, TopLogprobs, to_host, top_logprobs
from vlens.engine.sampler import SamplingBatch, sample
from vlens.engine.sequence import Sequence
from vlens.models.base import DecoderLM


@dataclass
class StepOutput:
    sampled: list[Sequence]  # sequences that got a new token this step, in order
    tokens: list[int]
    logprobs: TopLogprobs | None  # of the sampled tokens
    plan: StepPlan  # what the taps did; `collection` brings its gathered rows to the host
    collection: Collection | None
    prompt_rows: PromptRows  # whose prompt log-probabilities `prompt_logprobs` holds, on the host
    prompt_logprobs: TopLogprobs | None = None


def _kv_heads(cfg) -> int:
    """KV heads this rank caches (all of them in one process)."""
    return len(cfg.parallel.units(cfg.num_kv_heads))


class ModelRunner:
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int, backend):
        self.model, self.cfg = model, model.cfg
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.block_size, self.num_slots = block_size, num_blocks * block_size
        shape = (self.cfg.num_layers, 2, self.num_slots, _kv_heads(self.cfg), self.cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        layers = model.attention_layers()
        for i, attn in enumerate(layers):
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        self.backend, self.kinds = backend, {attn.kind for attn in layers}
        self.taps = TapRuntime(hook_shapes(self.cfg), self.device, self.dtype)
        # What runs the model's forward: the module itself (eager), or a compiled or graph-replaying
        # stand-in with the same signature (its taps then need `self.taps.fixed_shapes`).
        self.forward = model

    @staticmethod
    def bytes_per_block(model: DecoderLM, block_size: int) -> int:
        cfg = model.cfg
        itemsize = model.lm_head.weight.element_size()
        return 2 * cfg.num_layers * block_size * _kv_heads(cfg) * cfg.head_dim * itemsize

    def _layout(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[tuple[Sequence, int]], ForwardContext, torch.Tensor]:
        """The step as attention kernels take it: decodes first, then prefill chunks longest first (so
        the SDPA backend's grids stay dense), and what the backend plans from that."""
        decodes = [(s, n) for s, n in scheduled if n == 1]
        order = decodes + sorted(((s, n) for s, n in scheduled if n > 1), key=lambda c: -c[1])
        meta = paged_metadata(
            [s.num_computed for s, _ in order], [n for _, n in order], [len(s.token_ids) for s, _ in order],
            [s.block_table for s, _ in order], self.block_size, self.num_slots, self.device,
        )  # fmt: skip
        ids = torch.tensor([t for s, n in order for t in s.token_ids[s.num_computed : s.num_computed + n]])
        borrows = [s.borrow for s, _ in order if s.borrow is not None and s.borrow.copy_to]
        if borrows:
            src = self._on_device([slot for b in borrows for slot in b.copy_from])
            meta.kv_copy = (src, self._on_device([slot for b in borrows for slot in b.copy_to]))
        state = self.backend.prepare(meta, self.kinds, self.dtype)
        return order, ForwardContext(meta, self.backend, state), ids

    def _on_device(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> StepOutput:
        order, ctx, ids = self._layout(scheduled)
        chunks, sample_rows, prompt_rows, row = [], [], PromptRows(), 0
        for seq, n in order:
            if seq.num_computed + n == len(seq.token_ids) and not seq.prefill_only:
                sample_rows.append(row + n - 1)
            prompt_rows.add(seq, n, row)
            if seq.taps.streams or seq.taps.interventions:
                chunks.append(Chunk(seq.taps, seq.token_ids, seq.num_computed, n, row, seq.block_table))
            row += n
        plan = plan_step(chunks, self.block_size)
        logit_rows, sample_index = plan.logit_rows(sample_rows + prompt_rows.rows)  # sampled rows, then prompt rows
        ctx.taps = self.taps.arm(plan) if plan else {}
        sampled = [s for s, n in order if s.num_computed + n == len(s.token_ids) and not s.prefill_only]
        depths = [s.depth for s, _ in order]
        # A step of prefill-only requests stops after the deepest layer they read (eagerly: it is rare).
        forward = self.forward if None in depths else partial(self.model, num_layers=max(depths))
        if self.model.executor is not None:  # the other tensor-parallel ranks run the same forward
            num_layers = None if None in depths else max(depths)
            self.model.executor.launch(ids, ctx.attention, plan, num_layers, logit_rows or None, self.taps)
        set_context(ctx)
        try:
            hidden = forward(ids.to(self.device, non_blocking=True))
            if logit_rows:
                logits = self.model.logits(hidden.index_select(0, self._on_device(logit_rows)))
                if sample_index is not None:
                    logits = logits.index_select(0, self._on_device(sample_index))
        finally:
            set_context(None)
        collection = self.taps.collect(plan) if plan.gathers else None
        prompt_logprobs = None
        if prompt_rows.rows:  # on their way to the host before the step's sync (blocking when none comes)
            prompt_logprobs = prompt_rows.compute(logits[len(sample_rows) :], blocking=not sampled)
        if not sampled:
            return StepOutput([], [], None, plan, collection, prompt_rows, prompt_logprobs)
        logits = logits[: len(sample_rows)]
        tokens = sample(logits, SamplingBatch.of(sampled, self.device))
        logprobs = None
        k = max((s.logprobs_k for s in sampled if s.logprobs_k is not None), default=None)
        if k is not None:
            logprobs = to_host(top_logprobs(logits, tokens, k), blocking=False)
        # The step's one host sync: sampled ids become Python ints for stop checks and detokenising.
        tokens = tokens.to("cpu").tolist()
        return StepOutput(sampled, tokens, logprobs, plan, collection, prompt_rows, prompt_logprobs)
