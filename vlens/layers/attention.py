"""The reference attention backend: causal attention of a packed batch, over a paged KV cache or none.

Pure PyTorch, so it runs wherever torch does and is the yardstick for faster backends. Tokens arrive
packed ([T, heads, d]); the backend lays them on a [B, max_q] grid only for the SDPA call (slots past
a sequence's end are masked out and never read back). With a cache, new keys are written to their
slots first and each sequence then attends over the keys its block table names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlens.context import get_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.window = window
        # Bound by the engine to [num_slots, num_kv_heads, head_dim] views of its cache.
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if ctx.slot_mapping is not None:
            self.k_cache.index_copy_(0, ctx.slot_mapping, k)
            self.v_cache.index_copy_(0, ctx.slot_mapping, v)
        if ctx.key_slots is not None:
            keys, values = self.k_cache[ctx.key_slots], self.v_cache[ctx.key_slots]
        else:
            keys, values = _to_grid(k, ctx), _to_grid(v, ctx)
        mask = ctx.mask(self.window)
        out = F.scaled_dot_product_attention(
            _to_grid(q, ctx).transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        out = out.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
        return out if ctx.q_index is None else out.index_select(0, ctx.q_index)


def _to_grid(x: torch.Tensor, ctx) -> torch.Tensor:
    """[T, h, d] packed -> [B, max_q, h, d] grid (zeros in unused slots)."""
    if ctx.q_index is None:
        return x.view(ctx.batch, ctx.max_q, *x.shape[1:])
    grid = x.new_zeros(ctx.batch * ctx.max_q, *x.shape[1:])
    grid.index_copy_(0, ctx.q_index, x)
    return grid.view(ctx.batch, ctx.max_q, *x.shape[1:])
