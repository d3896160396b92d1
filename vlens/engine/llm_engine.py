"""The engine loop: validate and queue requests, schedule, run a step, and report what each request
got from it as a delta — its new tokens and text, its finish, and on finishing its whole output with
the captured rows. `LLM.generate` and the server consume the same deltas; nothing outside the engine
touches its sequences, scheduler or blocks. One step serves prefill chunks and decodes of many
requests at once. A request is a group of samples (n, best_of: group.py) of one prompt; a request with
max_tokens=0 only reads its prompt (prompt log-probabilities, captured rows) and ends after prefill."""

from __future__ import annotations

import gc
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from vlens.capture.bind import bind_request
from vlens.capture.names import FINAL_NORM, request_shapes
from vlens.capture.plan import StepPlan
from vlens.capture.positions import rows_of
from vlens.capture.runtime import Collection
from vlens.engine.block_manager import BlockManager
from vlens.engine.config import EngineConfig
from vlens.engine.detokenizer import Detokenizer, text_of
from vlens.engine.group import SampleGroup
from vlens.engine.logprobs import TokenText, entry
from vlens.engine.lora import LoRARequest, LoraSlots
from vlens.engine.memory import kv_cache_bytes
from vlens.engine.model_runner import ModelRunner, StepOutput
from vlens.engine.penalties import spell_bad_words
from vlens.engine.scheduler import Scheduler
from vlens.engine.sequence import Sequence, Status
from vlens.engine.structured import Grammars
from vlens.images import PromptImages
from vlens.inputs import truncated
from vlens.outputs import CompletionOutput, PlaceholderRange, RequestDelta, RequestMetrics, RequestOutput
from vlens.reasoning import PARSERS as REASONING_PARSERS
from vlens.reasoning import ThinkingEnd
from vlens.sampling_params import SamplingParams

log = logging.getLogger("vlens.engine")


