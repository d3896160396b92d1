"""Per-request changes to the logits before sampling: OpenAI's `logit_bias`, `presence_penalty` and
`frequency_penalty`, and vLLM's `repetition_penalty`, applied on the device in vLLM's order (bias, then
penalties).

The host lists, once per step, which (row, token) pairs each change touches — the bias entries, and
the prompt and output tokens of penalised rows — and sends them in a few flat tensors; counts and masks
are scattered on the device, so nothing comes back to the host. Rows without a change are left exactly
as they were (they add zero and are divided by nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vlens.engine.sequence import Sequence


@dataclass
class LogitAdjustments:
    """One step's adjustments: flat (row, token[, value]) lists as device tensors, per-row penalties."""

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
        out = logits.float().index_put((self.bias_rows, self.bias_tokens), self.bias_values, accumulate=True)
        if not self.any_penalty:
            return out
        ones = torch.ones_like(self.output_tokens, dtype=torch.float32)
        counts = torch.zeros_like(out).index_put((self.output_rows, self.output_tokens), ones, accumulate=True)
        generated = counts > 0
        seen = generated.index_put((self.seen_rows, self.seen_tokens), torch.ones_like(self.seen_tokens, dtype=torch.bool))
        rep = self.repetition[:, None]
        out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
        return out - self.frequency[:, None] * counts - self.presence[:, None] * generated
