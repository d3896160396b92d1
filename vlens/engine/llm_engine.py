"""The engine loop: validate requests, schedule, run a step, hand captured rows and tokens to their
sequences, and finish them. One step serves prefill chunks and decodes of many requests at once."""

from __future__ import annotations

import os
import random
from functools import partial
from typing import Any

import torch

from vlens.engine.block_manager import BlockManager
from vlens.engine.capture import logit_lens, project
from vlens.engine.config import EngineConfig
from vlens.engine.detokenizer import IncrementalDetokenizer
from vlens.engine.intervene import bind
from vlens.engine.model_runner import ModelRunner, StepOutput
from vlens.engine.rows import RowSelector, RowStream
from vlens.engine.scheduler import Scheduler
from vlens.engine.sequence import Sequence
from vlens.hooks import FINAL_NORM, LOGITS, hook_shapes, resolve_hooks
from vlens.interventions import fingerprint
from vlens.models.base import DecoderLM
from vlens.outputs import CompletionOutput, Logprob, RequestOutput
from vlens.sampling_params import Capture, SamplingParams

CPU_DEFAULT_KV_BYTES = 2 << 30


def _default_kv_bytes(device: torch.device) -> int:
    """What the device can spare for the cache when the user does not say."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(CPU_DEFAULT_KV_BYTES, available // 4)


class LLMEngine:
    def __init__(self, model: DecoderLM, tokenizer: Any, config: EngineConfig):
        cfg = model.cfg
        device = model.lm_head.weight.device
        block_size, max_model_len = config.block_size, config.max_model_len
        per_block = ModelRunner.bytes_per_block(model, block_size)
        wanted_len = max_model_len or cfg.max_position_embeddings
        budget = config.kv_cache_memory if config.kv_cache_memory is not None else _default_kv_bytes(device)
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
        self.enable_capture = config.enable_capture
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.blocks = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.shapes = hook_shapes(cfg)
        self.rng = random.Random(config.seed)
        self.eos_ids = frozenset(cfg.eos_token_ids) | frozenset(
            [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else []
        )
        self._next_id = 0
        # LongRoPE's factors depend on the sequence length: a sequence whose last position reaches this
        # recomputes its cache with the long factors, as HF does (see _switch_rope).
        scaling = cfg.rope_scaling or {}
        self.long_rope_at = scaling.get("original_max_position_embeddings") if scaling.get("rope_type") == "longrope" else None
        self._detok: dict[Sequence, IncrementalDetokenizer] = {}

    # -- requests ---------------------------------------------------------------------------------

    def make_sequence(self, prompt_ids: list[int], params: SamplingParams, index: int, prompt: str | None = None) -> Sequence:
        """Validate one request against the model and build its sequence; raises ValueError naming the field."""
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens leave no room to generate within max_model_len={self.max_model_len}"
            )
        streams = []
        capture = params.capture
        if (capture is not None or params.return_hidden_states) and not self.enable_capture:
            raise ValueError(
                "capture: this LLM was created with enable_capture=False; create it with "
                "LLM(..., enable_capture=True) to capture activations or hidden states"
            )
        max_rows = min(len(prompt_ids) + params.max_tokens, self.max_model_len) - 1
        if capture is not None:
            if isinstance(capture.positions, list):
                bad = [p for p in capture.positions if not -max_rows <= p < max_rows]
                if bad:
                    raise ValueError(
                        f"capture.positions: {bad} out of range; a {len(prompt_ids)}-token prompt with "
                        f"max_tokens={params.max_tokens} has at most {max_rows} rows (positions 0..{max_rows - 1}, "
                        f"or -{max_rows}..-1 from the end)"
                    )
            streams.append(self._capture_stream(capture, len(prompt_ids)))
        if params.return_hidden_states:
            selector = RowSelector("all", len(prompt_ids))
            streams.append(RowStream("hidden_states", {FINAL_NORM: FINAL_NORM}, selector, self.shapes))
        device, dtype = self.runner.device, self.runner.dtype
        bound = bind(params.interventions, self.cfg, self.shapes, len(prompt_ids), max_rows, device, dtype)
        seed = params.seed if params.seed is not None else self.rng.randrange(2**31)
        seq = Sequence(str(self._next_id), index, prompt_ids, params, seed, self.eos_ids, prompt)
        self._next_id += 1
        seq.streams, seq.interventions = streams, bound
        seq.cache_salt = fingerprint(params.interventions)
        if self.long_rope_at is not None and len(prompt_ids) - 1 >= self.long_rope_at:
            seq.cache_salt = ("long rope", seq.cache_salt)
        return seq

    def _capture_stream(self, capture: Capture, prompt_len: int) -> RowStream:
        """A Capture bound to the model: taps resolved, readouts built on the device."""
        hooks = resolve_hooks(capture.hooks, self.cfg)
        taps = set(hooks.values())
        shapes = {t: self.shapes[t] for t in taps}
        readout = None
        if capture.project is not None:
            weight, bias = capture.project
            bad = {t: s for t, s in shapes.items() if (weight.shape[0],) != (torch.Size(s).numel(),)}
            if bad:
                raise ValueError(f"capture.project: W has {weight.shape[0]} rows; taps {bad} have rows of another size")
            w = weight.to(self.runner.device, self.runner.dtype)
            b = None if bias is None else bias.to(self.runner.device, self.runner.dtype)
            readout = partial(project, w=w, b=b)
            shapes = {t: (weight.shape[1],) for t in taps}
        if capture.logit_lens is not None:
            bad = [t for t, s in shapes.items() if s != (self.cfg.hidden_size,) or t == LOGITS]
            if bad:
                raise ValueError(f"capture.logit_lens: needs residual-stream taps of width {self.cfg.hidden_size}; not {bad}")
            readout = partial(logit_lens, model=self.model, k=capture.logit_lens)
        selector = RowSelector(capture.positions, prompt_len)
        return RowStream(
            "capture", hooks, selector, shapes, capture.exclude_token_ids, capture.dtype, readout, capture.reduce,
            capture.logit_lens,
        )

    def add(self, seq: Sequence) -> None:
        if seq.params.stop_list:
            self._detok[seq] = IncrementalDetokenizer(self.tokenizer, seq.token_ids)
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is, freeing its blocks."""
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
        self.scheduler.finish(seq)
        seq.finish_reason = seq.finish_reason or "abort"
        self._detok.pop(seq, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Run one step; return the sequences that finished in it."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        out = self.runner.run(scheduled)
        for seq, n in scheduled:
            for stream in seq.streams:
                stream.captured_upto = max(stream.captured_upto, seq.num_computed + n)
            seq.num_computed += n
            self.blocks.commit(seq)
        if out.plan is not None:
            self._deliver_rows(out)
        finished = []
        for i, (seq, token) in enumerate(zip(out.sampled, out.tokens)):
            seq.token_ids.append(token)
            if out.logprobs is not None and seq.params.logprobs is not None:
                seq.logprobs.append(self._logprobs(out.logprobs, i, token, seq.params.logprobs))
            if self._check_stop(seq, token):
                self.scheduler.finish(seq)
                finished.append(seq)
            elif self.long_rope_at is not None and len(seq.token_ids) - 1 == self.long_rope_at:
                self._switch_rope(seq)
        return finished

    def _switch_rope(self, seq: Sequence) -> None:
        """The sequence now reaches LongRoPE's switch: its cached keys were rotated with the short
        factors, so drop them and recompute with the long ones (rows already captured are not taken
        again). The prefix cache keeps the two regimes apart."""
        self.blocks.release(seq)
        seq.cache_salt = ("long rope", seq.cache_salt)

    def _deliver_rows(self, out: StepOutput) -> None:
        by_owner: dict[int, tuple[object, dict[str, torch.Tensor]]] = {}
        for owner, tap, rows in out.plan.pieces():
            by_owner.setdefault(id(owner), (owner, {}))[1][tap] = rows
        for (seq, k, positions), tap_rows in by_owner.values():
            seq.streams[k].add(positions, tap_rows)

    def _logprobs(self, logprobs: tuple, i: int, token: int, k: int) -> dict[int, Logprob]:
        chosen, top_ids, top_values = logprobs
        ids, values = top_ids[i, :k].tolist(), top_values[i, :k].tolist()
        entry = {t: Logprob(v, rank + 1) for rank, (t, v) in enumerate(zip(ids, values))}
        entry.setdefault(token, Logprob(float(chosen[i]), None))
        return entry

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        if token in seq.stop_ids:
            seq.finish_reason = "stop"
            seq.stop_reason = None if token in self.eos_ids and token not in params.stop_token_ids else token
            return True
        detok = self._detok.get(seq)
        if detok is not None:
            new = detok.add(token)
            if new:
                window = detok.text[-(len(new) + max(map(len, params.stop_list)) - 1) :]
                for stop in params.stop_list:
                    at = window.find(stop)
                    if at >= 0:
                        cut = len(detok.text) - len(window) + at
                        detok.text = detok.text[:cut]
                        seq.finish_reason, seq.stop_reason = "stop", stop
                        return True
        if seq.num_generated >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    # -- results ----------------------------------------------------------------------------------

    def result(self, seq: Sequence) -> RequestOutput:
        detok = self._detok.pop(seq, None)
        if detok is not None:
            text = detok.text
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
        model_dtype = self.runner.dtype
        for stream in seq.streams:
            positions, tensors = stream.result(num_rows, model_dtype)
            if stream.kind == "hidden_states":
                out.hidden_states = tensors[FINAL_NORM]
            else:
                out.activation_positions = positions
                target = out.logit_lens if stream.logit_lens else out.activations
                target.update(tensors)
        return out
