"""The engine loop: validate and queue requests, schedule, run a step, and report what each request
got from it as a delta — its new tokens and text, its finish, and on finishing its whole output with
the captured rows. `LLM.generate` and the server consume the same deltas; nothing outside the engine
touches its sequences, scheduler or blocks. One step serves prefill chunks and decodes of many
requests at once."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

from vlens.capture.bind import bind_request
from vlens.capture.interventions import fingerprint
from vlens.capture.names import FINAL_NORM, hook_shapes
from vlens.capture.plan import StepPlan
from vlens.capture.runtime import Collection
from vlens.engine.block_manager import BlockManager
from vlens.engine.config import EngineConfig
from vlens.engine.detokenizer import Detokenizer
from vlens.engine.memory import kv_cache_bytes
from vlens.engine.model_runner import ModelRunner
from vlens.engine.scheduler import Scheduler
from vlens.engine.sequence import Sequence
from vlens.models.base import DecoderLM
from vlens.outputs import CompletionOutput, Logprob, RequestDelta, RequestOutput
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

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / max(1, self.kv_blocks_used + self.kv_blocks_free)


@dataclass(frozen=True)
class NewRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, when the request came as one
    stream: bool = False  # report text as it grows, not only at the end


class LLMEngine:
    def __init__(self, model: DecoderLM, tokenizer: Any, config: EngineConfig, backend):
        cfg = model.cfg
        block_size, max_model_len = config.block_size, config.max_model_len
        per_block = ModelRunner.bytes_per_block(model, block_size)
        wanted_len = max_model_len or cfg.max_position_embeddings
        budget = kv_cache_bytes(model, config, backend)
        num_blocks = min(budget // per_block, config.max_num_seqs * -(-wanted_len // block_size))
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory: {budget} bytes hold fewer than 2 blocks of {per_block} bytes")
        capacity = num_blocks * block_size
        if max_model_len is not None and max_model_len > capacity:
            raise ValueError(
                f"max_model_len: {max_model_len} tokens do not fit the KV cache ({capacity} tokens); "
                "raise kv_cache_memory or lower max_model_len"
            )
        self.model, self.cfg, self.tokenizer = model, cfg, tokenizer
        self.max_model_len = min(wanted_len, capacity)
        log.info("KV cache: %d blocks of %d tokens (%d bytes); the longest sequence that fits: %d tokens",
                 num_blocks, block_size, num_blocks * per_block, self.max_model_len)  # fmt: skip
        self.enable_capture = config.enable_capture
        self.runner = ModelRunner(model, num_blocks, block_size, backend)
        self.blocks = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.shapes = hook_shapes(cfg)
        self.rng = random.Random(config.seed)
        self.eos_ids = frozenset(cfg.eos_token_ids) | frozenset(
            [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else []
        )
        self._next_id = 0
        self._requests: dict[str, Sequence] = {}
        self._pending: tuple[StepPlan, Collection] | None = None  # a step's rows still on their way to the host
        self.prompt_tokens = self.generation_tokens = 0
        # LongRoPE's factors depend on the sequence length: a sequence whose last position reaches this
        # recomputes its cache with the long factors, as HF does (see _switch_rope).
        scaling = cfg.rope_scaling or {}
        self.long_rope_at = scaling.get("original_max_position_embeddings") if scaling.get("rope_type") == "longrope" else None

    # -- requests ---------------------------------------------------------------------------------

    def add_requests(self, requests: list[NewRequest]) -> list[str]:
        """Validate every request against the model, then queue all of them (none if any is refused:
        the ValueError names the field). Returns their request ids."""
        seqs = [self._sequence(r) for r in requests]
        for seq, r in zip(seqs, requests):
            if r.stream or seq.params.stop_list:
                seq.detokenizer = Detokenizer(self.tokenizer, seq.token_ids, seq.params.stop_list)
            self.runner.taps.upload(seq.taps.interventions)
            self._requests[seq.request_id] = seq
            self.prompt_tokens += seq.num_prompt
            self.scheduler.add(seq)
        return [seq.request_id for seq in seqs]

    def _sequence(self, r: NewRequest) -> Sequence:
        prompt_ids, params = r.prompt_token_ids, r.params
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens leave no room to generate within max_model_len={self.max_model_len}"
            )
        max_rows = min(len(prompt_ids) + params.max_tokens, self.max_model_len) - 1
        taps = bind_request(params, len(prompt_ids), max_rows, self.model, self.shapes, self.enable_capture)
        seed = params.seed if params.seed is not None else self.rng.randrange(2**31)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        seq = Sequence(str(self._next_id), prompt_ids, params, seed, stop_ids, taps, r.prompt)
        self._next_id += 1
        seq.cache_salt = fingerprint(params.interventions)
        if self.long_rope_at is not None and len(prompt_ids) - 1 >= self.long_rope_at:
            seq.cache_salt = ("long rope", seq.cache_salt)
        seq.cache_limit = taps.reusable_prefix(len(prompt_ids)) if taps.streams else None
        return seq

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is, freeing its blocks (an unknown or finished id is ignored)."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
        self.scheduler.finish(seq)
        self.runner.taps.release(seq.taps.interventions)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        free = len(self.blocks.free)
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=len(self.blocks.blocks) - free,
            kv_blocks_free=free,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            tokens_computed=self.scheduler.tokens_computed,
            num_preemptions=self.scheduler.num_preemptions,
        )

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Run one step; a delta for every request that got a token in it."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        out = self.runner.run(scheduled)
        for seq, n in scheduled:
            seq.num_computed += n
            self.blocks.commit(seq)
            if seq.taps.streams:
                seq.cache_limit = seq.taps.reusable_prefix(len(seq.token_ids))
        # The previous step's rows, whose copy to the host overlapped this step's forward; this step's
        # wait for the next one, unless a request that collects rows ends now and needs them.
        self._deliver()
        if out.collection is not None:
            self._pending = (out.plan, out.collection)
        deltas = []
        self.generation_tokens += len(out.tokens)
        for i, (seq, token) in enumerate(zip(out.sampled, out.tokens)):
            seq.token_ids.append(token)
            if out.logprobs is not None and seq.params.logprobs is not None:
                seq.logprobs.append(self._logprobs(out.logprobs, i, token, seq.params.logprobs))
            finished = self._check_stop(seq, token)
            if finished and seq.taps.streams:
                self._deliver()
            if finished:
                self.scheduler.finish(seq)
                self.runner.taps.release(seq.taps.interventions)
                del self._requests[seq.request_id]
            elif self.long_rope_at is not None and len(seq.token_ids) - 1 == self.long_rope_at:
                self._switch_rope(seq)
            deltas.append(self._delta(seq, finished))
        return deltas

    def _deliver(self) -> None:
        if self._pending is not None:
            plan, collection = self._pending
            plan.deliver(collection.ready())
            self._pending = None

    def _switch_rope(self, seq: Sequence) -> None:
        """The sequence now reaches LongRoPE's switch: its cached keys were rotated with the short
        factors, so drop them and recompute with the long ones (rows already captured are not taken
        again). The prefix cache keeps the two regimes apart."""
        self.blocks.release(seq)
        seq.cache_salt = ("long rope", seq.cache_salt)

    def _logprobs(self, logprobs: tuple, i: int, token: int, k: int) -> dict[int, Logprob]:
        chosen, top_ids, top_values = logprobs
        ids, values = top_ids[i, :k].tolist(), top_values[i, :k].tolist()
        entry = {t: Logprob(v, rank + 1) for rank, (t, v) in enumerate(zip(ids, values))}
        entry.setdefault(token, Logprob(float(chosen[i]), None))
        return entry

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        """Whether the token ends the sequence; sets its finish and stop reasons."""
        params = seq.params
        if token in seq.stop_ids:
            seq.finish_reason = "stop"
            seq.stop_reason = None if token in self.eos_ids and token not in params.stop_token_ids else token
            return True
        if seq.detokenizer is not None:
            stop = seq.detokenizer.add(token)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
                return True
        if seq.num_generated >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    # -- results ----------------------------------------------------------------------------------

    def _delta(self, seq: Sequence, finished: bool) -> RequestDelta:
        new = seq.token_ids[seq.num_prompt + seq.num_reported :]
        logprobs = seq.logprobs[seq.num_reported :] if seq.params.logprobs is not None else []
        seq.num_reported = seq.num_generated
        text = seq.detokenizer.release(finished) if seq.detokenizer is not None else ""
        if not finished:
            return RequestDelta(seq.request_id, new, text, logprobs)
        output = self._output(seq)
        if seq.detokenizer is None:
            text = output.outputs[0].text
        return RequestDelta(seq.request_id, new, text, logprobs, seq.finish_reason, output)

    def _output(self, seq: Sequence) -> RequestOutput:
        if seq.detokenizer is not None:
            text = seq.detokenizer.text
        else:
            text = self.tokenizer.decode(seq.generated, skip_special_tokens=True) if self.tokenizer is not None else ""
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=seq.generated,
            finish_reason=seq.finish_reason,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            stop_reason=seq.stop_reason,
        )
        out = RequestOutput(seq.request_id, seq.prompt, seq.token_ids[: seq.num_prompt], [completion])
        num_rows = len(seq.token_ids) - 1
        for stream in seq.taps.streams:
            positions, tensors = stream.result(num_rows, self.runner.dtype)
            if stream.kind == "hidden_states":
                out.hidden_states = tensors[FINAL_NORM]
            else:
                out.activation_positions = positions
                stream.place(out, tensors)
        return out
