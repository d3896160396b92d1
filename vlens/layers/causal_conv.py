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
        t = x.shape[0]
        rows = torch.arange(t, device=x.device)
        starts = meta.cu_seqlens_q.long()
        at = rows - starts[meta.token_seq]  # each row's index among its sequence's rows here
        slots = step_slots(self, "state", meta)
        prior = None if slots is None else slots.read(self.state)
        weight = self.weight[:, 0].float()  # [channels, kernel]: the last tap reads the row itself
        out = x.float() * weight[:, -1]
        for back in range(1, kernel):
            earlier = x[(rows - back).clamp(min=0)]
            saved = 0 if prior is None else prior[meta.token_seq, (at - back + width).clamp(0, width - 1)]
            earlier = torch.where((at >= back)[:, None], earlier, saved)
            out = out + earlier.float() * weight[:, -1 - back]
        if slots is not None:  # (the last `width` inputs of each sequence: its rows', then its saved ones before)
            counts = starts[1:] - starts[:-1]
            index = counts[:, None] - width + torch.arange(width, device=x.device)  # [B, width], < 0: saved
            mine = x[(starts[:-1, None] + index).clamp(0, t - 1)]
            before = prior[torch.arange(len(counts), device=x.device)[:, None], (index + width).clamp(0, width - 1)]
            slots.write(self.state, torch.where((index >= 0)[..., None], mine, before))
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)
