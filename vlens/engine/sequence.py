"""A request in flight: its tokens, KV blocks, sampling state, and what it does at the taps."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlens.capture.bind import RequestTaps
from vlens.capture.interventions import fingerprint
from vlens.capture.names import forward_depth
from vlens.capture.runtime import TapRuntime
from vlens.config import ModelConfig
from vlens.engine.detokenizer import Detokenizer
from vlens.images import PromptImages
from vlens.outputs import Logprob
from vlens.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vlens.engine.lora import LoRARequest
    from vlens.engine.structured import Grammar


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Borrow:
    """A prompt prefix that another sequence computes in the same step (scheduler.Scheduler._borrow):
    its first `length` tokens' keys and values are the lender's (its full blocks shared, the slots of the
    last, partial one copied in each layer), and so are their prompt log-probabilities."""

    lender: Sequence
    length: int
    copy_from: list[int]  # cache slots of the lender's partial block ...
    copy_to: list[int]  # ... and where they go in this sequence's


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        stop_ids: frozenset[int],
        taps: RequestTaps,
        prompt: str | None = None,
        index: int = 0,
        images: PromptImages | None = None,
        lora: LoRARequest | None = None,
        salt: str | None = None,
        order: tuple[int, int] = (0, 0),
    ):
        self.request_id, self.prompt = request_id, prompt
        self.arrival_time = time.time()  # (RequestOutput.metrics, with the two below)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.order = order  # (priority, arrival): its place in the queue under scheduling_policy="priority"
        self.salt = salt  # vLLM's cache_salt: only sequences with the same one share cached prefixes
        self.lora = lora  # the LoRA adapter it runs under (vlens.engine.lora), and the slot that holds it
        self.lora_slot: int | None = None
        self.images = images  # what its prompt's image rows read in place of their tokens' embedding
        self.index = index  # which sample of its request (n, best_of) it is
        self.token_ids = list(prompt_token_ids)
        self.num_prompt = len(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.stop_ids = stop_ids
        self.taps = taps  # what it captures and changes at the taps
        self.status = Status.WAITING
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.num_cached = 0  # ... of them, those the prefix cache gave at its (last) admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        # A model whose layers keep a state per sequence (vlens.engine.block_manager): the state slot it holds, the
        # slot of a cached prefix's state its next chunk starts from, and the slot that chunk's state is kept in for
        # later sequences to start from
        self.state_slot: int | None = None
        self.state_source: int | None = None
        self.state_save: int | None = None
        # ... and the slot its state is copied to at each block boundary a step starts at, for it to leave as a
        # prefix's kept state when it ends (and how many tokens that copy covers)
        self.state_mark: int | None = None
        self.marked_at = 0
        # ... and how far its prefix's blocks were cached without a state kept at their end (a prompt that shares
        # only its start with an earlier one): it keeps its state there, for the prompts after it
        self.uncached_state_at = 0
        # ... and, waiting a step for a prefix whose state another sequence keeps (scheduler.Scheduler._defer), that
        # sequence and how many leading tokens' prompt log-probabilities it takes from it
        self.prefix_of: tuple[Sequence, int] | None = None
        self.cache_salt: object = None  # what else (besides tokens) the KV depends on
        # ... of the tokens before the first row its interventions may change, the same as without them
        self.plain_salt: object = None
        self.edits_from = math.inf  # that row
        self.detokenizer: Detokenizer | None = None  # incremental text (streamed, or with stop strings)
        self.logprobs: list[dict[int, Logprob]] = []
        # Top alternatives per sampled token; None: no log-probabilities (ranked samples need at least the token's).
        self.logprobs_k = params.logprobs if params.logprobs is not None or not params.ranks_samples else 0
        # The first sample computes the prompt's log-probabilities for its request; entry 0 (token 0) is None.
        wants_prompt = params.prompt_logprobs is not None and index == 0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = [None] if wants_prompt else None
        self.bad_words_ids: list[list[int]] = []  # params.bad_words as the engine's tokenizer spells them
        self.grammar: Grammar | None = None  # where its text is in params.structured_outputs (engine.structured)
        # Its logits change every step: a bias, penalties, allowed tokens, bad words, a structure (min_tokens:
        # adjusts_logits).
        self.always_adjusts = (bool(params.logit_bias) or params.penalises or params.allowed_token_ids is not None
                               or bool(params.bad_words) or params.structured_outputs is not None)  # fmt: skip
        self.depth: int | None = None  # layers a prefill-only request needs; None: the whole model
        self.long_rope_at: int | None = None  # the position from which LongRoPE's long factors apply
        self.plans_ahead = False  # (settle)
        self.length_limit = 0  # (settle) the length at which it ends: prompt + max_tokens, within max_model_len
        self.borrow: Borrow | None = None  # this step's: the prefix another sequence computes for it
        self.num_reported = 0  # generated tokens already sent out in a delta
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def adjusts_logits(self) -> bool:
        """Whether its next token's logits change before sampling (min_tokens: while its stop tokens are banned)."""
        min_tokens = self.params.min_tokens
        return self.always_adjusts or (min_tokens > 0 and self.num_generated < min_tokens and bool(self.stop_ids))

    @property
    def prefill_only(self) -> bool:
        return self.params.max_tokens == 0

    # -- the facts the engine keeps beside the tokens ----------------------------------------------------

    def settle(self, long_rope_at: int | None, cfg: ModelConfig, max_model_len: int) -> None:
        """Fix, when the sequence is created, what its KV depends on besides its tokens (the prefix cache's
        salt): its interventions, LongRoPE's regime, and for a prefill-only request the layers it runs —
        nothing reads past its deepest tap, so a step of such requests alone stops there, and their blocks,
        which may lack the deeper layers' KV, are kept apart. And the length at which it ends, which every
        step checks."""
        self.length_limit = min(self.num_prompt + self.params.max_tokens, max_model_len)
        self.long_rope_at = long_rope_at
        # Whether its next decode step can be planned before the host sees its last token (async scheduling):
        # not when a capture skips rows by token, nor where LongRoPE may switch it to recompute.
        self.plans_ahead = long_rope_at is None and all(stream.exclude is None for stream in self.taps.streams)
        salt: object = fingerprint(self.params.interventions)
        if any(iv.positions.follows_prompt for iv in self.params.interventions):
            salt = ("prompt of", self.num_prompt, salt)  # which rows they change depends on where the prompt ends
        # A key or value depends on the rows at and before its own (the model is causal): those before the
        # first row an intervention (or an image) may change are the same as without it, and key the prefix cache
        # so (a steer of the generated rows shares its prompt's KV with unsteered requests).
        self.edits_from = min((iv.positions.first_needed(self.num_prompt) for iv in self.taps.interventions),
                              default=math.inf)  # fmt: skip
        if self.images is not None:
            salt = ("images", self.images.digest, salt)
            self.edits_from = min(self.edits_from, int(self.images.positions[0]))
        salts = [salt, None]
        if self.lora is not None:  # (every key differs from the base model's)
            salts = [("lora", self.lora.lora_int_id, s) for s in salts]
        if self.salt is not None:
            salts = [("salt", self.salt, s) for s in salts]
        if long_rope_at is not None and self.num_prompt - 1 >= long_rope_at:
            salts = [("long rope", s) for s in salts]
        if self.prefill_only and self.prompt_logprobs is None:
            used = [t for stream in self.taps.streams for t in stream.taps]
            self.depth = forward_depth(used + [t for iv in self.taps.interventions for t in iv.taps], cfg)
            if self.depth is not None:
                salts = [("layers", self.depth, s) for s in salts]
        self.cache_salt, self.plain_salt = salts

    def salt_until(self, end: int) -> object:
        """The salt of the KV of its first `end` tokens (a cache block's, up to its end)."""
        return self.plain_salt if end <= self.edits_from else self.cache_salt

    def reaches_long_rope(self) -> bool:
        """Whether the token just sampled takes the sequence to LongRoPE's switch. Its cached keys were
        rotated with the short factors, so it recomputes them with the long ones (rows already captured are
        not taken again), under a salt that keeps the two regimes apart in the prefix cache."""
        if self.long_rope_at is None or len(self.token_ids) - 1 != self.long_rope_at:
            return False
        self.cache_salt, self.plain_salt = ("long rope", self.cache_salt), ("long rope", self.plain_salt)
        return True

    def step_done(self) -> None:
        """After a step it ran in: no borrowed prefix."""
        self.borrow = None

    def hold_vectors(self, runtime: TapRuntime) -> None:
        """Its intervention vectors onto the device, once, for every step it runs in."""
        runtime.upload(self.taps.interventions)

    def drop_vectors(self, runtime: TapRuntime) -> None:
        runtime.release(self.taps.interventions)

    def reusable_prefix(self) -> int | None:
        """Leading tokens whose KV may come from the prefix cache without losing a row the request still
        wants: captured rows, prompt log-probabilities not yet delivered. None: no limit. Asked when the
        sequence is admitted (first, or again after a preemption), from what its steps so far delivered."""
        limits = [self.taps.reusable_prefix(len(self.token_ids))] if self.taps.streams else []
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt:
            limits.append(len(self.prompt_logprobs) - 1)
        return min(limits, default=None)
