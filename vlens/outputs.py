"""What `LLM.generate` returns, shaped like vLLM's outputs plus the activations a request captured."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None when the sampled token is outside the top k
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop token or stop string) | "length"
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None  # the stop string or token that ended it, if any


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    activations: dict[str, torch.Tensor] = field(default_factory=dict)  # hook -> CPU [rows, ...]
    activation_positions: torch.Tensor | None = None  # [rows] sequence position of each row
    hidden_states: torch.Tensor | None = None  # with return_hidden_states: ln_final.hook_normalized, all rows
    logit_lens: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # hook -> (ids, logprobs) [rows, k]
