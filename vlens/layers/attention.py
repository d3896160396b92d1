"""The reference attention backend: causal attention of a packed batch, over a paged KV cache or none.

Pure PyTorch, so it runs wherever torch does and is the yardstick for faster backends. Tokens arrive
packed ([T, heads, d]); each attention group lays its sequences on a [B, max_q] grid for one SDPA
call (slots past a sequence's end are masked and never read back). With a cache, new keys are
written to their slots first and each sequence then attends over the keys its block table names.

SDPA cannot soft-cap scores (Gemma 2), so a layer with a softcap takes a written-out path that does
what HF's eager attention does: scale, cap * tanh(scores / cap), mask, float32 softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlens.context import AttentionGroup, get_context


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        window: int | None,
        scale: float | None = None,
        softcap: float | None = None,
        patterns: tuple[str, str] = ("", ""),
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window
        self.softcap = softcap
        self.hook_attn_scores, self.hook_pattern = patterns
        # Bound by the engine to [num_slots, num_kv_heads, head_dim] views of its cache.
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if ctx.slot_mapping is not None:
            self.k_cache.index_copy_(0, ctx.slot_mapping, k)
            self.v_cache.index_copy_(0, ctx.slot_mapping, v)
        # Scores and probabilities of only the rows asked for, from their queries and their sequence's
        # keys (the cache holds every key of every sequence; a cache-less forward packs them in k).
        keys = self.k_cache if ctx.slot_mapping is not None else k
        if self.hook_attn_scores in ctx.taps: ctx.taps[self.hook_attn_scores].attend(q, keys, self)  # fmt: skip
        if self.hook_pattern in ctx.taps: ctx.taps[self.hook_pattern].attend(q, keys, self)  # fmt: skip
        if len(ctx.groups) == 1:
            return self._attend(q, k, v, ctx.groups[0])
        out = torch.empty_like(q)
        for g in ctx.groups:
            out[g.rows] = self._attend(q[g.rows], k[g.rows], v[g.rows], g)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        if g.key_slots is not None:
            keys, values = self.k_cache[g.key_slots], self.v_cache[g.key_slots]
        else:
            keys, values = _to_grid(k, g), _to_grid(v, g)
        mask = g.masks[self.window]
        q, keys, values = _to_grid(q, g).transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        if self.softcap is None:
            out = F.scaled_dot_product_attention(
                q,
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )
        else:
            out = self._capped(q, keys, values, mask)
        out = out.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
        return out if g.q_index is None else out.index_select(0, g.q_index)

    def _capped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """[B, H, q, d] attention with soft-capped scores."""
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is None:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, v)


def _to_grid(x: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """[rows, h, d] packed -> [B, max_q, h, d] grid (zeros in unused slots)."""
    if g.q_index is None:
        return x.view(g.batch, g.max_q, *x.shape[1:])
    grid = x.new_zeros(g.batch * g.max_q, *x.shape[1:])
    grid.index_copy_(0, g.q_index, x)
    return grid.view(g.batch, g.max_q, *x.shape[1:])
