"""FlexAttention over the step's own keys: one call per layer for the whole packed batch.

The queries are the packed batch ([1, H, T, d]). The keys are those of the step's sequences packed back to
back like the queries (key j of sequence i at cu_seqlens_k[i] + j): with a cache, gathered from the slots
their block tables name, so a block that several sequences hold (a cached or borrowed prefix) is read once
for each of them and no sequence ever sees another's; without one (trace, harvest), the forward's own keys.
Query row r (sequence s, position p) may see key c when c is s's, at a position j <= p (and p - window < j
for a sliding-window layer, j in p's chunk for a chunked one: Llama 4's). Soft-capping (Gemma 2) is a score mod; a
sink (gpt-oss) rescales each row's output by the share of its softmax that the keys hold, from the log-sum-exp flex
returns: sigmoid(lse - sink).

The block mask is built from that structure and never by evaluating the mask over every (row, key) pair,
let alone over every slot of the cache: the rows of one 128-row block belong to consecutive sequences,
whose keys are one contiguous range of 128-key blocks, so each query block lists that range and the mask
function sorts out the rest inside the kernel.

Shapes are static: rows and keys are padded up to a power of 4 (at least 128), padded rows see nothing and
are dropped, padded keys belong to no sequence. Compiled (`compiled=True`), each pair of padded sizes gets
its own compiled function, a copy of `flex_attention` with a code object of its own, compiled with
`dynamic=False`: torch.compile keeps its cache, its recompile limit and its record of which sizes changed
per code object, and a size that changed would be compiled dynamic, which inductor's CPU flex template
cannot build ("'cur_kvSplitSize1' was not declared"; a second engine in one process always changed one).
One compile per pair (≈25 s on a 2-core CPU, seconds on a GPU); uncompiled it is exact and slow, which the
CPU tests use. On CUDA the Triton tiles are chosen to fit the card's shared memory (`kernel_options`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from vlens.attention.metadata import AttentionMetadata, LayerKind, Reach, first_visible
from vlens.own_code import own_copy

BLOCK = 128  # FlexAttention's block of query rows and of keys (the block mask's granularity)
# Triton tiles, most preferred first: (BLOCK_M, BLOCK_N, num_stages).
TILES = ((128, 64, 2), (64, 64, 2), (64, 32, 1), (32, 32, 1), (16, 16, 1))
# Shared memory Triton's flex kernel asked for on an H200, over a count of its Q, K and V tiles: 344,064
# bytes for (128, 128, 3 stages) at bfloat16, head size 64, where Q + 2 x stages x K/V tiles are 114,688.
SHARED_PER_TILE_BYTE = 3


@dataclass
class FlexState:
    masks: dict[Reach, BlockMask]  # reach (window, chunk) -> block mask over (padded rows, padded keys)
    rows: int  # real query rows; the rest of the padded ones are dropped
    padded_rows: int
    padded_keys: int
    key_slots: torch.Tensor | None  # [padded keys] cache slot of each packed key; None: the forward's own keys
    attend: Callable  # flex_attention, compiled for these padded sizes or not


class FlexBackend:
    name = "flex"

    def __init__(self, compiled: bool):
        self.compiled = compiled
        self._compiled: dict[tuple[int, int], Callable] = {}  # (padded rows, padded keys) -> compiled flex
        self._score_mods: dict[float, Callable] = {}

    def prepare(self, meta: AttentionMetadata, kinds: set[LayerKind], dtype: torch.dtype) -> FlexState:
        device = meta.positions.device
        rows, q_seq, q_pos = len(meta.positions), meta.token_seq, meta.positions
        if meta.paged:
            key_slots, cu_k = meta.packed_key_slots, meta.cu_seqlens_k.long()
            keys = len(key_slots)
            k_seq = torch.repeat_interleave(torch.arange(len(cu_k) - 1, device=device), cu_k.diff(), output_size=keys)
            k_pos = torch.arange(keys, device=device) - cu_k[k_seq]
        else:  # keys are packed like the queries
            key_slots, cu_k, keys, k_seq, k_pos = None, meta.cu_seqlens_q.long(), rows, q_seq, q_pos
        padded_rows, padded_keys = _bucket(rows), _bucket(keys)
        num_blocks, indices = _key_blocks(q_seq, cu_k, padded_rows, padded_keys)
        q_seq, q_pos = _pad(q_seq, padded_rows, -1), _pad(q_pos, padded_rows, 0)
        k_seq, k_pos = _pad(k_seq, padded_keys, -2), _pad(k_pos, padded_keys, 0)
        masks = {}
        for reach in {kind.reach for kind in kinds}:
            low = first_visible(reach, q_pos) - 1
            masks[reach] = BlockMask.from_kv_blocks(
                num_blocks, indices, BLOCK_SIZE=BLOCK, mask_mod=_mask_mod(q_seq, q_pos, low, k_seq, k_pos),
                seq_lengths=(padded_rows, padded_keys),
            )  # fmt: skip
        if key_slots is not None:
            key_slots = _pad(key_slots, padded_keys, 0)  # slot 0 holds finite values; no row sees them
        attend = self._attend(padded_rows, padded_keys)
        return FlexState(masks, rows, padded_rows, padded_keys, key_slots, attend)

    def _attend(self, padded_rows: int, padded_keys: int) -> Callable:
        if not self.compiled:
            return flex_attention
        key = (padded_rows, padded_keys)
        if key not in self._compiled:
            self._compiled[key] = torch.compile(own_copy(flex_attention), dynamic=False)
        return self._compiled[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, state: FlexState) -> torch.Tensor:
        if state.key_slots is not None:
            slots = state.key_slots
            keys, values = layer.k_cache.index_select(0, slots), layer.v_cache.index_select(0, slots)
        else:
            keys, values = _pad_rows(k, state.padded_keys), _pad_rows(v, state.padded_keys)
        out = state.attend(
            _pad_rows(q, state.padded_rows).transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            score_mod=self._softcap(layer.softcap),
            block_mask=state.masks[layer.kind.reach],
            scale=layer.scale,
            enable_gqa=layer.num_kv_heads != layer.num_heads,
            kernel_options=kernel_options(q.device, layer.head_dim, q.dtype),
            return_lse=layer.sinks is not None,
        )
        if layer.sinks is not None:
            out, lse = out
            out = (out.float() * torch.sigmoid(lse - layer.sinks.float()[:, None])[..., None]).to(q.dtype)
        return out[0].transpose(0, 1)[: state.rows]

    def _softcap(self, cap: float | None):
        if cap is None:
            return None
        if cap not in self._score_mods:  # one function per cap, so a compiled kernel is reused

            def score_mod(score, b, h, q, kv):
                return torch.tanh(score / cap) * cap

            self._score_mods[cap] = score_mod
        return self._score_mods[cap]


def _mask_mod(q_seq, q_pos, low, k_seq, k_pos) -> Callable:
    """Row q sees key kv when kv is of q's sequence, at a position in (low[q], q_pos[q]]. One function body
    for every step and reach (a window or a chunk is in `low`), so compiled kernels are reused."""

    def mask_mod(b, h, q, kv):
        position = k_pos[kv]
        return (k_seq[kv] == q_seq[q]) & (position <= q_pos[q]) & (position > low[q])

    return mask_mod


def _key_blocks(q_seq: torch.Tensor, cu_k: torch.Tensor, padded_rows: int, padded_keys: int):
    """The block mask's key blocks: query block b (rows b*128 ..) holds rows of sequences first .. last,
    whose keys are the packed range cu_k[first] .. cu_k[last + 1], so it lists the key blocks of that range
    (none for a block of padding). Tensor ops on q_seq's device; no host sync."""
    rows, device = len(q_seq), q_seq.device
    starts = torch.arange(0, padded_rows, BLOCK, device=device)
    first = q_seq[starts.clamp(max=rows - 1)]
    last = q_seq[(starts + BLOCK - 1).clamp(max=rows - 1)]
    low, high = cu_k[first] // BLOCK, (cu_k[last + 1] + BLOCK - 1) // BLOCK
    num_blocks = torch.where(starts < rows, high - low, 0).to(torch.int32)
    width = padded_keys // BLOCK
    indices = (low[:, None] + torch.arange(width, device=device)).clamp(max=width - 1).to(torch.int32)
    return num_blocks[None, None], indices[None, None]


