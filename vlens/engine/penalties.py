"""Per-request changes to the logits before sampling, applied on the device in vLLM's order: vLLM's
`allowed_token_ids`, `bad_words`, `min_tokens` and `structured_outputs` (tokens banned), OpenAI's `logit_bias`,
then the `presence_penalty` and `frequency_penalty` and vLLM's `repetition_penalty`.

The host lists, once per step, which (row, token) pairs each change touches — the allowed tokens, the banned
ones, the bias entries, and the prompt and output tokens of penalised rows — and sends them in a few flat
tensors, with the structures' bitmasks; masks and counts are made on the device, so nothing comes back to the
host. Rows without a change are left exactly as they were (they add zero and are divided by nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vlens.engine.structured import bitmask_rows, unpack

if TYPE_CHECKING:
    from vlens.engine.sequence import Sequence


@dataclass
class LogitAdjustments:
    """One step's adjustments: flat (row, token[, value]) lists as device tensors, per-row penalties."""

    allowed_rows: torch.Tensor | None  # the tokens rows with allowed_token_ids may sample; None: no such row
    allowed_tokens: torch.Tensor | None
    restricted: torch.Tensor | None  # [B] bool: the rows with allowed_token_ids
    banned_rows: torch.Tensor | None  # tokens a row may not sample (bad words, stop tokens before min_tokens)
    banned_tokens: torch.Tensor | None
    structure: torch.Tensor | None  # [B, words] int32: the tokens each row's structure allows; None: no structure
    bias_rows: torch.Tensor
    bias_tokens: torch.Tensor
    bias_values: torch.Tensor  # float32
    seen_rows: torch.Tensor  # prompt tokens of penalised rows (repetition_penalty counts them)
    seen_tokens: torch.Tensor
    output_rows: torch.Tensor  # generated tokens of penalised rows (every penalty counts them)
    output_tokens: torch.Tensor
    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32
    any_penalty: bool

    @classmethod
    def of(cls, seqs: list[Sequence], device: torch.device) -> LogitAdjustments | None:
        """The adjustments of a step's sampled rows; None when no row has any (the common case)."""
        if not any(s.adjusts_logits for s in seqs):
            return None
        restricted = [s.params.allowed_token_ids is not None for s in seqs]
        allowed = [(i, t) for i, s in enumerate(seqs) if restricted[i] for t in s.params.allowed_token_ids]
        banned = [(i, t) for i, s in enumerate(seqs) if s.bad_words_ids or s.params.min_tokens for t in _banned(s)]
        structured = [i for i, s in enumerate(seqs) if s.grammar is not None]
        structure = bitmask_rows(len(seqs), seqs[structured[0]].grammar.vocab_size) if structured else None
        for i in structured:
            seqs[i].grammar.fill(structure, i)
        biased = [i for i, s in enumerate(seqs) if s.params.logit_bias]
        penalties = [i for i, s in enumerate(seqs) if s.params.penalises]
        bias = [(i, t, v) for i in biased for t, v in seqs[i].params.logit_bias.items()]
        seen = [(i, t) for i in penalties for t in seqs[i].token_ids[: seqs[i].num_prompt]]
        output = [(i, t) for i in penalties for t in seqs[i].generated]

        def long(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

        def real(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)

        params = [s.params for s in seqs]
        return cls(
            allowed_rows=long([i for i, _ in allowed]) if allowed else None,
            allowed_tokens=long([t for _, t in allowed]) if allowed else None,
            restricted=torch.tensor(restricted).to(device, non_blocking=True) if allowed else None,
            banned_rows=long([i for i, _ in banned]) if banned else None,
            banned_tokens=long([t for _, t in banned]) if banned else None,
            structure=None if structure is None else structure.to(device, non_blocking=True),
            bias_rows=long([i for i, _, _ in bias]),
            bias_tokens=long([t for _, t, _ in bias]),
            bias_values=real([v for _, _, v in bias]),
            seen_rows=long([i for i, _ in seen]),
            seen_tokens=long([t for _, t in seen]),
            output_rows=long([i for i, _ in output]),
            output_tokens=long([t for _, t in output]),
            presence=real([p.presence_penalty for p in params]),
            frequency=real([p.frequency_penalty for p in params]),
            repetition=real([p.repetition_penalty for p in params]),
            any_penalty=bool(penalties),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] logits -> adjusted float32 logits (a new tensor: the raw ones still give logprobs)."""
        out, never = logits.float(), torch.full((), float("-inf"), device=logits.device)
        if self.restricted is not None:
            allowed = torch.zeros_like(out, dtype=torch.bool)
            allowed[self.allowed_rows, self.allowed_tokens] = True
            out = torch.where(self.restricted[:, None] & ~allowed, never, out)
        if self.banned_rows is not None:
            out = out.index_put((self.banned_rows, self.banned_tokens), never)
        if self.structure is not None:
            out = torch.where(unpack(self.structure, out.shape[-1]), out, never)
        out = out.index_put((self.bias_rows, self.bias_tokens), self.bias_values, accumulate=True)
        if not self.any_penalty:
            return out
        ones = torch.ones_like(self.output_tokens, dtype=torch.float32)
        counts = torch.zeros_like(out).index_put((self.output_rows, self.output_tokens), ones, accumulate=True)
        generated = counts > 0
        seen = generated.index_put((self.seen_rows, self.seen_tokens), torch.ones_like(self.seen_tokens, dtype=torch.bool))
        rep = self.repetition[:, None]
        out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
        return out - self.frequency[:, None] * counts - self.presence[:, None] * generated


def _banned(seq: Sequence) -> list[int]:
    """The tokens `seq` may not sample next: its stop tokens while it has fewer than min_tokens, and each bad word's
    last token where its tokens before that end the generated ones (vLLM's rule: only generated tokens count, so a
    word that the prompt's last tokens begin may still be completed)."""
    generated = seq.generated
    banned = list(seq.stop_ids) if len(generated) < seq.params.min_tokens else []
    for word in seq.bad_words_ids:
        before = len(word) - 1
        if before <= len(generated) and generated[len(generated) - before :] == word[:-1]:
            banned.append(word[-1])
    return banned


def spell_bad_words(words: list[str], tokenizer: Any) -> list[list[int]]:
    """Each word's tokens as it starts the text and, where they differ, as it follows a space: banned at the start
    and in the middle of a text. (vLLM keeps the second spelling only when it has as many tokens as the first, so
    that, with SmolLM2's tokenizer, "pizza" (2 tokens; " pizza" is 1) is not banned in the middle of a text.)"""
    spelt = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        after_space = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        spelt += [alone] if after_space == alone else [alone, after_space]
    return spelt
