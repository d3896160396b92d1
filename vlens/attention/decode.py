"""Decode attention over fixed-shape buffers: the kernel of the runner's static decode step, which a CUDA
graph captures once per (batch bucket, page bucket) and replays.

Every tensor it reads is a front of the runner's buffers with the bucket's shape: the block tables
[B, pages] and the context lengths [B]. `prepare` turns them into key slots and masks with tensor ops
only (no host work, no data-dependent shape), so a replay recomputes them from whatever the host wrote.
Each row's keys are gathered from the paged cache and read by one SDPA call per layer; keys past a
row's context are masked, and rows that only pad the batch attend to the scratch slot they wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlens.attention.metadata import AttentionMetadata, LayerKind
from vlens.attention.sdpa import capped_attention


@dataclass
class DecodeState:
    key_slots: torch.Tensor  # [B, pages * block size] cache slot of key j of each row
    masks: dict[int | None, torch.Tensor]  # window -> [B, 1, 1, keys] which keys each row may see


class DecodeBackend:
    name = "decode"

    def prepare(self, meta: AttentionMetadata, kinds: set[LayerKind], dtype: torch.dtype) -> DecodeState:
        tables, context = meta.block_tables_device, meta.context_lens_device
        bs = meta.block_size
        j = torch.arange(tables.shape[1] * bs, device=tables.device)
        key_slots = tables[:, j // bs] * bs + j % bs
        position = (context - 1)[:, None]  # each row is its sequence's last token
        masks = {}
        for window in {kind.window for kind in kinds}:
            allowed = j[None, :] <= position
            if window is not None:
                allowed = allowed & (j[None, :] > position - window)
            masks[window] = allowed[:, None, None, :]
        return DecodeState(key_slots, masks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, state: DecodeState) -> torch.Tensor:
        keys = layer.k_cache[state.key_slots].transpose(1, 2)  # [B, H_kv, keys, d]
        values = layer.v_cache[state.key_slots].transpose(1, 2)
        q = q[:, :, None, :]  # [B, H, 1, d]
        mask = state.masks[layer.window]
        if layer.softcap is None:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=layer.scale, enable_gqa=layer.num_kv_heads != layer.num_heads
            )
        else:
            out = capped_attention(q, keys, values, mask, layer)
        return out[:, :, 0, :]
