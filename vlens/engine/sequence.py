"""A request in flight: its tokens, KV blocks, sampling state and the activation rows it has collected."""

from __future__ import annotations

import enum

from vlens.engine.intervene import ActiveIntervention
from vlens.engine.rows import RowStream
from vlens.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        eos_token_ids: frozenset[int],
        prompt: str | None = None,
    ):
        self.request_id, self.index, self.prompt = request_id, index, prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt = len(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self.status = Status.WAITING
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.cache_salt: object = None  # what else (besides tokens) the KV depends on
        self.streams: list[RowStream] = []  # what this request captures (set by the engine)
        self.interventions: list[ActiveIntervention] = []  # what it changes, in order (set by the engine)
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    def max_cached_tokens(self) -> int:
        """Leading tokens whose KV may come from the prefix cache without losing a wanted row."""
        return min(
            [max(s.captured_upto, s.selector.first_needed()) for s in self.streams], default=len(self.token_ids)
        )