def _bucket(n: int) -> int:
    """The padded size of n rows or keys: 128, 512, 2048, ... (few sizes, so few compiles)."""
    size = BLOCK
    while size < n:
        size *= 4
    return size


def _pad(x: torch.Tensor, size: int, value: int) -> torch.Tensor:
    return F.pad(x, (0, size - len(x)), value=value)


def _pad_rows(x: torch.Tensor, size: int) -> torch.Tensor:
    """[n, h, d] -> [size, h, d], zeros below."""
    return x if len(x) == size else F.pad(x, (0, 0, 0, 0, 0, size - len(x)))


@functools.cache
def kernel_options(device: torch.device, head_dim: int, dtype: torch.dtype) -> dict | None:
    """Triton tiles for FlexAttention on a CUDA card: the largest of TILES whose shared memory (estimated
    from the H200's measured need, SHARED_PER_TILE_BYTE) fits the card's per-block limit for this head size
    and dtype. Triton's defaults do not fit there at bfloat16 (344 KB asked, 227 KB available). None on CPU."""
    if device.type != "cuda":
        return None
    return cuda_tiles(torch.cuda.get_device_properties(device).shared_memory_per_block_optin, head_dim, dtype.itemsize)


def cuda_tiles(shared_bytes: int, head_dim: int, itemsize: int) -> dict:
    def need(tile):
        block_m, block_n, stages = tile
        return SHARED_PER_TILE_BYTE * (block_m + 2 * stages * block_n) * head_dim * itemsize

    block_m, block_n, stages = next((t for t in TILES if need(t) <= shared_bytes), TILES[-1])
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_stages": stages, "num_warps": 4,
            "FORCE_USE_FLEX_ATTENTION": True}  # fmt: skip
