"""Flash Attention's variable-length kernel through PyTorch (`torch.nn.attention.varlen.varlen_attn`; CUDA,
float16 or bfloat16): one call per layer for the packed batch, planned from a few tensors and two ints.

Queries are packed as they are (cu_seqlens_q). Keys, with a cache: read in place through the block tables
when the installed torch's varlen_attn takes `block_table` and `seqused_k` and the cache's block size is a
multiple of 256 (Flash Attention 2's paged kernel requires it; a layer's cache, [slots, H_kv, d], is then
[blocks, block size, H_kv, d] as a view); otherwise each sequence's keys gathered back to back
(cu_seqlens_k, `AttentionMetadata.packed_key_slots`). Without a cache (trace, harvest), the forward's own
keys, packed like the queries. Causal masking is Flash Attention's, aligned bottom-right (a sequence's
queries are its last positions); a sliding window of w keys is window_size (w - 1, 0): HF's p - w < j <= p.

The function's keywords changed across torch releases (2.10's takes `is_causal` and no window, scale or
grouped-query flag; 2.11's `window_size` and `scale` but no block tables, so there it gathers keys; 2.13's
adds `enable_gqa`, `block_table`, `seqused_k`): the arguments are built from its signature, once per step
and layer kind. It cannot soft-cap scores (Gemma 2) and needs
float16 or bfloat16 and a head size that is a multiple of 8 up to 256, plus, from an older signature, no
sliding window and the default scale: `problem` names the rule a model breaks.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vlens.attention.metadata import AttentionMetadata, LayerKind

PAGE_MULTIPLE = 256  # Flash Attention 2 reads a paged cache only in blocks of a multiple of this many slots


def varlen_function() -> Callable | None:
    """The installed torch's varlen_attn, or None when it has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def keywords(fn: Callable) -> frozenset[str]:
    """The keywords `fn` (a varlen_attn) takes: what it can do is decided from them, not from torch's version."""
    return frozenset(inspect.signature(fn).parameters)


def takes_pages(fn: Callable) -> bool:
    """Whether `fn` reads a paged cache: it takes `block_table` and `seqused_k`."""
    return {"block_table", "seqused_k"} <= keywords(fn)


def problem(kinds: set[LayerKind], dtype: torch.dtype, fn: Callable | None = None) -> str | None:
    """Why this kernel (`fn`, default the installed one) cannot run a model with these layers at this dtype,
    or None."""
    takes = keywords(fn or varlen_function())
    if dtype not in (torch.float16, torch.bfloat16):
        return f"needs float16 or bfloat16 (Flash Attention), not {str(dtype).removeprefix('torch.')}"
    if any(kind.softcap is not None for kind in kinds):
        return "cannot soft-cap attention scores, which this model's layers do"
    if any(kind.sinks for kind in kinds):
        return "has no attention sinks, which this model's layers have"
    if any(kind.alibi for kind in kinds):
        return "adds no ALiBi biases, which this model's layers have"
    if any(kind.chunk for kind in kinds):
        return "has no chunked attention, which this model's layers have"
    sizes = sorted({kind.head_dim for kind in kinds if kind.head_dim % 8 or kind.head_dim > 256})
    if sizes:
        return f"needs head sizes that are multiples of 8 up to 256, not {sizes}"
    if "window_size" not in takes and any(kind.window is not None for kind in kinds):
        return "needs a torch whose varlen_attn takes window_size, for this model's sliding windows"
    if "scale" not in takes and any(not math.isclose(kind.scale, kind.head_dim**-0.5) for kind in kinds):
        return "needs a torch whose varlen_attn takes scale, for this model's attention scale"
    return None


def layer_arguments(kind: LayerKind, takes: frozenset[str]) -> dict:
    """varlen_attn's keywords for a layer of this kind, as a function taking `takes` spells them (`problem`
    has refused what it cannot spell)."""
    args = {}
    if "window_size" in takes:  # causal, aligned bottom-right; HF's window p - w < j <= p
        args["window_size"] = (-1, 0) if kind.window is None else (kind.window - 1, 0)
    else:
        args["is_causal"] = True
    if "scale" in takes:
        args["scale"] = kind.scale
    if "enable_gqa" in takes:  # older signatures pass grouped KV heads through to the kernel as they are
        args["enable_gqa"] = kind.num_kv_heads != kind.num_heads
    return args


@dataclass
class VarlenState:
    cu_q: torch.Tensor  # [B + 1] int32
    cu_k: torch.Tensor  # [B + 1] int32: keys packed back to back (also given with a block table)
    max_q: int
    max_k: int
    key_slots: torch.Tensor | None = None  # [sum of context lens] cache slots to gather; None: no gather
    block_size: int = 0  # > 0: the cache is read in place through `paging`
    paging: dict[str, torch.Tensor] = field(default_factory=dict)  # block_table, seqused_k
    layers: dict[LayerKind, dict] = field(default_factory=dict)  # each layer kind's keywords


class VarlenBackend:
    name = "varlen"

    def __init__(self):
        self.attend = varlen_function()
        self.takes = keywords(self.attend)
        self.pages = takes_pages(self.attend)

    def prepare(self, meta: AttentionMetadata, kinds: set[LayerKind], dtype: torch.dtype) -> VarlenState:
        state = self._layout(meta)
        state.layers = {kind: layer_arguments(kind, self.takes) for kind in kinds}
        return state

    def _layout(self, meta: AttentionMetadata) -> VarlenState:
        max_q = max(meta.query_lens)
        if not meta.paged:
            return VarlenState(meta.cu_seqlens_q, meta.cu_seqlens_q, max_q, max_q)
        cu_k, max_k = meta.cu_seqlens_k, max(meta.context_lens)
        if self.pages and meta.block_size % PAGE_MULTIPLE == 0:
            device = meta.positions.device
            tables = meta.block_tables.to(torch.int32).to(device, non_blocking=True)
            paging = {"block_table": tables, "seqused_k": meta.context_lens_tensor}
            return VarlenState(meta.cu_seqlens_q, cu_k, max_q, max_k, block_size=meta.block_size, paging=paging)
        return VarlenState(meta.cu_seqlens_q, cu_k, max_q, max_k, key_slots=meta.packed_key_slots)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, state: VarlenState) -> torch.Tensor:
        if state.block_size:
            pages = (-1, state.block_size, layer.num_kv_heads, layer.head_dim)
            keys, values = layer.k_cache.view(pages), layer.v_cache.view(pages)
        elif state.key_slots is not None:
            slots = state.key_slots
            keys, values = layer.k_cache.index_select(0, slots), layer.v_cache.index_select(0, slots)
        else:
            keys, values = k, v
        layout = (state.cu_q, state.cu_k, state.max_q, state.max_k)
        return self.attend(q, keys, values, *layout, **state.layers[layer.kind], **state.paging)
