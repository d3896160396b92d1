"""A request in flight: its tokens, KV blocks, sampling state, and what it does at the taps."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vlens.capture.bind import RequestTaps
from vlens.engine.detokenizer import Detokenizer
from vlens.outputs import Logprob
from vlens.sampling_params import SamplingParams


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
    ):
        self.request_id, self.prompt = request_id, prompt
        self.index = index  # which sample of its request (n, best_of) it is
        self.token_ids = list(prompt_token_ids)
        self.num_prompt = len(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.stop_ids = stop_ids
        self.taps = taps  # what it captures and changes at the taps
        self.status = Status.WAITING
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.cache_salt: object = None  # what else (besides tokens) the KV depends on
        self.cache_limit: int | None = None  # at most this many leading tokens from the prefix cache
        self.detokenizer: Detokenizer | None = None  # incremental text (streamed, or with stop strings)
        self.logprobs: list[dict[int, Logprob]] = []
        # Top alternatives per sampled token; None: no log-probabilities (ranked samples need at least the token's).
        self.logprobs_k = params.logprobs if params.logprobs is not None or not params.ranks_samples else 0
        # The first sample computes the prompt's log-probabilities for its request; entry 0 (token 0) is None.
        wants_prompt = params.prompt_logprobs is not None and index == 0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = [None] if wants_prompt else None
        self.depth: int | None = None  # layers a prefill-only request needs; None: the whole model
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
    def prefill_only(self) -> bool:
        return self.params.max_tokens == 0

    def reusable_prefix(self) -> int | None:
        """Leading tokens whose KV may come from the prefix cache without losing a row the request still
        wants: captured rows, prompt log-probabilities not yet delivered. None: no limit."""
        limits = [self.taps.reusable_prefix(len(self.token_ids))] if self.taps.streams else []
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt:
            limits.append(len(self.prompt_logprobs) - 1)
        return min(limits, default=None)
