"""vLLM's `LLM.beam_search`: the `beam_width` likeliest continuations of each prompt, by cumulative log-probability
over length to the power `length_penalty`, as vLLM scores them.

Each step runs every live beam one token further as an engine request (`max_tokens=1` with the top 2 x beam_width
log-probabilities), so a beam's prompt and earlier tokens come from the prefix cache and only its last token is
computed; every beam's candidates are pooled per prompt and the best `beam_width` kept. A candidate that ends in EOS
is complete (unless `ignore_eos`); at the end the complete ones and the live ones are ranked together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vlens.outputs import Logprob, RequestOutput
from vlens.sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0  # a beam's score: cumulative log-probability / length ** length_penalty

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: {value!r} is not allowed; expected an int >= 1")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)):
            raise ValueError(f"length_penalty: {self.length_penalty!r} is not allowed; expected a number")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's, then the beam's (vLLM's layout)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per generated token: the candidates it was among
    cum_logprob: float = 0.0
    text: str | None = None  # the tokens decoded, the prompt's included
    finish_reason: str | None = None  # "stop" (it ended in EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the best beam_width, best first


class BeamSearch:
    """One search over prompts, a step at a time, for whoever runs the steps (LLM.beam_search through
    LLM.generate; vlens serve through its engine thread): `beams()` are the token lists to run one token further,
    each as the request `step`; `take(outputs)` pools their candidates; `results()` ranks what is left."""

    def __init__(self, prompts: Sequence[list[int]], params: BeamSearchParams, eos: frozenset[int]):
        self.params, self.eos, self.steps = params, eos, 0
        self.step = SamplingParams(max_tokens=1, temperature=0, logprobs=2 * params.beam_width, ignore_eos=True)
        self.live = [[BeamSearchSequence(list(ids))] for ids in prompts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]

    def score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (beam.tokens[-1] in self.eos)
        return beam.cum_logprob / length**self.params.length_penalty

    def beams(self) -> list[list[int]]:
        """The token lists this step runs (none: the search is over)."""
        if self.steps == self.params.max_tokens:
            return []
        return [beam.tokens for group in self.live for beam in group]

    def take(self, outputs: Sequence[RequestOutput]) -> None:
        """The step's outputs, one per beam of beams() in its order."""
        self.steps += 1
        outputs = iter(outputs)
        for i, group in enumerate(self.live):
            candidates = []
            for beam in group:
                entry = next(outputs).outputs[0].logprobs[0]
                for token, logprob in entry.items():
                    new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry],
                                             beam.cum_logprob + logprob.logprob)  # fmt: skip
                    if token in self.eos and not self.params.ignore_eos:
                        new.finish_reason = "stop"
                        self.done[i].append(new)
                    else:
                        candidates.append(new)
            self.live[i] = sorted(candidates, key=self.score, reverse=True)[: self.params.beam_width]

    def results(self, tokenizer: Any) -> list[BeamSearchOutput]:
        """Per prompt, the best beam_width beams, complete or not, best first; each one's text all its tokens'."""
        results = []
        for group, complete in zip(self.live, self.done, strict=True):
            for beam in group:
                beam.finish_reason = "length"
            best = sorted(complete + group, key=self.score, reverse=True)[: self.params.beam_width]
            for beam in best:
                beam.text = None if tokenizer is None else tokenizer.decode(beam.tokens)  # (vLLM's: all of it)
            results.append(BeamSearchOutput(best))
        return results


def beam_search(
    generate: Callable[[list[list[int]], SamplingParams], list[RequestOutput]], prompts: Sequence[list[int]],
    params: BeamSearchParams, eos: frozenset[int], tokenizer: Any,
) -> list[BeamSearchOutput]:  # fmt: skip
    """`generate`: an engine's, the prompts in one batch (LLM.generate's)."""
    search = BeamSearch(prompts, params, eos)
    while beams := search.beams():
        search.take(generate(beams, search.step))
    return search.results(tokenizer)
