"""The runner's device buffers: every tensor a forward reads besides the weights and the KV cache, each
allocated once at its largest size. A step writes its values into the front of a host staging copy
(pinned on CUDA) and from there into the front of the device buffer, so the forward reads tensors whose
addresses never change — what a replayed CUDA graph needs — and a step costs one small copy per field.
"""

from __future__ import annotations

import math

import numpy as np
import torch


class StepBuffers:
    def __init__(self, fields: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        self.device = device
        self._cuda = device.type == "cuda"
        self._dev: dict[str, torch.Tensor] = {}
        self._host: dict[str, torch.Tensor] = {}
        self._copied: dict[str, torch.cuda.Event] = {}  # the last copy out of each staging buffer
        self.generation = 0  # counts reallocations: a CUDA graph captured before one reads stale buffers
        for name, (shape, dtype) in fields.items():
            self._allocate(name, math.prod(shape), dtype)

    def reserve(self, name: str, numel: int, dtype: torch.dtype) -> None:
        """Buffer `name` holds at least `numel` elements from now on."""
        if name not in self._dev or self._dev[name].numel() < numel:
            self._allocate(name, numel, dtype)

    def _allocate(self, name: str, numel: int, dtype: torch.dtype) -> None:
        self.generation += 1
        self._copied.pop(name, None)
        self._dev[name] = torch.zeros(numel, dtype=dtype, device=self.device)
        self._host[name] = torch.zeros(numel, dtype=dtype, pin_memory=True) if self._cuda else self._dev[name]

    def capacity(self, name: str) -> int:
        return self._dev[name].numel()

    def view(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The device buffer's front as a contiguous tensor of `shape` (the same address every step)."""
        return self._dev[name][: math.prod(shape)].view(shape)

    def put(self, name: str, values: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Host `values` into the front of buffer `name`; returns that front on the device. A buffer too
        small for them grows (eager forwards only: a captured graph never meets a larger step)."""
        values = torch.as_tensor(values)
        numel, dev = values.numel(), self._dev[name]
        if numel > dev.numel():
            self._allocate(name, max(numel, 2 * dev.numel()), dev.dtype)
        event = self._copied.get(name)
        if event is not None:  # the staging buffer still feeds the previous step's copy
            event.synchronize()
        self._host[name][:numel].copy_(values.reshape(-1))
        out = self.view(name, tuple(values.shape))
        if self._cuda:
            out.copy_(self._host[name][:numel].view(values.shape), non_blocking=True)
            event = self._copied[name] = torch.cuda.Event()
            event.record()
        return out
