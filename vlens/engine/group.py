"""The samples of one request (`SamplingParams.n`, `best_of`): sequences of one prompt, each with its
own seed, ending in one RequestOutput.

Sample 0 runs first; the others wait until it has computed the prompt, so that they find its full
blocks in the prefix cache and compute only the last, partial one. A seeded request's sample i is
seeded seed + i (vLLM's rule), so it equals the request sent alone with that seed.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlens.engine.sequence import Sequence, Status


@dataclass
class SampleGroup:
    request_id: str
    seqs: list[Sequence]  # sample i at index i
    held: list[Sequence]  # samples not yet queued: they wait for sample 0's prompt
    done: int = 0  # samples finished

    @property
    def finished(self) -> bool:
        return self.done == len(self.seqs)

    def release(self) -> list[Sequence]:
        """The held samples, once sample 0 has computed the prompt (or ended)."""
        first = self.seqs[0]
        if not self.held or (first.num_computed < first.num_prompt and first.status is not Status.FINISHED):
            return []
        held, self.held = self.held, []
        return held

    def returned(self) -> list[Sequence]:
        """The samples the request returns: all, or with best_of the n of highest mean log-probability
        per generated token (OpenAI's rule)."""
        params = self.seqs[0].params
        if not params.ranks_samples:
            return self.seqs

        def mean_logprob(seq: Sequence) -> float:
            values = [entry[token].logprob for token, entry in zip(seq.generated, seq.logprobs)]
            return sum(values) / max(1, len(values))

        return sorted(self.seqs, key=mean_logprob, reverse=True)[: params.n]