@dataclass(frozen=True)
class EngineStats:
    """What the engine's gauges and counters read, in one snapshot (the server's /metrics)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    prompt_tokens: int  # of requests accepted so far
    generation_tokens: int  # sampled so far
    tokens_computed: int  # fed through the model so far (prefill chunks, decodes, recomputes)
    num_preemptions: int
    attention_backend: str  # the backend's name (what "auto" chose)
    graph_steps: int = 0  # decode steps replayed from a CUDA graph
    static_eager_steps: int = 0  # decode steps on the static path without a graph (CPU, or graphs off)
    eager_steps: int = 0  # steps a graph cannot serve: prefill, chunked prefill, prompt log-probabilities
    graphs_captured: int = 0
    graph_capture_seconds: float = 0.0
    compiled_steps: int = 0  # decode steps run by a forward compiled for their shape (compile_decode, CPU)
    decode_compiles: int = 0
    decode_compile_seconds: float = 0.0
    ahead_steps: int = 0  # decode steps queued before the previous step's ids reached the host
    repeated_steps: int = 0  # decode steps planned as the one before, one position on: no work per request
    kept_states: int = 0  # prefixes' states kept for later prompts (a model whose layers keep states per sequence)
    prefix_cache_queries: int = 0  # tokens of sequences admitted so far ...
    prefix_cache_hits: int = 0  # ... and of those, what the prefix cache gave
    # LoRA adapters (enable_lora): how many slots, and the adapters of running and of waiting requests, by name
    max_loras: int = 0
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / max(1, self.kv_blocks_used + self.kv_blocks_free)


@dataclass(frozen=True)
class NewRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, when the request came as one
    stream: bool = False  # report text as it grows, not only at the end
    images: PromptImages | None = None  # the rows its images give (vlens.images)
    lora: LoRARequest | None = None  # the LoRA adapter it runs under (vlens.engine.lora)
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share cached prefixes
    priority: int = 0  # vLLM's: lower runs first, under scheduling_policy="priority"


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Any, config: EngineConfig):
        model = runner.model
        cfg = model.cfg
        block_size, max_model_len = config.block_size, config.max_model_len
        per_block = ModelRunner.bytes_per_block(model, block_size)
        wanted_len = max_model_len or cfg.max_position_embeddings
        budget = kv_cache_bytes(runner, config)
        num_states = 0
        if runner.stateful:  # (layers that keep states per sequence: a slot for each sequence that may run, as many
            # again for prefixes' kept states with the prefix cache on, and a scratch one, from at most half the
            # budget, all of it where no layer caches keys: fewer slots than max_num_seqs run fewer sequences at once)
            per_state = ModelRunner.bytes_per_state(model)
            share = 2 if per_block else 1
            wanted = config.max_num_seqs * (2 if config.enable_prefix_caching else 1)
            num_states = min(wanted, budget // share // per_state - 1)
            if num_states < 1:
                where = "half of which" if per_block else "which"
                raise ValueError(f"kv_cache_memory: {budget} bytes, {where} must hold the states of two sequences "
                                 f"({per_state} bytes each)" + (" beside the KV cache" if per_block else ""))
            budget -= (num_states + 1) * per_state
            if num_states < config.max_num_seqs:
                log.info("state slots for %d sequences at once (max_num_seqs %d): %d bytes each", num_states,
                         config.max_num_seqs, per_state)  # fmt: skip
        num_blocks = config.max_num_seqs * -(-wanted_len // block_size)
        if per_block:  # (a model without attention, Mamba's, caches no keys: its blocks cost nothing, and only hold
            # its sequences' state slots)
            num_blocks = min(budget // per_block, num_blocks)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory: {budget} bytes hold fewer than 2 blocks of {per_block} bytes")
        capacity = num_blocks * block_size
        if max_model_len is not None and max_model_len > capacity:
            raise ValueError(
                f"max_model_len: {max_model_len} tokens do not fit the KV cache ({capacity} tokens); "
                "raise kv_cache_memory or lower max_model_len"
            )
        self.model, self.cfg, self.tokenizer = model, cfg, tokenizer
        self.token_text = TokenText(tokenizer)  # names log-probabilities' tokens
        self.max_model_len = min(wanted_len, capacity)
        log.info("KV cache: %d blocks of %d tokens (%d bytes); the longest sequence that fits: %d tokens",
                 num_blocks, block_size, num_blocks * per_block, self.max_model_len)  # fmt: skip
        self.enable_capture = config.enable_capture
        self.runner = runner
        runner.allocate_kv_cache(num_blocks, block_size, self.max_model_len, num_states)
        self.blocks = BlockManager(num_blocks, block_size, config.enable_prefix_caching, num_states)
        runner.state_of = self.blocks.state_of
        self.loras = LoraSlots(model, config.max_loras, config.max_lora_rank) if config.enable_lora else None
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, self.loras,
                                   by_priority=config.scheduling_policy == "priority")  # fmt: skip
        runner.loras = self.loras
        self.shapes = request_shapes(cfg)
        self.rng = random.Random(config.seed)
        self.eos_ids = frozenset(cfg.eos_token_ids) | frozenset(
            [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else []
        )
        self.grammars: Grammars | None = None  # (requests' structured outputs: made at the first)
        # a reasoning model's: its structured requests think first (vlens.reasoning)
        self.thinking_end = None if config.reasoning_parser is None else \
            ThinkingEnd.of(tokenizer, REASONING_PARSERS[config.reasoning_parser])  # fmt: skip
        self._next_id = 0
        self._requests: dict[str, SampleGroup] = {}
        self._pending: tuple[StepPlan, Collection] | None = None  # a step's rows still on their way to the host
        self.async_scheduling = config.async_scheduling
        self._ahead: StepOutput | None = None  # a decode step queued behind the last one (ModelRunner.run_ahead)
        self.prompt_tokens = self.generation_tokens = 0
        # LongRoPE's factors depend on the sequence length: a sequence whose last position reaches this
        # recomputes its cache with the long factors, as HF does (Sequence.reaches_long_rope).
        scaling = cfg.rope_scaling or {}
        self.long_rope_at = scaling.get("original_max_position_embeddings") if scaling.get("rope_type") == "longrope" else None
        # Everything alive now (modules, weights' wrappers, tokenizer) lives as long as the engine: moved out of
        # the collector's reach, the many short-lived objects of a capturing step no longer make it walk the
        # whole heap (under cProfile, with 3 captured layers at batch 64, the collector's passes showed up as
        # ~3 ms a step). A frozen object is never collected, only freed when nothing refers to it: so what a model
        # holds must not form reference cycles (vlens.hook_points.HookPoint refers to its model weakly).
        gc.freeze()

    # -- requests ---------------------------------------------------------------------------------

    def add_requests(self, requests: list[NewRequest]) -> list[str]:
        """Validate every request against the model, then queue all of them (none if any is refused:
        the ValueError names the field). Returns their request ids."""
        self.runner.check_thread()
        self._check_loras([r.lora for r in requests if r.lora is not None])
        requests = [self._truncated(r) for r in requests]
        groups = [self._group(r) for r in requests]
        for group, r in zip(groups, requests):
            if r.lora is not None:
                taps = group.seqs[0].taps
                self.loras.check_taps(r.lora, {t for part in (*taps.streams, *taps.interventions) for t in part.taps})
        for group, r in zip(groups, requests):
            for seq in group.seqs:
                if r.stream or seq.params.stop_list:
                    seq.detokenizer = Detokenizer(self.tokenizer, seq.token_ids, seq.params)
                seq.hold_vectors(self.runner.taps)
            self._requests[group.request_id] = group
            self.prompt_tokens += group.seqs[0].num_prompt
            self.scheduler.add(group.seqs[0])
        return [group.request_id for group in groups]

    @staticmethod
    def _truncated(r: NewRequest) -> NewRequest:
        """The request with only its prompt's last params.truncate_prompt_tokens tokens (its text is kept, as vLLM
        keeps it)."""
        ids = truncated(r.prompt_token_ids, r.params.truncate_prompt_tokens)
        if len(ids) == len(r.prompt_token_ids):
            return r
        if r.images is not None:
            raise ValueError(f"truncate_prompt_tokens: {r.params.truncate_prompt_tokens} would cut a prompt with "
                             "images, whose rows are placed by position; send it whole")  # fmt: skip
        return replace(r, prompt_token_ids=ids)

    def _check_loras(self, loras: list[LoRARequest]) -> None:
        if loras and self.loras is None:
            raise ValueError("lora_request: this engine runs no LoRA adapters; create it with LLM(..., "
                             "enable_lora=True)")  # fmt: skip
        for lora in loras:
            self.loras.read_one(lora)

    def hold_lora(self, lora: LoRARequest) -> int:
        """The slot of `lora`'s adapter, held for a forward outside the scheduler's (LLM.trace) until released."""
        self._check_loras([lora])
        slot = self.loras.acquire(lora.lora_int_id)
        if slot is None:
            raise ValueError(f"max_loras: every one of the {self.loras.max_loras} slots holds an adapter that running "
                             f"requests hold; {lora.lora_name!r} cannot be traced beside them (raise max_loras)")
        return slot

    def _group(self, r: NewRequest) -> SampleGroup:
        prompt_ids, params = r.prompt_token_ids, r.params
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens leave no room to generate within max_model_len={self.max_model_len}"
            )
        if self.cfg.no_token_logits and (params.max_tokens or params.prompt_logprobs is not None):
            field = "max_tokens" if params.max_tokens else "prompt_logprobs"
            raise ValueError(f"{field}: {self.cfg.no_token_logits}")
        if self.tokenizer is None and (r.stream or params.stop_list or params.bad_words or params.structured_outputs):
            field = next(name for name, used in [("stream", r.stream), ("stop", params.stop_list),
                                                 ("bad_words", params.bad_words), ("structured_outputs", True)] if used)
            raise ValueError(f"{field}: works on text, and this checkpoint has no tokenizer files; "
                             "use token ids (stop_token_ids, allowed_token_ids, logit_bias)")  # fmt: skip
        if r.priority and not self.scheduler.by_priority:
            raise ValueError(f"priority: {r.priority} orders requests under scheduling_policy='priority' (LLM(..., "
                             "scheduling_policy='priority'), vlens serve --scheduling-policy priority); this engine "
                             "serves them first come, first served")  # fmt: skip
        budget = self.scheduler.max_num_batched_tokens
        if r.images is not None and r.images.longest_run() > budget:
            raise ValueError(f"max_num_batched_tokens: {budget} is less than an image's "
                             f"{r.images.longest_run()} tokens, which attend to each other both ways and so take one "
                             "step together")  # fmt: skip
        bad_words = spell_bad_words(params.bad_words, self.tokenizer) if params.bad_words else []
        vocab = self.cfg.vocab_size
        # Checked here, not when a step fails on them: that step's error would end every request in the batch.
        checked = [("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or ()),
                   ("stop_token_ids", params.stop_token_ids), ("bad_words", [t for w in bad_words for t in w])]
        for name, tokens in checked:
            bad = [t for t in tokens if t >= vocab]
            if bad:
                spelt = f" (as the tokenizer spells {params.bad_words!r})" if name == "bad_words" else ""
                raise ValueError(f"{name}: token ids {bad[:5]}{spelt} outside the vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ValueError(f"{name}: {k} is more than the vocabulary's {vocab} tokens")
        request_id = str(self._next_id)
        self._next_id += 1
        first = params.seed if params.seed is not None else None
        structure = None if params.structured_outputs is None else self._grammars().compile(params.structured_outputs)
        thinks = structure is not None and self.thinking_end is not None and self.thinking_end.thinks(prompt_ids)
        after = self.thinking_end.end if thinks else None
        seqs = []
        for i in range(params.samples):
            seed = _int64(first + i) if first is not None else self.rng.randrange(2**31)
            seqs.append(self._sequence(r, request_id, i, seed))
            seqs[-1].bad_words_ids = bad_words
            if structure is not None:
                seqs[-1].grammar = self.grammars.matcher(structure, after)
        return SampleGroup(request_id, seqs, held=seqs[1:])

    def _grammars(self) -> Grammars:
        """The grammar compiler, made at the first request with a structure."""
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.cfg.vocab_size, self.eos_ids)
        return self.grammars

    def _sequence(self, r: NewRequest, request_id: str, index: int, seed: int) -> Sequence:
        prompt_ids, params = r.prompt_token_ids, r.params
        max_rows = min(rows_of(len(prompt_ids), params.max_tokens), self.max_model_len - 1)
        taps = bind_request(params, len(prompt_ids), max_rows, self.model, self.shapes, self.enable_capture)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        seq = Sequence(request_id, prompt_ids, params, seed, stop_ids, taps, r.prompt, index, r.images, r.lora,
                       r.cache_salt, (r.priority, int(request_id)))  # fmt: skip
        seq.settle(self.long_rope_at, self.cfg, self.max_model_len)
        return seq

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is, freeing its blocks (an unknown or finished id is ignored)."""
        group = self._requests.pop(request_id, None)
        if group is None:
            return
        for seq in group.seqs:
            if seq.status is Status.FINISHED:
                continue
            self.scheduler.abort(seq)
            self._release(seq)

    def reset_prefix_cache(self) -> bool:
        return self.blocks.reset_prefix_cache()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        free, graphs = len(self.blocks.free), self.runner.graph_stats
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=len(self.blocks.blocks) - free,
            kv_blocks_free=free,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            tokens_computed=self.scheduler.tokens_computed,
            num_preemptions=self.scheduler.num_preemptions,
            attention_backend=self.runner.backend.name,
            graph_steps=graphs.graph_steps,
            static_eager_steps=graphs.static_eager_steps,
            eager_steps=graphs.eager_steps,
            graphs_captured=graphs.graphs_captured,
            graph_capture_seconds=graphs.capture_seconds,
            compiled_steps=graphs.compiled_steps,
            decode_compiles=graphs.compiles,
            decode_compile_seconds=graphs.compile_seconds,
            ahead_steps=graphs.ahead_steps,
            repeated_steps=self.runner.pages.repeats,
            kept_states=len(self.blocks.snapshots),
            prefix_cache_queries=self.scheduler.prefix_queries,
            prefix_cache_hits=self.scheduler.prefix_hits,
            **({} if self.loras is None else dict(  # (the server reads the stats every step: no scan without LoRA)
                max_loras=self.loras.max_loras, running_loras=_adapters(self.scheduler.running),
                waiting_loras=_adapters(self.scheduler.waiting))),
        )

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Run one step; a delta for every sample that ended in it, and for every streamed one (whose text
        grows as it goes) that got a token. A step queued ahead by the last call is this one; before this
        one's ids reach the host, the next may be queued behind it."""
        self.runner.check_thread()
        out, self._ahead = self._ahead, None
        if out is None or not any(seq.status is Status.RUNNING for seq in out.sampled):
            scheduled = self.scheduler.schedule()
            if not scheduled:
                return []
            out = self.runner.run(scheduled)
        if self.async_scheduling and out.decode and not out.adjusted:
            self._ahead = self._run_ahead(out)
        tokens = out.token_ids()
        # A step queued ahead may hold sequences that ended in the step before it: they are skipped.
        running = Status.RUNNING
        scheduled = [(seq, n) for seq, n in out.scheduled if seq.status is running]
        self.scheduler.computed(scheduled)
        # The previous step's rows, whose copy to the host overlapped this step's forward; this step's
        # wait for the next one, unless a request that collects rows ends now and needs them.
        self._deliver()
        if out.collection is not None:
            self._pending = (out.plan, out.collection)
        if out.prompt_logprobs is not None:
            out.prompt_rows.deliver(out.prompt_logprobs, self.token_text)
        deltas, generated, now = [], 0, time.time()
        for i, (seq, token) in enumerate(zip(out.sampled, tokens)):
            if seq.status is not running:  # ended before this step, which was queued ahead
                continue
            generated += 1
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.logprobs_k is not None:
                seq.logprobs.append(entry(out.logprobs, i, token, seq.logprobs_k, self.token_text))
            finished = self._check_stop(seq, token)
            if finished:
                self._finish(seq)
            elif seq.long_rope_at is not None and seq.reaches_long_rope():
                self.scheduler.recompute(seq)
            if finished or seq.detokenizer is not None:  # (the rest report when they end)
                deltas.append(self._delta(seq, finished))
        self.generation_tokens += generated
        if not out.decode:  # (a decode step borrowed no prefix, and no prompt ends or completes in it)
            self._prompt_chunks_done(scheduled, deltas)
        return deltas

    def _prompt_chunks_done(self, scheduled: list[tuple[Sequence, int]], deltas: list[RequestDelta]) -> None:
        """After a step with prompt chunks: borrowed prefixes are returned, prefill-only requests whose prompt
        is computed end, and a request's held samples start once its first sample has computed the prompt."""
        for seq, _ in scheduled:
            seq.step_done()
            if seq.prefill_only and seq.num_computed == len(seq.token_ids):
                seq.finish_reason = "length"
                self._finish(seq)
                deltas.append(self._delta(seq, True))
            elif seq.index == 0 and seq.num_generated <= 1:  # its prompt may have been computed just now
                group = self._requests.get(seq.request_id)
                if group is not None and group.held:  # (a request of one sample holds none: no call)
                    self.scheduler.add_first(group.release())

    def _run_ahead(self, out: StepOutput) -> StepOutput | None:
        """The next decode step of `out`'s sequences, queued now, or None where the host must first see
        `out`'s ids: a sequence's next step depends on its tokens (vlens.engine.sequence: `plans_ahead`),
        `out` frees a place a waiting request would take, or blocks run short. A sequence that `out` ends by
        length is left out; one that a sampled stop token ends runs the step in vain, and its rows of
        that step are never read (vlens.capture.rows.Held.delivered).
        Never across tensor-parallel ranks, whose forwards take their ids from this one."""
        if self.model.executor is not None:
            return None
        keep, frees = [], False
        for i, seq in enumerate(out.sampled):
            if seq.status is not Status.RUNNING:  # ended while `out` ran
                continue
            if not seq.plans_ahead:
                return None
            if len(seq.token_ids) + 1 >= seq.length_limit:
                frees = True
            else:
                keep.append(i)
        scheduler = self.scheduler
        if not keep or scheduler.waiting and (frees or len(scheduler.running) < scheduler.max_num_seqs):
            return None
        if not self.blocks.reserve_next([out.sampled[i] for i in keep]):
            return None
        scheduler.tokens_computed += len(keep)
        return self.runner.run_ahead(out, keep)

    def _deliver(self) -> None:
        if self._pending is not None:
            plan, collection = self._pending
            plan.deliver(collection.ready())
            self._pending = None

    def _finish(self, seq: Sequence) -> None:
        if seq.taps.streams:  # its last rows may still be on their way
            self._deliver()
        self.scheduler.finish(seq)
        self._release(seq)
        group = self._requests[seq.request_id]
        group.done += 1
        self.scheduler.add_first(group.release())

    def _release(self, seq: Sequence) -> None:
        """What the runner keeps for a sequence that ends: its vectors, and the last decode step it was in."""
        seq.drop_vectors(self.runner.taps)
        self.runner.pages.forget(seq)
        if seq.lora_slot is not None:
            self.loras.release(seq.lora_slot)
            seq.lora_slot = None

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        """Whether the token ends the sequence; sets its finish and stop reasons."""
        if token in seq.stop_ids:
            seq.finish_reason = "stop"
            seq.stop_reason = None if token in self.eos_ids and token not in seq.params.stop_token_ids else token
            if seq.detokenizer is not None and seq.params.include_stop_str_in_output:  # (its text, and what it ends)
                seq.stop_reason = seq.detokenizer.add(token) or seq.stop_reason
            return True
        if seq.grammar is not None and not seq.grammar.accept(token):  # its structure is over: nothing may follow
            seq.finish_reason = "stop"
            return True
        if seq.detokenizer is not None:
            stop = seq.detokenizer.add(token)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
                return True
        if len(seq.token_ids) >= seq.length_limit:
            seq.finish_reason = "length"
            return True
        return False

    # -- results ----------------------------------------------------------------------------------

    def _delta(self, seq: Sequence, finished: bool) -> RequestDelta:
        new = seq.token_ids[seq.num_prompt + seq.num_reported :]
        logprobs = seq.logprobs[seq.num_reported :] if seq.params.logprobs is not None else []
        prompt_logprobs = seq.prompt_logprobs if seq.num_reported == 0 else None
        seq.num_reported = seq.num_generated
        delta = RequestDelta(seq.request_id, new, "", logprobs, index=seq.index, prompt_logprobs=prompt_logprobs)
        if seq.detokenizer is not None:
            delta.text = seq.detokenizer.release(finished)
        if not finished:
            return delta
        if seq.detokenizer is None:
            delta.text = self._text(seq)
        delta.finish_reason, delta.stop_reason = seq.finish_reason, seq.stop_reason
        group = self._requests[seq.request_id]
        if group.finished:
            del self._requests[seq.request_id]
            delta.output = self._output(group)
        return delta

    def _text(self, seq: Sequence) -> str:
        """Its text, the same whether it streamed or not: without a detokenizer, decoded at once as one would
        have released it, leaving out the stop token that ended it (unless the request keeps it: a detokenizer sees
        it then)."""
        if seq.detokenizer is not None:
            return seq.detokenizer.text
        if self.tokenizer is None:
            return ""
        ended_by_token = seq.finish_reason == "stop" and not seq.params.include_stop_str_in_output
        generated = seq.generated[:-1] if ended_by_token else seq.generated  # (no stop strings here)
        return text_of(self.tokenizer, seq.token_ids[: seq.num_prompt], generated, seq.params.skip_special_tokens)

    def _output(self, group: SampleGroup) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=i,
                text=self._text(seq),
                token_ids=seq.generated,
                finish_reason=seq.finish_reason,
                logprobs=seq.logprobs if seq.params.logprobs is not None else None,
                stop_reason=seq.stop_reason,
            )
            for i, seq in enumerate(group.returned())
        ]
        seq = group.seqs[0]  # the one that computed the prompt's log-probabilities; a capture has only it
        first = min((s.first_token_time for s in group.seqs if s.first_token_time is not None), default=None)
        times = RequestMetrics(seq.arrival_time, seq.first_scheduled_time or seq.arrival_time, first, time.time(),
                               max(s.num_generated for s in group.seqs))  # fmt: skip
        out = RequestOutput(
            group.request_id, seq.prompt, seq.token_ids[: seq.num_prompt], completions, seq.prompt_logprobs,
            num_cached_tokens=seq.num_cached, metrics=times,
        )
        if seq.images is not None:
            out.multi_modal_placeholders = {"image": [PlaceholderRange(*run) for run in seq.images.placeholders()]}
        num_rows = rows_of(seq.num_prompt, seq.num_generated)
        for stream in seq.taps.streams:
            positions, tensors = stream.result(num_rows, self.runner.dtype)
            if stream.kind == "hidden_states":
                out.hidden_states = tensors[FINAL_NORM]
            else:
                out.activation_positions = positions
                stream.place(out, tensors)
        return out


def _int64(seed: int) -> int:
    """A seed of any size (and seed + i of a request's samples) wrapped into the int64 the sampler's seed
    tensor holds; its noise hashes those 64 bits, so seeds that fit are unchanged."""
    return (seed + 2**63) % 2**64 - 2**63


def _adapters(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The names of the LoRA adapters `seqs` run under, each once, sorted."""
    return tuple(sorted({seq.lora.lora_name for seq in seqs if seq.lora is not None}))
