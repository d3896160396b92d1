"""The runner's device buffers: every tensor a forward reads besides the weights and the KV cache, each
allocated once at its largest size.

All fields live at fixed offsets of one device block, and of one host staging block (pinned on CUDA; on
the CPU the staging block is the device block itself). A step writes its values into the staging block
(`put`: a numpy copy, no torch op) and `flush`, right before the forward, sends the bytes the step wrote
in one host-to-device copy: the forward reads tensors whose addresses never change — what a replayed
CUDA graph needs — and a step costs one copy, not one per field (a profile on an H200 showed ~10 copies
a step, each with its own event, at ~1.5 ms of host time a step).
"""

from __future__ import annotations

import math

import numpy as np
import torch

ALIGN = 64  # bytes: every field starts on a cache line


class StepBuffers:
    def __init__(self, fields: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        self.device = device
        self._cuda = device.type == "cuda"
        self._sizes = {name: (math.prod(shape), dtype) for name, (shape, dtype) in fields.items()}
        self._span: tuple[int, int] | None = None  # bytes of the staging block written since the last flush
        self._copied: torch.cuda.Event | None = None  # the last flush's copy out of the staging block
        self.generation = 0  # counts reallocations: a CUDA graph captured before one reads stale buffers
        self._allocate()

    def reserve(self, name: str, numel: int, dtype: torch.dtype) -> None:
        """Buffer `name` holds at least `numel` elements from now on."""
        if name not in self._sizes or self._sizes[name][0] < numel:
            self._sizes[name] = (numel, dtype)
            self._allocate()

    def _allocate(self) -> None:
        """Fresh blocks with every field at its current size. What was put since the last flush is sent first:
        the device views already handed out this step point into the old block, which they keep alive."""
        self.flush()
        self.generation += 1
        self._offsets, at = {}, 0
        for name, (numel, dtype) in self._sizes.items():
            self._offsets[name] = at
            at += -(-numel * dtype.itemsize // ALIGN) * ALIGN
        with torch.inference_mode(False):  # normal tensors, which a forward outside inference mode may write too
            self._dev_block = torch.zeros(at, dtype=torch.uint8, device=self.device)
            self._host_block = torch.zeros(at, dtype=torch.uint8, pin_memory=True) if self._cuda else self._dev_block
        self._dev: dict[str, torch.Tensor] = {}
        self._host: dict[str, np.ndarray] = {}
        # (name, shape) -> (the front `put` returns, where its bytes start and stop in the blocks)
        self._fronts: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, int, int]] = {}
        for name, (numel, dtype) in self._sizes.items():
            start, stop = self._offsets[name], self._offsets[name] + numel * dtype.itemsize
            self._dev[name] = self._dev_block[start:stop].view(dtype)
            self._host[name] = self._host_block[start:stop].view(dtype).numpy()

    def put(self, name: str, values: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Host `values` into the front of buffer `name`; returns that front on the device, whose contents
        are there once `flush` has run. A buffer too small for them grows (eager forwards only: a captured
        graph never meets a larger step)."""
        values = np.asarray(values)
        numel, key = values.size, (name, values.shape)
        known = self._fronts.get(key)  # (a step puts the shapes of the step before: a dict lookup, no torch op)
        if known is None:
            if numel > self._sizes[name][0]:
                self._sizes[name] = (max(numel, 2 * self._sizes[name][0]), self._sizes[name][1])
                self._allocate()
            start = self._offsets[name]
            front = self._dev[name][:numel]
            front = front if values.ndim == 1 else front.view(values.shape)
            known = self._fronts[key] = (front, start, start + numel * self._sizes[name][1].itemsize)
        front, start, stop = known
        if self._copied is not None:  # the staging block still feeds the previous flush's copy
            self._copied.synchronize()
            self._copied = None
        self._host[name][:numel] = values.reshape(-1)
        self._span = (start, stop) if self._span is None else (min(start, self._span[0]), max(stop, self._span[1]))
        return front

    def flush(self) -> None:
        """Send what was put since the last flush to the device, in one copy (nothing to do on the CPU)."""
        if self._span is None:
            return
        if self._cuda:
            start, stop = self._span
            self._dev_block[start:stop].copy_(self._host_block[start:stop], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        self._span = None
