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

from vlens.capture.names import hook_shapes
from vlens.capture.plan import Chunk, Collected, StepPlan, plan_step
from vlens.capture.runtime import TapRuntime
from vlens.context import AttentionGroup, ForwardContext, grid_layout, set_context
from vlens.engine.logprobs import PromptRows, TopLogprobs, to_host, top_logprobs
from vlens.engine.sampler import SamplingBatch, sample
from vlens.engine.sequence import Sequence
from vlens.models.base import DecoderLM


@dataclass
class StepOutput:
    sampled: list[Sequence]  # sequences that got a new token this step, in order
    tokens: list[int]
    logprobs: TopLogprobs | None  # of the sampled tokens
    plan: StepPlan  # what the taps did; `collected` are its gathered rows, on the host
    collected: list[Collected]
    prompt_rows: PromptRows  # whose prompt log-probabilities `prompt_logprobs` holds, on the host
    prompt_logprobs: TopLogprobs | None = None


class ModelRunner:
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int):
        self.model, self.cfg = model, model.cfg
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.block_size = block_size
        shape = (self.cfg.num_layers, 2, num_blocks * block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        self.windows = set(self.cfg.sliding_windows)
        self.taps = TapRuntime(hook_shapes(self.cfg), self.device, self.dtype)
        # What runs the model's forward: the module itself (eager), or a compiled or graph-replaying
        # stand-in with the same signature (its taps then need `self.taps.fixed_shapes`).
        self.forward = model

    @staticmethod
    def bytes_per_block(model: DecoderLM, block_size: int) -> int:
        cfg = model.cfg
        itemsize = model.lm_head.weight.element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize

    def _group(self, chunk: list[tuple[Sequence, int]], first_row: int) -> tuple[AttentionGroup, torch.Tensor, torch.Tensor]:
        starts = torch.tensor([s.num_computed for s, _ in chunk], dtype=torch.long)
        lens = torch.tensor([n for _, n in chunk], dtype=torch.long)
        positions, query_positions, q_index = grid_layout(starts, lens)
        num_keys = int((starts + lens).max())
        width = -(-num_keys // self.block_size)
        tables = torch.tensor([s.block_table[:width] + [0] * (width - len(s.block_table)) for s, _ in chunk])
        j = torch.arange(num_keys)
        key_slots = tables[:, j // self.block_size] * self.block_size + j % self.block_size
        seq_of_row = torch.repeat_interleave(torch.arange(len(chunk)), lens)
        slots = key_slots[seq_of_row, positions]
        group = AttentionGroup(
            rows=slice(first_row, first_row + len(positions)),
            query_positions=query_positions.to(self.device, non_blocking=True),
            q_index=None if q_index is None else q_index.to(self.device, non_blocking=True),
            key_slots=key_slots.to(self.device, non_blocking=True),
        )
        return group.add_masks(self.windows), positions, slots

    def _layout(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[tuple[Sequence, int]], ForwardContext, torch.Tensor]:
        """Order the batch as decodes first, then prefill chunks grouped so grids stay dense."""
        decodes = [(s, n) for s, n in scheduled if n == 1]
        prefills = sorted(((s, n) for s, n in scheduled if n > 1), key=lambda c: -c[1])
        chunks: list[list[tuple[Sequence, int]]] = [decodes] if decodes else []
        for c in prefills:  # longest first; a chunk joins a group while the grid stays at most half padding
            group = chunks[-1] if chunks and chunks[-1] is not decodes else None
            if group is not None and (len(group) + 1) * group[0][1] <= 2 * (sum(n for _, n in group) + c[1]):
                group.append(c)
            else:
                chunks.append([c])
        groups, positions, slots, row = [], [], [], 0
        for chunk in chunks:
            g, p, s = self._group(chunk, row)
            groups.append(g)
            positions.append(p)
            slots.append(s)
            row += len(p)
        order = [c for chunk in chunks for c in chunk]
        ids = torch.tensor([t for s, n in order for t in s.token_ids[s.num_computed : s.num_computed + n]])
        ends = torch.repeat_interleave(
            torch.tensor([len(s.token_ids) - 1 for s, _ in order]), torch.tensor([n for _, n in order])
        )
        ctx = ForwardContext(
            positions=torch.cat(positions).to(self.device, non_blocking=True),
            groups=groups,
            slot_mapping=torch.cat(slots).to(self.device, non_blocking=True),
            sequence_ends=ends.to(self.device, non_blocking=True),
        )
        return order, ctx, ids

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
                chunks.append(Chunk(seq.taps, seq.token_ids, seq.num_computed, n, row))
            row += n
        plan = plan_step(chunks)
        logit_rows, sample_index = plan.logit_rows(sample_rows + prompt_rows.rows)  # sampled rows, then prompt rows
        ctx.taps = self.taps.arm(plan) if plan else {}
        sampled = [s for s, n in order if s.num_computed + n == len(s.token_ids) and not s.prefill_only]
        depths = [s.depth for s, _ in order]
        # A step of prefill-only requests stops after the deepest layer they read (eagerly: it is rare).
        forward = self.forward if None in depths else partial(self.model, num_layers=max(depths))
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
            return StepOutput([], [], None, plan, collection.ready() if collection else [], prompt_rows, prompt_logprobs)
        logits = logits[: len(sample_rows)]
        tokens = sample(logits, SamplingBatch.of(sampled, self.device))
        logprobs = None
        k = max((s.logprobs_k for s in sampled if s.logprobs_k is not None), default=None)
        if k is not None:
            logprobs = to_host(top_logprobs(logits, tokens, k), blocking=False)
        # The step's one host sync: sampled ids become Python ints for stop checks and detokenising.
        tokens = tokens.to("cpu").tolist()
        collected = collection.ready() if collection else []
        return StepOutput(sampled, tokens, logprobs, plan, collected, prompt_rows, prompt_logprobs)
