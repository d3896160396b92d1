"""The one runner every forward goes through — engine steps, trace / harvest batches and the memory
profile — and the owner of what a forward reads besides the weights: the step's device buffers (token ids,
positions, slot mapping, sequence layout, logit rows, sampling parameters; vlens.engine.buffers), the tap
runtime with its index and vector buffers, and the KV cache.

An engine step: lay out the scheduled chunks, plan the taps, run the model over the paged cache, collect
captured rows, compute logits only where needed (sampled rows, prompt rows whose log-probabilities are
asked for, captured logits), and sample. Everything per step is a handful of host arrays written into the
buffers and sent to the device in one copy before the forward (no per-token Python beyond listing the new
token ids), and the only host sync is the copy of the sampled token ids back.

A step in which every sequence decodes can take the static path instead (`static_decode`): attention is
vlens.attention.decode's fixed-shape kernel and, for a graph or a compiled forward (`pad_decode`), the batch
is padded to a power-of-two bucket (padding rows write and read a scratch block no sequence owns), the block
tables to a power-of-two number of pages and the taps' index tensors to power-of-two sizes. On CUDA each
(bucket, pages, taps) shape is captured once as a CUDA graph and replayed — captures and interventions
included, since taps read only their armed buffers. On the CPU the same path runs eagerly (or compiled,
`compile_decode`), by default where its attention reads the paged cache in place (the C kernel); the CPU
tests check it against the ordinary step.

A step returns as soon as it is queued (`StepOutput`; its ids reach the host when the engine asks). The
engine may queue the next decode step of the same sequences first (`run_ahead`, async scheduling): its
input ids are the previous step's samples, copied on the device, so the host plans step N+1 while the
device runs step N.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from itertools import chain

import numpy as np
import torch

from vlens.attention import AttentionMetadata, layout
from vlens.attention.decode import DecodeBackend
from vlens.attention.metadata import chunk_layout
from vlens.attention.sdpa import SdpaBackend
from vlens.capture.bind import BoundIntervention
from vlens.capture.names import LOGITS, OPTIONAL_HOOKS, forward_depth, hook_shapes
from vlens.capture.plan import Chunk, StepPlan, plan_decode, plan_step
from vlens.capture.rows import DecodePages
from vlens.capture.runtime import Collection, TapRuntime
from vlens.context import ForwardContext, Tap, set_context
from vlens.distributed.taps import HookFailed, shard_taps
from vlens.engine.block_manager import SNAPSHOT_BLOCKS
from vlens.engine.buffers import StepBuffers
from vlens.engine.logprobs import PromptRows, TopLogprobs, to_host, top_logprobs
from vlens.engine.lora import LoraSlots
from vlens.engine.packed import PackedCapture, packed_plan
from vlens.engine.sampler import SamplingBatch, sample
from vlens.engine.sequence import Sequence
from vlens.images import PromptImages
from vlens.layers import fused
from vlens.layers.mlp import activation
from vlens.layers.slot_states import SlotStates
from vlens.models.base import DecoderLM
from vlens.own_code import own_copy

log = logging.getLogger("vlens.engine")
MIN_PAGES = 16  # the smallest page bucket of the static decode step
MAX_GRAPHS = 64  # captured graphs kept at once (past that, the least recently replayed is dropped); compiled forwards


def bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass
class GraphStats:
    """How the decode steps ran (EngineStats shows them)."""

    graph_steps: int = 0  # static decode steps replayed from a CUDA graph
    static_eager_steps: int = 0  # static decode steps run eagerly (no CUDA, or graphs off)
    eager_steps: int = 0  # steps the static path cannot serve: prefill, chunked prefill, prompt rows, ...
    graphs_captured: int = 0
    capture_seconds: float = 0.0
    compiled_steps: int = 0  # static decode steps run by a compiled forward (compile_decode)
    compiles: int = 0  # forwards compiled, one per batch bucket, page bucket and set of taps
    compile_seconds: float = 0.0
    ahead_steps: int = 0  # static decode steps launched before the previous step's ids reached the host


@dataclass
class StepOutput:
    """A step queued on the device. Nothing in it waits for the device but `token_ids`, the step's one
    host sync; until then the runner can queue the next decode step behind it (`run_ahead`)."""

    scheduled: list[tuple[Sequence, int]]  # what ran: (sequence, tokens fed)
    sampled: list[Sequence]  # sequences that got a new token this step, in order
    tokens: torch.Tensor | None  # [len(sampled)] their ids, on the device
    logprobs: TopLogprobs | None  # of the sampled tokens
    plan: StepPlan  # what the taps did; `collection` brings its gathered rows to the host
    collection: Collection | None
    prompt_rows: PromptRows  # whose prompt log-probabilities `prompt_logprobs` holds, on the host
    prompt_logprobs: TopLogprobs | None = None
    decode: bool = False  # a static decode step: every sequence fed its last token and sampled, in order
    adjusted: bool = False  # its sampling read logit biases or penalties (which read the sampled history)
    # CUDA: the ids' pinned host copy and the event after it, so that reading them waits for this step
    # alone, not for a step queued behind it on the same stream
    arriving: tuple[torch.Tensor, torch.cuda.Event] | None = None

    def token_ids(self) -> list[int]:
        """The sampled ids as Python ints, for stop checks and detokenising: waits for the device."""
        if self.arriving is not None:
            host, event = self.arriving
            event.synchronize()
            return host.tolist()
        return [] if self.tokens is None else self.tokens.tolist()


class ModelRunner:
    def __init__(
        self, model: DecoderLM, backend, max_tokens: int, max_seqs: int, graphs: bool = False, kernels: bool = False,
        compile_decode: bool = False, prefills: bool = False,
    ):  # fmt: skip
        """`max_tokens` / `max_seqs`: the largest engine step (its buffers are allocated at that size; a
        longer packed forward of trace or harvest grows them). `graphs`: decode steps replay CUDA graphs
        (on CUDA only; `static_decode` is then on). `kernels`: decode attention may read the paged cache with
        a kernel built here (vlens.attention.decode); on the CPU decode steps then take the static path.
        `compile_decode`: static decode steps run a forward compiled for their shape (`_compiled_step`).
        `prefills`: its forwards are large prefills (a harvest's), which on CUDA take the fused chains as graphs
        do (vlens.layers.fused)."""
        self.model, self.cfg, self.backend = model, model.cfg, backend
        self.served_by: threading.Thread | None = None  # (vlens.server.engine_loop's thread: the only one to run it)
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.kinds = {attn.kind for attn in model.attention_layers()}
        self.max_bucket = bucket(max_seqs)
        max_seqs, max_tokens = self.max_bucket, max(max_tokens, self.max_bucket)
        tokens, seqs, long = (max_tokens,), (max_seqs,), torch.long
        self.buffers = StepBuffers(
            {
                "input_ids": (tokens, long), "positions": (tokens, long), "sequence_ends": (tokens, long),
                "token_seq": (tokens, long), "slot_mapping": (tokens, long), "cu_seqlens_q": ((max_seqs + 1,), torch.int32),
                "logit_rows": (tokens, long), "sample_index": (seqs, long), "kv_copy_from": (tokens, long),
                "kv_copy_to": (tokens, long), "sampling_floats": ((3, max_seqs), torch.float32),
                "sampling_longs": ((3, max_seqs), long), "tap_index": (tokens, long), "ahead_rows": (seqs, long),
                "state_slots": (seqs, long), "image_rows": (tokens, long), "rope_positions": ((3, max_tokens), long),
                "state_sources": (seqs, long), "state_save_rows": (seqs, long), "state_save_slots": (seqs, long),
                "state_copy_from": (seqs, long), "state_copy_to": (seqs, long), "lora_slots": (tokens, long),
            },
            self.device,
        )  # fmt: skip
        # (every tap the model has, TransformerLens's optional ones too: HookedLM arms those it turned on)
        self.taps = TapRuntime(hook_shapes(self.cfg, OPTIONAL_HOOKS), self.device, self.dtype, self.buffers.put)
        self.pages = DecodePages()  # where decode steps' batched rows land on the host, across steps
        self.kv_cache: list[torch.Tensor] = []
        self.block_size = self.num_slots = 0
        # Layers that keep a state per sequence (vlens.layers.slot_states: linear attention, short convolutions): their
        # state slots, one per sequence the engine runs and as many for kept states, plus a scratch one for a static
        # decode step's padding rows; which slot a lent block table's first block holds (the BlockManager's)
        self.stateful = [m for m in model.modules() if isinstance(m, SlotStates)]
        self.state_of: dict[int, int] = {}
        self.loras: LoraSlots | None = None  # the engine's LoRA adapters (vlens.engine.lora), where it runs them
        self.scratch_state = 0
        # What runs the model's forward: the module itself (eager), or a compiled stand-in with the same
        # signature (its taps then need `self.taps.fixed_shapes`).
        self.forward = model
        self.graphs = graphs and self.device.type == "cuda"
        # fewer, fused kernels: fewer graph nodes to launch and fewer passes over activations (a prefill's elementwise
        # kernels were ~35% of an unfused harvest's GPU time, on an H200)
        chains = self.graphs or (prefills and self.device.type == "cuda")
        self.fused = chains and fused.fuse(self.device, self.dtype, activation(self.cfg.hidden_act))
        self.decode_backend = (  # (no kinds: no layer attends, a Mamba's: no kernel to try)
            DecodeBackend.for_device(self.device, self.dtype, self.kinds) if kernels and self.kinds else DecodeBackend()
        )
        self.compile_decode = compile_decode
        # on the CPU the static path pays when its attention reads the cache in place, or reads none (no graphs to
        # replay)
        reads_in_place = self.device.type == "cpu" and (self.decode_backend.paged is not None or not self.kinds)
        self.static_decode = self.graphs or compile_decode or reads_in_place
        # Batch and pages padded to power-of-two buckets: one graph or compile serves many steps. Not otherwise:
        # on the CPU a padding row costs what a real one does (a batch of 33 would compute 64 rows).
        self.pad_decode = self.graphs or compile_decode
        self.graph_stats = GraphStats()
        self._sdpa = SdpaBackend()
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._compiled: dict[tuple, Callable] = {}
        self._signed: tuple[tuple, tuple] = ((), ())  # ((armed version, addresses), the armed taps' _signature)
        self._pool = None

    # -- set-up ---------------------------------------------------------------------------------------

    @staticmethod
    def bytes_per_block(model: DecoderLM, block_size: int) -> int:
        """Keys and values of `block_size` tokens in every layer, as this rank caches them (its heads)."""
        itemsize = model.lm_head.weight.element_size()
        owners = [a for a in model.attention_layers() if a.reads_kv_of is None]  # (shared layers cache nothing)
        return sum(2 * block_size * a.num_kv_heads * a.head_dim for a in owners) * itemsize

    @staticmethod
    def bytes_per_state(model: DecoderLM) -> int:
        """One state slot of every layer that keeps states (a linear-attention layer's recurrent state, a
        convolution's last inputs)."""
        dtype = model.lm_head.weight.dtype
        shapes = [s for m in model.modules() if isinstance(m, SlotStates) for s in m.slot_shapes().values()]
        return sum(math.prod(shape) * (kind or dtype).itemsize for shape, kind in shapes)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int, num_states: int = 0) -> None:
        """The cache of `num_blocks` blocks, plus one scratch block that no sequence owns: the padding rows of
        a static decode step write and read it; and `num_states` state slots of the layers that keep states, plus
        a scratch one. Graphs of the plain decode step are captured here."""
        self.block_size, self.scratch_block = block_size, num_blocks
        self.num_slots = (num_blocks + 1) * block_size
        # one [2, slots, kv_heads, head_dim] a layer (Gemma 4's full layers have heads of their own size), bound to
        # that layer and to the later ones that attend to its keys and values (Gemma 4's shared layers)
        caches: dict[int, torch.Tensor] = {}
        for i, attn in enumerate(self.model.attention_layers()):
            if attn.reads_kv_of is None:
                shape = (2, self.num_slots, attn.num_kv_heads, attn.head_dim)
                caches[i] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.k_cache, attn.v_cache = caches[i if attn.reads_kv_of is None else attn.reads_kv_of]
        self.kv_cache = list(caches.values())
        self.scratch_state = num_states
        for m in self.stateful:
            for name, (shape, dtype) in m.slot_shapes().items():
                setattr(m, name, torch.zeros(num_states + 1, *shape, dtype=dtype or self.dtype, device=self.device))
        self.max_pages = bucket(max(MIN_PAGES, -(-max_model_len // block_size)))
        self.buffers.reserve("block_tables", self.max_bucket * self.max_pages, torch.long)
        self.buffers.reserve("context_lens", self.max_bucket, torch.long)
        if self.graphs:
            started = time.perf_counter()
            size = self.max_bucket
            with torch.inference_mode():  # as every step runs (the compiled chains are specialised on it)
                while size >= 1:  # largest first, so the smaller graphs fit in its memory pool
                    self._static_forward([], [], size, MIN_PAGES, StepPlan(), None)
                    size //= 2
            self.graph_stats.graph_steps = 0  # (each capture replayed once: not a step)
            log.info("captured %d decode graphs (batch buckets 1..%d, %d pages) in %.2f s", self.graph_stats.graphs_captured,
                     self.max_bucket, MIN_PAGES, time.perf_counter() - started)  # fmt: skip

    # -- the one forward -------------------------------------------------------------------------------

    def check_thread(self) -> None:
        """A served model runs from the server's thread alone: a forward from another thread at the same time (a
        notebook's LLM.generate or trace on the LLM it serves) would break both (they share the step's buffers and
        the forward context)."""
        if self.served_by is not None and threading.current_thread() is not self.served_by:
            raise RuntimeError("this LLM is being served (vlens.server): its requests go through the server; "
                               "build another LLM to run requests here meanwhile")  # fmt: skip

    def _forward(
        self, meta: AttentionMetadata, ids: torch.Tensor, taps: dict[str, Tap], num_layers: int | None = None,
        logit_rows: torch.Tensor | slice | None = None, backend=None, forward: Callable | None = None,
        embeds: tuple[torch.Tensor, ...] | None = None, compiled: Callable | None = None,
        lora: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """(residual stream or final-normed hidden, logits of `logit_rows` or None), with the context set.
        `forward`: what stands in for the model's (one from a layer on); `embeds`: ForwardContext's; `lora`: each
        row's LoRA slot (max_loras: none), put; `compiled`: a compiled decode step, ids -> every row's logits, in
        place of the forward and its unembedding (the hidden is then None)."""
        self.check_thread()
        backend = backend or self.backend
        if meta.key_limits is not None and not isinstance(backend, SdpaBackend):  # (the one backend whose masks
            backend = self._sdpa  # take keys past a query's position: a prefill step with a both-ways image)
        self.buffers.flush()  # what the step put, in one copy, before anything on the device reads it
        adapted = None  # (ForwardContext.lora: one-hot rows, all zero where a row's request has no adapter; made by a
        # comparison, which no check of the values syncs, inside a graph's capture too)
        if lora is not None:
            slots = torch.arange(self.loras.max_loras, device=lora.device)
            adapted = (lora[:, None] == slots).to(self.dtype)
        state = backend.prepare(meta, self.kinds, self.dtype)
        if self.stateful:  # (the other ranks allocate as many slots; linear attention's chunks, where some sequence
            # feeds several rows)
            meta.num_states = self.scratch_state
            if ids.shape[0] > len(meta.query_lens):
                meta.linear_chunks = chunk_layout(meta.query_lens, self.device)
        failed = None
        try:  # from the launch on: the other ranks may be in the forward's collectives
            if self.model.executor is not None:  # the other tensor-parallel ranks run this same forward
                self.model.executor.launch(meta, ids, taps, num_layers, logit_rows, backend is self.decode_backend,
                                           embeds, lora)  # fmt: skip
            self._copy_states(meta)
            fused = self.fused and not torch.is_grad_enabled()  # (a forward keeping a graph runs unfused: eager)
            set_context(ForwardContext(meta, backend, state, shard_taps(taps, self.cfg), fused, embeds=embeds,
                                       lora=adapted))  # fmt: skip
            hidden, logits = None, None
            if compiled is not None:
                logits = compiled(ids)
            else:
                if forward is None:
                    forward = self.forward if num_layers is None else partial(self.model, num_layers=num_layers)
                hidden = forward(ids)
                if isinstance(logit_rows, slice):
                    logits = self.model.logits(hidden[logit_rows])
                elif logit_rows is not None:
                    logits = self.model.logits(hidden.index_select(0, logit_rows))
        except HookFailed as e:  # every rank left the forward at the same hook: the group is in step
            failed = e
        except BaseException:
            if self.model.executor is not None:  # the other ranks may wait in a collective this one left
                self.model.executor.close()
            raise
        finally:
            set_context(None)
        if failed is not None:  # rank 0: the hook function's own exception (a worker: `Worker.run` ends here)
            raise failed if failed.error is None else failed.error
        return hidden, logits

    # -- engine steps ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> StepOutput:
        if self.static_decode and len(scheduled) <= self.max_bucket and all(_decodes(s, n) for s, n in scheduled):
            return self._decode(scheduled)
        self.graph_stats.eager_steps += 1
        put = self.buffers.put
        # decodes first, then prefill chunks, each longest context first, so that the SDPA backend's grids
        # stay dense (vlens.attention.sdpa._group; a fresh prompt's context is its length)
        order = sorted(((s, n) for s, n in scheduled if n == 1), key=lambda c: -c[0].num_computed)
        order += sorted(((s, n) for s, n in scheduled if n > 1), key=lambda c: -c[0].num_computed - c[1])
        tables = [s.block_table for s, _ in order]
        meta = layout(
            [s.num_computed for s, _ in order], [n for _, n in order], [len(s.token_ids) for s, _ in order],
            tables, self.block_size, self.num_slots, put, state_slots=self._seq_states([s for s, _ in order]),
        )  # fmt: skip
        if self.stateful:
            self._kept_states(meta, [s for s, _ in order])
            self._marks(meta, [s for s, _ in order], [s.num_computed for s, _ in order])
        if self.cfg.mrope_section:
            self._rope_positions(meta, [(s.num_computed, n) for s, n in order], [s.images for s, _ in order])
        fed = chain.from_iterable(s.token_ids[s.num_computed : s.num_computed + n] for s, n in order)  # (in C)
        ids = put("input_ids", np.fromiter(fed, np.int64))
        borrows = [s.borrow for s, _ in order if s.borrow is not None and s.borrow.copy_to]
        if borrows:
            src = put("kv_copy_from", np.array([slot for b in borrows for slot in b.copy_from], np.int64))
            meta.kv_copy = (src, put("kv_copy_to", np.array([slot for b in borrows for slot in b.copy_to], np.int64)))
        chunks, sample_rows, sampled, prompt_rows, images, row = [], [], [], PromptRows(), [], 0
        for seq, n in order:
            if seq.num_computed + n == len(seq.token_ids) and not seq.prefill_only:
                sample_rows.append(row + n - 1)
                sampled.append(seq)
            prompt_rows.add(seq, n, row)
            if seq.taps.streams or seq.taps.interventions:
                limits = None if seq.images is None else seq.images.limits(seq.num_computed, n)
                chunks.append(Chunk(seq.taps, seq.token_ids, seq.num_computed, n, row, seq.block_table, limits))
            if seq.images is not None:
                images.append((seq.images, seq.num_computed, n, row))
            row += n
        embeds = self._image_rows(meta, images, lambda: [(s.num_computed, n) for s, n in order]) if images else None
        plan = plan_step(chunks, self.block_size, self.pages)
        logit_rows, sample_index = plan.logit_rows(sample_rows + prompt_rows.rows)  # sampled rows, then prompt rows
        depths = [s.depth for s, _ in order]
        # A step of prefill-only requests stops after the deepest layer they read (eagerly: it is rare).
        num_layers = None if None in depths else max(depths)
        rows = put("logit_rows", np.array(logit_rows, np.int64)) if logit_rows else None
        index = put("sample_index", np.array(sample_index, np.int64)) if sample_index is not None else None
        batch = SamplingBatch.of(sampled, put, self.device) if sampled else None
        lora = self._lora_rows(order) if self._adapted(s for s, _ in order) else None
        _, logits = self._forward(meta, ids, self.taps.arm(plan) if plan else {}, num_layers, rows, embeds=embeds,
                                  lora=lora)  # fmt: skip
        if index is not None:
            logits = logits.index_select(0, index)
        collection = self.taps.collect(plan) if plan.gathers else None
        prompt_logprobs = None
        if prompt_rows.rows:  # on their way to the host before the step's sync (blocking when none comes)
            prompt_logprobs = prompt_rows.compute(logits[len(sample_rows) :], blocking=not sampled)
        out = StepOutput(scheduled, sampled, None, None, plan, collection, prompt_rows, prompt_logprobs)
        return self._sample(out, logits[: len(sample_rows)], batch) if sampled else out

    def _adapted(self, seqs: Iterable[Sequence]) -> bool:
        """Whether some sequence of a step runs under a LoRA adapter (never asked per sequence without enable_lora)."""
        return self.loras is not None and any(s.lora_slot is not None for s in seqs)

    def _lora_rows(self, order: list[tuple[Sequence, int]], pad: int = 0) -> torch.Tensor:
        """Each row's LoRA slot (max_loras where its request has no adapter, and in `pad` rows more), put for the
        step's forward."""
        none = self.loras.max_loras
        slots = np.repeat([none if s.lora_slot is None else s.lora_slot for s, _ in order], [n for _, n in order])
        return self.buffers.put("lora_slots", np.concatenate([slots, np.full(pad, none)]).astype(np.int64))

    def _image_rows(
        self, meta: AttentionMetadata, pieces: list[tuple[PromptImages, int, int, int]],
        spans: Callable[[], list[tuple[int, int]]],
    ) -> tuple[torch.Tensor, ...] | None:  # fmt: skip
        """ForwardContext.embeds of a forward: its rows that are an image's (vlens.images) and what the model reads
        there in place of their tokens' embedding (and, Qwen3-VL's, adds after its first layers); None without
        any. `pieces`: per sequence with images, (its images, the prompt position its rows start at, how many, the
        forward's row they start at). Where an image's tokens attend to each other both ways (Gemma 3's),
        `meta.key_limits` says how far each row sees (`spans`: every sequence's (first position, rows) in the
        forward, asked for then alone)."""
        found = [(images.within(start, n), row) for images, start, n, row in pieces]
        found = [(at + row, *rest) for given, row in found if given is not None for at, *rest in [given]]
        if not found:
            return None
        limits = [(row, images.limits(start, n)) for images, start, n, row in pieces]
        if any(lim is not None for _, lim in limits):
            meta.key_limits = np.concatenate([np.arange(start, start + n) for start, n in spans()])
            for row, lim in limits:
                if lim is not None:
                    meta.key_limits[row : row + len(lim)] = lim
        rows = self.buffers.put("image_rows", np.concatenate([at for at, _, _ in found]))
        features = torch.cat([f for _, f, _ in found]).to(self.device, non_blocking=True)  # (from the host)
        if found[0][2] is None:
            return rows, features
        return rows, features, torch.cat([deep for _, _, deep in found], dim=1).to(self.device, non_blocking=True)

    def _rope_positions(
        self, meta: AttentionMetadata, spans: list[tuple[int, int]], images: list[PromptImages | None],
        always: bool = False,
    ) -> None:  # fmt: skip
        """meta.rope_positions of a model whose rotary reads three positions a row (M-RoPE: its callers ask), where a
        sequence of the forward has images (`spans`: each sequence's first position and rows; `images`: its images or
        None), or `always` (a static decode step, whose graph or compiled forward reads the buffer whatever its
        sequences)."""
        if not (always or any(i is not None for i in images)):
            return
        starts, lens = (np.fromiter(column, np.int64, len(spans)) for column in zip(*spans))
        first = np.cumsum(lens) - lens  # each sequence's first row
        seq = np.repeat(np.arange(len(spans)), lens)
        three = np.tile(starts[seq] + np.arange(len(seq)) - first[seq], (3, 1))  # (a text's three: its position)
        for k in (k for k, i in enumerate(images) if i is not None):
            three[:, first[k] : first[k] + lens[k]] = images[k].rope_positions(starts[k], lens[k])
        meta.rope_positions = self.buffers.put("rope_positions", three)

    def _sample(self, out: StepOutput, logits: torch.Tensor, batch: SamplingBatch) -> StepOutput:
        """`batch` was put before the forward, so the step's inputs went to the device in one copy."""
        out.tokens = sample(logits, batch)
        out.adjusted = batch.adjust is not None
        k = max((s.logprobs_k for s in out.sampled if s.logprobs_k is not None), default=None)
        if k is not None:
            out.logprobs = to_host(top_logprobs(logits, out.tokens, k), blocking=False)
        if out.tokens.is_cuda:
            host = torch.empty(out.tokens.shape, dtype=out.tokens.dtype, pin_memory=True)
            host.copy_(out.tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            out.arriving = (host, event)
        return out

    # -- the static decode step ----------------------------------------------------------------------

    def _decode(self, scheduled: list[tuple[Sequence, int]]) -> StepOutput:
        """Every sequence feeds its last token and samples: padded to its bucket, a graph replays it."""
        return self._static_step([s for s, _ in scheduled], ahead=None)

    @torch.inference_mode()
    def run_ahead(self, previous: StepOutput, keep: list[int]) -> StepOutput:
        """The next decode step of the sequences `previous.sampled[i]` for i in `keep`, queued before
        `previous`'s ids reach the host: each feeds the token `previous` sampled for it, read on the device,
        at the position after its last known token (whose blocks the caller reserved). The host plans it
        while the device still runs `previous` — what keeps a GPU busy when the host's step is as long as
        the device's. Its sequences' sampling must not read their history (no penalties or biases)."""
        self.graph_stats.ahead_steps += 1
        return self._static_step([previous.sampled[i] for i in keep], ahead=(previous.tokens, keep))

    def _static_step(self, seqs: list[Sequence], ahead: tuple[torch.Tensor, list[int]] | None) -> StepOutput:
        """`ahead`: (device ids of the previous step, which of them each sequence feeds), when each
        sequence's last token is still on the device (one more than `token_ids` holds)."""
        extra = 0 if ahead is None else 1
        last = [len(s.token_ids) - 1 + extra for s in seqs]  # each row's position
        size, pages = len(seqs), -(-(max(last) + 1) // self.block_size)
        if self.pad_decode:
            size, pages = bucket(size), min(self.max_pages, bucket(max(MIN_PAGES, pages)))
        plan = plan_decode(seqs, last, self.block_size, self.pages)
        plan.logit_rows(list(range(len(seqs))))  # every row samples: a LOGITS gather keeps its rows
        batch = SamplingBatch.of(seqs, self.buffers.put, self.device, extra)
        logits = self._static_forward(seqs, last, size, pages, plan, ahead)[: len(seqs)]
        collection = self.taps.collect(plan) if plan.gathers else None
        out = StepOutput([(s, 1) for s in seqs], seqs, None, None, plan, collection, PromptRows(), decode=True)
        return self._sample(out, logits, batch)

    def _static_forward(
        self, seqs: list[Sequence], last: list[int], size: int, pages: int, plan: StepPlan,
        ahead: tuple[torch.Tensor, list[int]] | None,
    ) -> torch.Tensor:  # fmt: skip
        """Logits [size, vocab] of the static decode step of `seqs` at positions `last`, padded to `size`
        rows and `pages` pages."""
        put, pad, generation = self.buffers.put, size - len(seqs), self.buffers.generation
        tables = [s.block_table for s in seqs]
        states = None if not self.stateful else self._seq_states(seqs) + [self.scratch_state] * pad
        meta = layout(
            last + [0] * pad, [1] * size, [p + 1 for p in last] + [1] * pad, tables + [[self.scratch_block]] * pad,
            self.block_size, self.num_slots, put, pages, states,
        )  # fmt: skip
        if self.cfg.mrope_section:  # (its graph or compiled forward reads the buffer whatever the step's sequences)
            self._rope_positions(meta, [(p, 1) for p in last] + [(0, 1)] * pad, [s.images for s in seqs] + [None] * pad,
                                 always=True)  # fmt: skip
        if self.stateful:
            self._marks(meta, seqs, last)
        if ahead is None:
            ids = put("input_ids", np.array([s.token_ids[-1] for s in seqs] + [0] * pad, np.int64))
        else:
            ids, fed = put("input_ids", np.zeros(size, np.int64)), put("ahead_rows", np.array(ahead[1], np.int64))
        # (an adapter's rows: a graph and a compiled forward of their own, over the LoRA stacks there are then)
        lora, adapted = None, None
        if self._adapted(seqs):
            lora, adapted = self._lora_rows([(s, 1) for s in seqs], pad), len(self.loras.stacks)
        taps = self.taps.arm(plan, fixed_shapes=True if self.pad_decode else None) if plan else {}
        self.buffers.flush()
        if ahead is not None:  # the previous step's samples, copied on the device behind its sampling
            ids[: len(seqs)] = ahead[0].index_select(0, fed)
        # A buffer that grew while this step was put moved them all to a new block, and this step's inputs
        # are in the old one, which no graph may capture: later replays would read it after it is freed.
        if self.graphs and self.buffers.generation == generation:
            self._copy_states(meta)  # (outside the graph: which states are copied changes step by step)
            meta.state_copies = None
            key = (size, pages, generation, self._signature(taps), adapted)
            entry = self._graphs.pop(key, None)  # (put back last: the dict runs from least to most recently used)
            if entry is None:
                for stale in [k for k in self._graphs if k[2] != generation]:  # (over buffers since moved)
                    del self._graphs[stale]
                if len(self._graphs) >= MAX_GRAPHS:  # the least recently used goes; its memory returns to the pool
                    del self._graphs[next(iter(self._graphs))]
                # (a capture runs the step once before its replay does: the states that run advances go back)
                held = [(state, state[meta.state_slots].clone()) for state in self._states()]
                try:
                    entry = self._capture(meta, ids, taps, lora)
                except RuntimeError as e:  # what a graph cannot hold runs as it would without graphs
                    log.warning("CUDA graph capture failed, decode steps run eagerly from now on: %s", e)
                    self.graphs = False
                for state, before in held:
                    state[meta.state_slots] = before
            if entry is not None:
                self._graphs[key] = entry
                graph, logits = entry
                graph.replay()
                self.graph_stats.graph_steps += 1
                return logits
        if self.compile_decode:
            key = (size, pages, self._signature(taps, addresses=False), adapted)
            if key in self._compiled or len(self._compiled) < MAX_GRAPHS:  # (past that, new shapes run eagerly)
                return self._compiled_step(meta, ids, taps, key, lora)
        self.graph_stats.static_eager_steps += 1
        return self._forward(meta, ids, taps, None, slice(None), self.decode_backend, lora=lora)[1]

    def _signature(self, taps: dict[str, Tap], addresses: bool = True) -> tuple:
        """`_signature` of the static step's armed `taps`, made again only when the runtime armed new ones: a step
        that repeats the one before has its taps (~10 us a step that captures, in the engine)."""
        if not taps:
            return ()
        key = (self.taps.armed_version, addresses)
        if self._signed[0] != key:
            self._signed = (key, _signature(taps, addresses))
        return self._signed[1]

    def _compiled_step(
        self, meta: AttentionMetadata, ids: torch.Tensor, taps: dict[str, Tap], key: tuple, lora: torch.Tensor | None
    ) -> torch.Tensor:  # fmt: skip
        """Logits of the static decode step through the forward compiled for `key` (shapes and taps), compiled
        at its first step. Like a CUDA graph, each compiled forward serves one key and checks nothing when
        called: dynamo's guards (every weight, buffer and tap, ~60 us a call on a small model) are skipped, so
        each key compiles its own copy of the forward's code (dynamo keeps compiled code per code object, and
        a copy of the code is a new object), never a neighbour's graph. The code that calls the compiled kernels is
        C++ (inductor's `cpp_wrapper`): its Python version was most of a small model's compiled step (~0.25 ms at
        batch 8 of a 2-layer model; ~0.05 ms a step less at batch 64, for a second or so more of each compile)."""
        stats, compiled = self.graph_stats, self._compiled.get(key)
        started, new = time.perf_counter(), compiled is None
        if new:
            compiled = self._compiled[key] = torch.compile(
                types.MethodType(own_copy(type(self.model).forward_logits), self.model), fullgraph=True, dynamic=False,
                options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe, "cpp_wrapper": True},
            )  # fmt: skip
            stats.compiles += 1
        try:
            logits = self._forward(meta, ids, taps, None, slice(None), self.decode_backend, compiled=compiled,
                                   lora=lora)[1]  # fmt: skip
        except Exception as e:  # noqa: BLE001 - (only a first call: a compile this machine cannot make)
            if not new:
                raise
            # The step reruns eagerly: what the failed call wrote (its KV slots, its tap rows) is written again.
            log.warning("compiling the decode step failed, decode steps run eagerly from now on: %s", e)
            del self._compiled[key]
            self.compile_decode = False
            stats.static_eager_steps += 1
            return self._forward(meta, ids, taps, None, slice(None), self.decode_backend, lora=lora)[1]
        if new:  # (the compile happens in the first call)
            stats.compile_seconds += time.perf_counter() - started
            gc.freeze()  # what the compile made lives as long as the runner: out of the collector's walks (LLMEngine)
        stats.compiled_steps += 1
        return logits

    def _capture(
        self, meta: AttentionMetadata, ids: torch.Tensor, taps: dict[str, Tap], lora: torch.Tensor | None
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A graph of the static forward over these buffers, and its logits (captured in the pool every graph
        of the runner shares)."""
        started = time.perf_counter()
        run = partial(self._forward, meta, ids, taps, None, slice(None), self.decode_backend, lora=lora)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up outside the capture (lazy inits, allocator)
            run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # (the capture stream torch.cuda.graph makes is the current device's, which may be another model's)
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self._pool):
            _, logits = run()
        self._pool = graph.pool()
        stats = self.graph_stats
        stats.graphs_captured += 1
        stats.capture_seconds += time.perf_counter() - started
        return graph, logits

    # -- cache-less packed forwards: trace, HookedLM, harvest ------------------------------------------------

    def packed(
        self, sequences: list[list[int]], taps: list[str], rows: list[torch.Tensor] | None = None,
        hooks: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None, grad: bool = False,
        interventions: list[BoundIntervention] | None = None, images: list[PromptImages | None] | None = None,
        lora_slot: int | None = None,
    ) -> PackedCapture:  # fmt: skip
        """Run `sequences` as one packed batch and capture `taps` (canonical names) at `rows[i]` of
        sequence i (default: every position); `images[i]`: the rows sequence i's images give (vlens.images);
        `lora_slot`: the LoRA adapter's (vlens.engine.lora) every sequence runs under.
        `hooks` are user functions run at their taps before the capture sees the value (HookedLM.run_with_hooks:
        the one eager path that runs user Python in a forward),
        and after the edits of `interventions` (uploaded; applied to every sequence, as a harvest's are).
        `grad`: outside inference mode, so what the hooks start an autograd graph from (HookedLM's backward
        hooks) can be differentiated, with the sdpa backend, the exact reference, which has a backward on every
        device (FlashInfer's kernels have none); the captures are detached either way."""
        if grad and self.model.executor is not None:
            raise ValueError("gradients: a forward with an autograd graph runs in one process (tensor_parallel_size=1)")
        lens = [len(s) for s in sequences]
        limits = [None if i is None else i.limits(0, n) for i, n in zip(images, lens)] if images else None
        plan = packed_plan(lens, taps, rows, interventions or (), limits)
        with torch.inference_mode(not grad):
            armed = self.taps.arm(plan)
            for name, fn in (hooks or {}).items():
                tap = armed.get(name)
                if tap is None:
                    armed[name] = fn
                elif name in plan.edits:  # (no caller gathers where it edits and hooks: harvest has no taps)
                    armed[name] = _then(tap, fn)
                else:
                    armed[name] = _then(fn, tap)
            sites = [*taps, *(hooks or {})]
            meta = layout([0] * len(lens), lens, lens, None, 0, 0, self.buffers.put)
            if self.cfg.mrope_section and images:
                self._rope_positions(meta, [(0, n) for n in lens], images)
            ids = self.buffers.put("input_ids", np.fromiter(chain.from_iterable(sequences), np.int64))
            backend = SdpaBackend() if grad and not isinstance(self.backend, SdpaBackend) else None
            logit_rows = slice(None) if LOGITS in sites else None
            starts = np.cumsum([0, *lens[:-1]]).tolist()
            pieces = [(i, 0, n, row) for i, n, row in zip(images or [], lens, starts) if i is not None]
            embeds = self._image_rows(meta, pieces, lambda: [(0, n) for n in lens]) if pieces else None
            lora = None if lora_slot is None else self.buffers.put("lora_slots", np.full(sum(lens), lora_slot))
            self._forward(meta, ids, armed, forward_depth(sites, self.cfg), logit_rows, backend=backend, embeds=embeds,
                          lora=lora)  # fmt: skip
            return PackedCapture(plan, self.taps.collect(plan))

    @torch.inference_mode()
    def extend(
        self, sequences: list[list[int]], starts: list[int], tables: list[list[int]],
        hooks: dict[str, Callable[[torch.Tensor], torch.Tensor]], every_row: bool = False,
        resume: tuple[int, torch.Tensor] | None = None, kv_copy: tuple[list[int], list[int]] | None = None,
        num_layers: int | None = None, images: list[PromptImages | None] | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        """Logits [B, vocab] of each sequence's last token (`every_row`: [new tokens, vocab], of each one),
        from a forward of its tokens after `starts[i]` whose keys and values go to the cache blocks
        `tables[i]` (holding those of the tokens before), `hooks` run at their taps: HookedLM.generate's steps
        with hook functions and a KV cache, each forward seeing only the new tokens, as TransformerLens's
        use_past_kv_cache does; and vlens.patching's copies of a run, which also start at a layer (`resume`:
        the layer and the stream entering it, DecoderLM.forward's `start`) and first copy cache slots
        (`kv_copy`: from, to) where a copy's first block shares keys of the run it copies. `num_layers`: run
        that many layers and no unembedding (None back): a forward only its hooks read (path patching's).
        `images[i]`: the rows sequence i's images give, read where its new tokens reach them (vlens.images)."""
        if resume is not None and self.model.executor is not None:
            raise ValueError("resume: a forward from a layer on runs in one process (tensor_parallel_size=1)")
        lens = [len(s) for s in sequences]
        new = [n - b for n, b in zip(lens, starts)]
        put = self.buffers.put
        meta = layout(starts, new, lens, tables, self.block_size, self.num_slots, put, None, self._state_slots(tables))
        if self.cfg.mrope_section and images:
            self._rope_positions(meta, list(zip(starts, new)), images)
        if kv_copy is not None:
            source, target = (np.asarray(slots, np.int64) for slots in kv_copy)
            meta.kv_copy = (put("kv_copy_from", source), put("kv_copy_to", target))
        ids = put("input_ids", np.fromiter(chain.from_iterable(s[b:] for s, b in zip(sequences, starts)), np.int64))
        last = np.cumsum(new) - 1
        # (a hook at the logits sees every new token's, as at every other tap: the last ones are picked after it)
        every = every_row or LOGITS in hooks
        rows = None if num_layers is not None else slice(None) if every else put("logit_rows", last)
        forward = None if resume is None else partial(self.model, start=resume, num_layers=num_layers)
        rows_from = np.cumsum([0, *new[:-1]]).tolist()
        pieces = [(i, b, n, row) for i, b, n, row in zip(images or [], starts, new, rows_from) if i is not None]
        embeds = self._image_rows(meta, pieces, lambda: list(zip(starts, new))) if pieces else None
        _, logits = self._forward(meta, ids, dict(hooks), num_layers, rows, forward=forward, embeds=embeds)
        if every and not every_row and logits is not None:
            logits = logits.index_select(0, torch.as_tensor(last, device=logits.device))
        return logits

    # -- the memory profile --------------------------------------------------------------------------

    @torch.inference_mode()
    def profile(self, tokens: int, logit_rows: int) -> None:
        """One forward of `tokens` dummy tokens with the logits of `logit_rows` rows: the largest step the
        engine's limits allow, run before the KV cache exists to measure its peak memory."""
        meta = layout([0], [tokens], [tokens], None, 0, 0, self.buffers.put)
        ids = self.buffers.put("input_ids", np.zeros(tokens, np.int64))
        self._forward(meta, ids, {}, None, slice(-logit_rows, None))

    def _states(self) -> list[torch.Tensor]:
        """Every state tensor of the layers that keep states per sequence (none before the cache is allocated)."""
        return [getattr(m, name) for m in self.stateful for name in m.slot_shapes() if getattr(m, name) is not None]

    def _state_slots(self, tables: list[list[int]]) -> list[int] | None:
        """The state slot of each lent block table (its first block's), where the model has layers that keep
        states."""
        return [self.state_of[table[0]] for table in tables] if self.stateful else None

    def _seq_states(self, seqs: list[Sequence]) -> list[int] | None:
        """The state slot of each sequence, where the model has layers that keep states."""
        return [s.state_slot for s in seqs] if self.stateful else None

    def _marks(self, meta: AttentionMetadata, seqs: list[Sequence], starts: list[int]) -> None:
        """Each sequence whose step starts at a block boundary (past SNAPSHOT_BLOCKS blocks) copies its state there to
        its mark slot first, which it leaves as a prefix's kept state when it ends (vlens.engine.block_manager)."""
        at = np.asarray(starts, np.int64)
        moves = []
        for i in np.flatnonzero((at % self.block_size == 0) & (at >= SNAPSHOT_BLOCKS * self.block_size)).tolist():
            s = seqs[i]  # (a step of a sequence at a boundary: one in block_size steps of its decode)
            if s.state_mark is not None and at[i] > s.marked_at and s.state_source is None:
                moves.append((s.state_slot, s.state_mark))
                s.marked_at = int(at[i])
        if moves:
            put = self.buffers.put
            src, dst = (np.asarray(x, np.int64) for x in zip(*moves))
            meta.state_copies = (put("state_copy_from", src), put("state_copy_to", dst))

    def _copy_states(self, meta: AttentionMetadata) -> None:
        """The step's state copies (`_marks`), before its forward advances the states."""
        if meta.state_copies is not None:
            src, dst = meta.state_copies
            for state in self._states():
                state.index_copy_(0, dst, state.index_select(0, src))

    def _kept_states(self, meta: AttentionMetadata, seqs: list[Sequence]) -> None:
        """The slots of cached prefixes' states that chunks start from, and those their states are kept in
        (vlens.engine.block_manager), where a sequence has either."""
        put = self.buffers.put
        if any(s.state_source is not None for s in seqs):
            sources = [s.state_slot if s.state_source is None else s.state_source for s in seqs]
            meta.state_sources = put("state_sources", np.asarray(sources, np.int64))
        saves = [(i, s.state_save) for i, s in enumerate(seqs) if s.state_save is not None]
        if saves:
            rows, slots = (np.asarray(x, np.int64) for x in zip(*saves))
            meta.state_saves = (put("state_save_rows", rows), put("state_save_slots", slots))


def _decodes(seq: Sequence, n: int) -> bool:
    """Whether a scheduled chunk is a plain decode: its last token, sampled, after it generated before (so
    no prompt rows, no borrowed prefix, the whole model)."""
    return (
        n == 1 and seq.num_generated > 0 and seq.num_computed + 1 == len(seq.token_ids)
        and seq.state_source is None  # (a chunk from a cached prefix's state reads another slot: not graph-shaped)
    )  # fmt: skip


def _signature(taps: dict[str, Tap], addresses: bool = True) -> tuple:
    """What a captured graph bakes in of the armed taps: which sites, and the address, shape, strides and
    kind of every buffer they read or write (a buffer that grew is a new graph). A compiled forward takes
    the buffers as inputs: without `addresses`, only what its code depends on."""
    out = []
    for name, t in sorted(taps.items()):
        for attr in type(t).__slots__:  # (vlens.capture.runtime.Tap)
            value = getattr(t, attr)
            if isinstance(value, torch.Tensor):
                where = value.data_ptr() if addresses else value.dtype
                out.append((name, attr, where, tuple(value.shape), value.stride()))
            elif attr == "table" and value is not None:
                tensors = (value.data, value.mask, value.encoder, value.params, value.sources)
                out.append((name, attr, *(x.data_ptr() if addresses else tuple(x.shape) for x in tensors)))
            elif attr == "feeds" and value:  # (the taps it feeds are the runtime's: one object per site)
                out.append((name, attr, tuple(id(fed) for fed in value)))
            elif isinstance(value, (bool, int)):  # (`clamps`, `softmax`, a feeding tap's `source`)
                out.append((name, attr, value))
    return tuple(out)


def _then(first: Callable, second: Callable) -> Callable:
    return lambda x: second(first(x))
