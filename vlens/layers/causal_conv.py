"""A depthwise causal convolution over packed sequences, each sequence's last inputs kept between its forwards:
Qwen 3.5's linear attention convolves its queries, keys and values before the delta rule, a Mamba 2 mixer its x, B
and C before the scan, LFM2's short convolution B·x."""

from __future__ import annotations

import torch
from torch import nn

from vlens.attention.metadata import AttentionMetadata
from vlens.layers.slot_states import Shapes, SlotStates, step_slots


class CausalConv(nn.Conv1d, SlotStates):
    """nn.Conv1d's parameters (weight [channels, 1, kernel], its checkpoints' name), applied to each sequence's rows
    of a packed batch: the kernel - 1 inputs before a sequence's first row here are its saved ones (zeros where it
    starts), and its last kernel - 1 are saved for its next forward (`state` [slots, kernel - 1, channels]). Summed in
    float32 and rounded once, as HF's conv1d computes."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__(channels, channels, kernel, groups=channels, bias=bias)
        self.state: torch.Tensor | None = None

    def slot_shapes(self) -> Shapes:
        return {"state": ((self.kernel_size[0] - 1, self.in_channels), None)}

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        kernel, width = self.kernel_size[0], self.kernel_size[0] - 1
        t, batch = x.shape[0], len(meta.query_lens)
        starts = meta.cu_seqlens_q.long()
        # Each sequence's `width` inputs before its first row here (its saved ones, or zeros), then its rows, the
        # sequences one after the other: a row's earlier inputs are the rows just before it there
        at = torch.arange(t, device=x.device) + (meta.token_seq + 1) * width
        slots = step_slots(self, "state", meta)
        padded = x.new_zeros(t + batch * width, x.shape[1])
        padded[at] = x
        if slots is not None:
            saved = (starts[:-1] + torch.arange(batch, device=x.device) * width)[:, None] + torch.arange(width,
                                                                                                       device=x.device)
            padded[saved.flatten()] = slots.read(self.state).flatten(0, 1)
        weight = self.weight[:, 0].float()  # [channels, kernel]: the last tap reads the row itself
        out = x.float() * weight[:, -1]
        for back in range(1, kernel):
            out = out + padded[at - back].float() * weight[:, -1 - back]
        if slots is not None:  # (the last `width` inputs of each sequence: of its rows, then of its saved ones)
            slots.write(self.state, padded[saved + starts[1:, None] - starts[:-1, None]])
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)
