"""FlexAttention over the paged KV cache: one call per layer for the whole packed batch, no key gather.

The queries are the packed batch as it is ([1, H, T, d]); the keys are the whole cache ([1, H_kv,
slots, d]). A block mask maps the two: query row r (sequence s, position p) may see cache slot k when
s's block table holds k's block, at page i, and k is key j = i * block_size + k % block_size with j <= p
(and p - window < j for a sliding-window layer). A block may be in several tables at once (a cached or
borrowed prefix), so a slot is looked up per sequence, not given one owner. Soft-capping (Gemma 2) is a
score mod. FlexAttention is fast only compiled (`compiled=True`, once per shape; ≈25 s on a 2-core CPU,
far less on a GPU); uncompiled it is exact and slow, which the CPU tests use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from vlens.attention.metadata import AttentionMetadata, LayerKind


@dataclass
class FlexState:
    masks: dict[int | None, BlockMask]  # window -> block mask over (packed rows, keys)
    paged: bool  # keys are the cache's slots (else the packed keys of this forward)


class FlexBackend:
    name = "flex"

    def __init__(self, compiled: bool):
        self.attend = torch.compile(flex_attention) if compiled else flex_attention
        self._score_mods: dict[float, object] = {}

    def prepare(self, meta: AttentionMetadata, kinds: set[LayerKind], dtype: torch.dtype) -> FlexState:
        device = meta.positions.device
        windows = {kind.window for kind in kinds}
        q_seq, q_pos = meta.token_seq, meta.positions
        if meta.paged:  # every slot of the cache, so the shapes do not change from step to step
            page_of, bs, num_keys = _pages(meta).to(device), meta.block_size, meta.num_slots

            def key(q, kv):  # (whether q's sequence holds slot kv, and at which position)
                page = page_of[q_seq[q], kv // bs]
                return page >= 0, page * bs + kv % bs
        else:  # keys are packed like the queries
            num_keys = len(q_pos)

            def key(q, kv):
                return q_seq[kv] == q_seq[q], q_pos[kv]

        masks = {}
        for window in windows:

            def mask_mod(b, h, q, kv, window=window):
                held, position = key(q, kv)
                ok = held & (position <= q_pos[q])
                return ok if window is None else ok & (position > q_pos[q] - window)

            masks[window] = create_block_mask(mask_mod, 1, None, len(q_pos), num_keys, device=device)
        return FlexState(masks, meta.paged)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, state: FlexState) -> torch.Tensor:
        keys, values = (layer.k_cache, layer.v_cache) if state.paged else (k, v)
        out = self.attend(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            score_mod=self._softcap(layer.softcap),
            block_mask=state.masks[layer.window],
            scale=layer.scale,
            enable_gqa=layer.num_kv_heads != layer.num_heads,
        )
        return out[0].transpose(0, 1)

    def _softcap(self, cap: float | None):
        if cap is None:
            return None
        if cap not in self._score_mods:  # one function per cap, so a compiled kernel is reused

            def score_mod(score, b, h, q, kv):
                return torch.tanh(score / cap) * cap

            self._score_mods[cap] = score_mod
        return self._score_mods[cap]


def _pages(meta: AttentionMetadata) -> torch.Tensor:
    """[sequences, cache blocks] (host): the page at which each sequence's block table holds each block,
    -1 where it does not."""
    tables, bs = meta.block_tables, meta.block_size
    pages = torch.arange(tables.shape[1]).expand_as(tables)
    held = pages < torch.tensor(meta.pages)[:, None]
    seqs = torch.arange(len(tables))[:, None].expand_as(tables)
    page_of = torch.full((len(tables), meta.num_slots // bs), -1, dtype=torch.long)
    page_of[seqs[held], tables[held]] = pages[held]
    return page_of
