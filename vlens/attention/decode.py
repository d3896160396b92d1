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

from vlens.attention.metadata import AttentionMetadata, LayerKind
from vlens.attention.sdpa import capped_attention, sdpa


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
        mask = state.masks[layer.window]
        if layer.softcap is not None:
            return capped_attention(q[:, :, None, :], keys, values, mask, layer)[:, :, 0, :]
        # The query heads of one KV head share its keys and the row's mask: as that head's queries they need
        # no GQA support from the kernel, which lets SDPA take its memory-efficient (masked) kernel on CUDA.
        rows, heads, dim = q.shape
        grouped = q.view(rows, layer.num_kv_heads, heads // layer.num_kv_heads, dim)
        out = sdpa(grouped, keys, values, attn_mask=mask, scale=layer.scale)
        return out.reshape(rows, heads, dim)
