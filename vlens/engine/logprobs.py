"""Log-probabilities as vLLM reports them — of the unmodified model distribution, before temperature,
bias or penalties — for sampled tokens and for prompt tokens (`prompt_logprobs`).

Prompt log-probabilities come from the logits of the prompt rows, computed in the steps that compute
those rows (chunked prefill included): row p gives token p + 1's log-probability and the top-k
alternatives. Each prompt row is delivered once; rows delivered before a preemption are not asked for
again, and rows still wanted are never taken from the prefix cache (Sequence.reusable_prefix). A prompt
that borrows its prefix from another in the same step (vlens.engine.sequence.Borrow) takes that one's
entries for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vlens.outputs import Logprob

if TYPE_CHECKING:
    from vlens.engine.sequence import Sequence

# chosen [R], its rank [R], top ids [R, k], top values [R, k]
TopLogprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> TopLogprobs:
    """Log-probabilities of each row's token [R] and its rank (vLLM's: how many tokens are at least as
    likely, itself included), and the top-k alternatives' ids and values [R, k]."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    rank = (logp >= chosen[:, None]).sum(-1)
    values, ids = logp.topk(k, dim=-1)
    return chosen, rank, ids, values


class TokenText:
    """Token id -> its text (the tokenizer's decode of it alone, as vLLM names a log-probability's token),
    cached: every step names k alternatives, mostly the same few thousand tokens. Without a tokenizer, None."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        if token not in self._cache:
            self._cache[token] = self.tokenizer.decode([token])
        return self._cache[token]


def entry(logprobs: TopLogprobs, i: int, token: int, k: int, text: TokenText) -> dict[int, Logprob]:
    """Row i as vLLM's dict: the top k by rank, and the row's own token, with its rank where it is not
    among them."""
    chosen, rank, top_ids, top_values = logprobs
    ids, values = top_ids[i, :k].tolist(), top_values[i, :k].tolist()
    out = {t: Logprob(v, r + 1, text(t)) for r, (t, v) in enumerate(zip(ids, values))}
    if token not in out:
        out[token] = Logprob(float(chosen[i]), int(rank[i]), text(token))
    return out


def to_host(logprobs: TopLogprobs, blocking: bool) -> TopLogprobs:
    """Non-blocking copies are read only after a later sync (the step's copy of the sampled ids)."""
    return tuple(x.to("cpu", non_blocking=not blocking) for x in logprobs)


@dataclass
class PromptRows:
    """The packed rows of one step whose logits give prompt log-probabilities, and whose they are."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)  # the prompt token each row predicts
    owners: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, its rows), in row order
    k: int = 0
    borrowers: list[Sequence] = field(default_factory=list)  # whose first entries are their lender's

    def add(self, seq: Sequence, count: int, row: int) -> None:
        """A chunk of `count` tokens from seq.num_computed on, at packed row `row`: its prompt rows not
        yet delivered."""
        if seq.prompt_logprobs is None:
            return
        if seq.borrow is not None:
            self.borrowers.append(seq)
        start = seq.num_computed
        first = max(start, len(seq.prompt_logprobs) - 1)
        last = min(start + count, seq.num_prompt - 1)
        if last <= first:
            return
        self.rows += range(row + first - start, row + last - start)
        self.targets += seq.token_ids[first + 1 : last + 1]
        self.owners.append((seq, last - first))
        self.k = max(self.k, seq.params.prompt_logprobs)

    def compute(self, logits: torch.Tensor, blocking: bool) -> TopLogprobs:
        """On the device, from these rows' logits; on their way to the host when it returns."""
        targets = torch.tensor(self.targets, dtype=torch.long).to(logits.device, non_blocking=True)
        return to_host(top_logprobs(logits, targets, self.k), blocking)

    def deliver(self, logprobs: TopLogprobs, text: TokenText) -> None:
        """Append each sequence's new entries (after the step's sync): a borrower's lender first, whose
        entries for the prefix they share come before the borrower's own."""
        new, i = {}, 0
        for seq, count in self.owners:
            k = seq.params.prompt_logprobs
            new[seq] = [entry(logprobs, i + j, self.targets[i + j], k, text) for j in range(count)]
            i += count
        for seq, entries in new.items():
            if seq.borrow is None:
                seq.prompt_logprobs += entries
        waiting = list(self.borrowers)
        while waiting:  # a lender that borrows too is served first
            ready = [seq for seq in waiting if seq.borrow.lender not in waiting]
            for seq in ready:
                seq.prompt_logprobs += seq.borrow.lender.prompt_logprobs[1 : seq.borrow.length + 1]
                seq.prompt_logprobs += new.get(seq, [])
            waiting = [seq for seq in waiting if seq not in ready]
