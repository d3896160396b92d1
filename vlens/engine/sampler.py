"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds, after
the requests' logit bias and penalties (penalties.py).

Each row draws ONE uniform number from a counter-based hash of (request seed, position) and inverts
the CDF of its filtered distribution. That makes a seeded request's sample independent of what else
is in the batch, needs no per-request generator objects, and costs no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vlens.engine.penalties import LogitAdjustments

if TYPE_CHECKING:
    from vlens.engine.sequence import Sequence

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors; multipliers < 2**31 keep
    every product below 2**63, so no step overflows."""
    for mult in (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39):
        x = (x ^ (x >> 16)) * mult & _MASK32
    return x ^ (x >> 16)


def uniform(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A deterministic float64 in (0, 1) per (seed, offset) pair."""
    x = _mix32((_mix32(seeds & _MASK32) ^ (offsets & _MASK32)) & _MASK32)
    return (x.double() + 0.5) / 2**32


@dataclass
class SamplingBatch:
    """Per-row sampling settings as device tensors (built once per step on the host)."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] long; 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] long
    offsets: torch.Tensor  # [B] long: position of the token being sampled
    all_greedy: bool
    any_top_k_or_p: bool
    any_min_p: bool
    adjust: LogitAdjustments | None = None  # logit bias and penalties; None when no row has any

    @classmethod
    def of(cls, seqs: list[Sequence], device: torch.device) -> SamplingBatch:
        """The settings of the sequences sampled in a step, in their order."""
        p = [s.params for s in seqs]
        # two host tensors, one copy each: this runs every step
        floats = torch.tensor([[x.temperature for x in p], [x.top_p for x in p], [x.min_p for x in p]], dtype=torch.float32)
        longs = torch.tensor([[x.top_k for x in p], [s.seed for s in seqs], [len(s.token_ids) for s in seqs]])
        (temperature, top_p, min_p), (top_k, seeds, offsets) = floats.to(device, non_blocking=True), longs.to(device, non_blocking=True)
        return cls(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=seeds,
            offsets=offsets,
            all_greedy=all(x.temperature == 0 for x in p),
            any_top_k_or_p=any(x.temperature > 0 and (x.top_k > 0 or x.top_p < 1) for x in p),
            any_min_p=any(x.temperature > 0 and x.min_p > 0 for x in p),
            adjust=LogitAdjustments.of(seqs, device),
        )


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] float logits -> [B] sampled token ids (on the device)."""
    if batch.adjust is not None:
        logits = batch.adjust.apply(logits)
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    scaled = logits.float() / temperature[:, None]
    if batch.any_min_p:
        probs = scaled.softmax(dim=-1)
        threshold = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
    order = None
    if batch.any_top_k_or_p:
        scaled, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(scaled.shape[-1], device=scaled.device)
        k = torch.where(batch.top_k > 0, batch.top_k, scaled.shape[-1])
        cut = rank[None, :] >= k[:, None]
        probs = scaled.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the better tokens: keep the one crossing top_p
        cut |= (before >= batch.top_p[:, None]) & (batch.top_p < 1)[:, None]
        scaled = scaled.masked_fill(cut, float("-inf"))
    cdf = scaled.softmax(dim=-1).double().cumsum(dim=-1)
    u = uniform(batch.seeds, batch.offsets).to(cdf.device)[:, None] * cdf[:, -1:]
    choice = torch.searchsorted(cdf, u).clamp_max(cdf.shape[-1] - 1).squeeze(-1)
    if order is not None:
        choice = order.gather(-1, choice[:, None]).squeeze(-1)
    return torch.where(batch.temperature > 0, choice, greedy)

