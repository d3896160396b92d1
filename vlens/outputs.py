"""What the engine hands out: per step a `RequestDelta` for each request that advanced, and on its last
one the whole `RequestOutput`, shaped like vLLM's plus the activations the request captured."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely (a token outside the top k: how many are at least as likely)
    decoded_token: str | None = None  # the token's text alone (None without a tokenizer), as vLLM gives it


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop token or stop string) | "length"
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None  # the stop string or token that ended it, if any

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the generated tokens' log-probabilities, as vLLM gives it when logprobs were asked for
        (None otherwise, as in vLLM)."""
        if self.logprobs is None:
            return None
        return sum(step[token].logprob for token, step in zip(self.token_ids, self.logprobs))


@dataclass(frozen=True)
class RequestMetrics:
    """vLLM's: when a request arrived, was first scheduled, got its first generated token (None: it generated
    none) and finished, in seconds of time.time(), and the tokens of its longest sample (the server's latency
    histograms read them)."""

    arrival_time: float
    first_scheduled_time: float
    first_token_time: float | None
    finished_time: float
    num_generated_tokens: int = 0


@dataclass(frozen=True)
class PlaceholderRange:
    """vLLM's: `length` prompt positions from `offset` that an image's rows fill (an image's tokens, consecutive)."""

    offset: int
    length: int


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one per sample returned (n), in index order
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # with prompt_logprobs: None, then one per prompt token
    activations: dict[str, torch.Tensor] = field(default_factory=dict)  # hook -> CPU [rows, ...]
    activation_positions: torch.Tensor | None = None  # [rows] sequence position of each row
    hidden_states: torch.Tensor | None = None  # with return_hidden_states: ln_final.hook_out, all rows
    logit_lens: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # hook -> (ids, logprobs) [rows, k]
    # Capture(sae=...): hook -> (ids int32, values) [rows, top_k], or the named latents [rows, n]
    sae_features: dict[str, tuple[torch.Tensor, torch.Tensor] | torch.Tensor] = field(default_factory=dict)
    sae_errors: dict[str, torch.Tensor] = field(default_factory=dict)  # sae_error=True: hook -> [rows]
    # vLLM's: where its images' rows are in the prompt ({"image": [ranges]}; empty without images), so that their
    # activations can be picked from out.activations by activation_positions
    multi_modal_placeholders: dict[str, list[PlaceholderRange]] = field(default_factory=dict)
    num_cached_tokens: int | None = None  # vLLM's: prompt tokens the prefix cache gave (of the sample that computed it)
    metrics: RequestMetrics | None = None  # vLLM's: when it arrived, first ran, first generated and ended

    @property
    def finished(self) -> bool:
        """vLLM's flag: always true here, since a RequestOutput is made only when its request has ended (a
        stream's progress comes as RequestDeltas)."""
        return True


@dataclass
class EmbeddingOutput:
    embedding: torch.Tensor  # [d] float: a hook's rows pooled (vlens.embedding); vLLM's is a list of floats


@dataclass
class EmbeddingRequestOutput:
    """vLLM's output of LLM.embed."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per class (vLLM's): a softmax's; a sigmoid's for one class (classifier_activation)
    label: str  # the likeliest class's name (the checkpoint's id2label)
    logits: list[float]  # the head's own outputs: a reward model's score is its one logit

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """vLLM's output of LLM.classify."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float  # a cross-encoder's relevance of one pair: its one class's probability (a sigmoid of its logit)


@dataclass
class ScoringRequestOutput:
    """vLLM's output of LLM.score."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class PoolingOutput:
    data: torch.Tensor  # float32: a pooling task's tensor (vlens.encode), [tokens, ...] for a token task


@dataclass
class PoolingRequestOutput:
    """vLLM's output of LLM.encode and LLM.reward."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class RequestDelta:
    """What one step added to one request. Its texts add up to the final text: a streamed request (or
    one with stop strings) gets text as it becomes final, any other the whole text on its last delta."""

    request_id: str
    token_ids: list[int]  # generated in this step
    text: str
    logprobs: list[dict[int, Logprob]]  # one per token, when the request asked for logprobs
    finish_reason: str | None = None  # set on the sample's last delta ...
    output: RequestOutput | None = None  # ... and the request's last also carries its whole output, captured rows included
    index: int = 0  # which sample of the request advanced (n, best_of)
    stop_reason: int | str | None = None  # the stop string or token that ended the sample, if any
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # on the first delta of the sample that computes them

    @property
    def finished(self) -> bool:
        return self.output is not None
