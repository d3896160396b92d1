"""Where each checkpoint tensor lands: a name -> slot map built by walking the model's modules.

By default a parameter's checkpoint name is its module path, which is why model code mirrors HF's
names. A module whose checkpoint stores it differently (fused projections kept apart, GPT-2's
transposed Conv1D weights, NeoX's per-head interleaved q/k/v, one tensor per MoE expert) says so
with a `checkpoint_slots(path)` method; the walker then leaves that module's subtree to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

Transform = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Slot:
    """One checkpoint tensor's destination: `param[index]` (all of it when index is None), after
    `transform` has put the stored tensor into vlens's layout and `source` (None: all of it) has
    picked this rank's shard of it (vlens.distributed: the loader reads only those rows or columns
    from the file where no transform needs the whole tensor)."""

    param: nn.Parameter
    index: slice | tuple | None = None
    transform: Transform | None = None
    source: tuple | None = None

    def target(self) -> torch.Tensor:
        return self.param.data if self.index is None else self.param.data[self.index]


def checkpoint_slots(module: nn.Module, path: str = "") -> dict[str, Slot]:
    """Checkpoint tensor name -> Slot for every parameter under `module` (whose own path is `path`)."""
    own = getattr(module, "checkpoint_slots", None)
    if own is not None:
        return own(path)
    prefix = f"{path}." if path else ""
    slots = {prefix + leaf: Slot(param) for leaf, param in module.named_parameters(recurse=False)}
    for name, child in module.named_children():
        slots |= checkpoint_slots(child, prefix + name)
    return slots
