"""The LoRA adapters' updates of one projection, for every adapter the engine holds at once (vlens.engine.lora).

An adapter changes a projection y = W x + b into y + s B A x (PEFT's LoRA: A [r, in], B [out, r], its scaling s).
Each of `slots` adapters has `parts` x `rank` rows of the stacks here, one block of `rank` a part the adapter
adapts (q, k and v of one fused projection are three), zero where it adapts less; B is stored scaled. A forward
multiplies every row by every slot's A, keeps each row's own slot (ForwardContext.lora: one-hot rows, all zero for
a request without an adapter, whose output is then the base projection's to the bit) and adds those rows' B:
two GEMMs of fixed shape whatever the mix of adapters in the step. Not a module: its tensors are no parameters of
the model (no checkpoint holds them, no state_dict lists them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlens.context import lora_rows


class LoraWeights:
    def __init__(self, in_features: int, out_features: int, slots: int, parts: int, rank: int, like: torch.Tensor):
        self.slots, self.rank, self.width = slots, rank, parts * rank
        self.a = torch.zeros(slots * self.width, in_features, dtype=like.dtype, device=like.device)
        self.b = torch.zeros(out_features, slots * self.width, dtype=like.dtype, device=like.device)

    def put(self, slot: int, updates: list[tuple[slice | None, torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` takes an adapter's updates of this projection: (its rows of the output, None: all; A, s B);
        nothing for an adapter that leaves it as it is."""
        start = slot * self.width
        self.a[start : start + self.width] = 0
        self.b[:, start : start + self.width] = 0
        for part, (rows, a, b) in enumerate(updates):
            at = start + part * self.rank
            self.a[at : at + a.shape[0]] = a.to(self.a)
            self.b[slice(None) if rows is None else rows, at : at + a.shape[0]] = b.to(self.b)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y`, the base projection of `x`, plus each row's adapter's update (`y` itself in a step without one)."""
        rows = lora_rows()
        if rows is None:
            return y
        h = F.linear(x, self.a).view(*x.shape[:-1], self.slots, self.width) * rows[..., None]
        return y + F.linear(h.flatten(-2), self.b)
