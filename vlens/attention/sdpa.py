"""The reference backend: PyTorch's scaled_dot_product_attention over per-group grids.

Pure PyTorch, so it runs wherever torch does, and it is the yardstick for the faster backends. Consecutive
sequences whose queries and keys fit one [B, max_q] x [B, max_keys] grid without it being mostly padding
share one SDPA call (decodes, max_q = 1, go together while their contexts are alike); slots past a
sequence's end are masked and never read back. With a cache, each sequence's keys are gathered from the
slots its block table names — unless every sequence of the call is a fresh prompt, whose keys are its own
rows of the step: those are read where they are, under SDPA's own causal mask, as in a cache-less forward
(on CUDA, Flash Attention instead of a masked kernel over a gathered copy). A call of one sequence's chunk
after its cached keys (chunked prefill, a prefix-cache hit) is causal from the bottom right of its
[queries, keys], which SDPA takes as a CausalBias: no mask is built (a 4,096-token chunk after 100k keys
would need 3 GiB for it on CUDA, as the memory-efficient kernel takes one) and Flash Attention runs it.
A sliding-window layer (or a chunked one, Llama 4's) gathers and masks only the keys from its grid's first
visible one on (on the CPU,
decodes of a 4,000-token context through 256-token windows: 9.9 ms a step instead of 24.7).

SDPA cannot soft-cap scores (Gemma 2) or add a sink to the softmax (gpt-oss), and vlens gives it no per-head
bias (BLOOM's ALiBi), so such a layer takes a written-out path that does what HF's eager attention does: scale,
ALiBi's bias, cap * tanh(scores / cap), mask, float32 softmax with the sink logit as one more key
(`written_attention`), in chunks of query rows whose scores fit WRITTEN_SCORES.

On CUDA, SDPA never runs cuDNN's kernel: cuDNN builds an execution plan for each new shape (6.2 ms of host
time a call on an H200, and the grids change shape every step). It runs Flash Attention where there is no
mask (packed causal keys) and the memory-efficient kernel over the cache's keys, which needs a mask:
built once per step as the kernel takes it (additive, rows 16-aligned, so SDPA neither converts nor pads
it per layer), with the query heads of each KV head stacked along the query axis (the memory-efficient
kernel has no grouped-query mode; stacking keeps each head's keys unrepeated and each row's computation
as it was). Math runs what neither can. The CPU path is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention

from vlens.attention.metadata import FULL_REACH, AttentionMetadata, LayerKind, Reach, first_visible

# Padded keys a group of decodes may read whatever its real keys: a split costs a call and two gathers.
MIN_PADDED_KEYS = 1024
# Scores the written-out attention holds at once (float32: 256 MiB); longer calls take their queries in chunks
WRITTEN_SCORES = 1 << 26
# Elements of the [B, queries, keys] mask a prefill call over cached keys may build (on CUDA it is repeated
# for the query heads of a KV head, in the model's dtype: 256 MiB at 4 heads in bfloat16)
MAX_MASK = 1 << 25


@dataclass
class AttentionGroup:
    """Sequences whose queries share one [B, max_q] grid for one SDPA call; their tokens are the
    contiguous packed rows `rows`."""

    rows: slice
    query_positions: torch.Tensor  # [B, max_q] position of each grid slot (unused ones: the row's last)
    first_query: int = 0  # the smallest query position of the grid
    q_index: torch.Tensor | None = None  # [rows] slot of each token in the flattened grid; None = identity
    key_slots: torch.Tensor | None = None  # [B, Lk] cache slot of key j of each sequence; None = no cache
    # [B, max_q] the last key position each slot sees, where some see past their own (AttentionMetadata.key_limits)
    query_limits: torch.Tensor | None = None
    masks: dict[Reach, torch.Tensor | None] = field(default_factory=dict)  # reach -> [B, 1, max_q, Lk]
    # (reach, query heads per KV head) -> [B, 1, group * max_q, Lk] additive mask of stacked heads (CUDA)
    stacked_masks: dict[tuple[Reach, int], torch.Tensor] = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return self.query_positions.shape[0]

    @property
    def max_q(self) -> int:
        return self.query_positions.shape[1]

    @property
    def chunk_after_cache(self) -> bool:
        """One sequence's queries after its cached keys (a later chunk of a long prompt, a prefix-cache hit):
        causal from the bottom right of [queries, keys], which SDPA takes without a mask built."""
        return self.batch == 1 and self.max_q > 1 and self.key_slots is not None

    def masked(self, kind: LayerKind) -> bool:
        """Whether layers of `kind` read a mask built for this grid."""
        plain = self.chunk_after_cache and kind.reach == FULL_REACH and not written(kind)
        return self.query_limits is not None or not plain

    def first_key(self, reach: Reach) -> int:
        """The first cached key a query of the grid may see within `reach` (a window, a chunk): those before it are
        neither gathered nor masked (a decode at position 20,000 of a 512-token window reads 512 keys, not 20,000)."""
        if self.key_slots is None:
            return 0
        return max(0, first_visible(reach, self.first_query))


class SdpaBackend:
    name = "sdpa"

    def prepare(self, meta: AttentionMetadata, kinds: set[LayerKind], dtype: torch.dtype) -> list[AttentionGroup]:
        """The step's grids and, per reach the layers have (window, chunk), their masks (built once, read by every
        layer)."""
        groups, row = [], 0
        for members in _group(meta.query_lens, meta.context_lens if meta.paged else None):
            group = self._group(meta, members, row, meta.positions.device)
            masked = [kind for kind in kinds if group.masked(kind)]
            for reach in {kind.reach for kind in masked}:
                group.masks[reach] = _mask(group, reach)
            if group.key_slots is not None and group.key_slots.is_cuda:
                for kind in masked:
                    if not written(kind):
                        heads = kind.num_heads // kind.num_kv_heads
                        group.stacked_masks[kind.reach, heads] = _stacked_mask(group.masks[kind.reach], heads, dtype)
            groups.append(group)
            row = group.rows.stop
        return groups

    def _group(self, meta: AttentionMetadata, members: list[int], first_row: int, device) -> AttentionGroup:
        """The grid of consecutive sequences `members`, laid out in numpy (a dozen small torch ops would cost
        more than the step's decode attention saves); a group of decodes (one query each) is its own grid."""
        first, stop = members[0], members[-1] + 1  # a group is consecutive sequences
        lens = np.asarray(meta.query_lens[first:stop])
        starts = np.asarray(meta.context_lens[first:stop]) - lens
        max_q, rows = int(lens.max()), int(lens.sum())
        grid = np.arange(max_q)
        query_positions = starts[:, None] + np.minimum(grid, lens[:, None] - 1)  # (an unused slot sees keys too)
        q_index = None
        if int(lens.min()) != max_q:
            seq = np.repeat(np.arange(len(lens)), lens)
            q_index = torch.from_numpy(seq * max_q + np.arange(rows) - (np.cumsum(lens) - lens)[seq])
        key_slots = None
        if meta.paged and starts.any():  # (fresh prompts' keys are their queries' rows: no gather, no mask)
            key_slots = torch.from_numpy(meta.key_slots(first, stop)).to(device, non_blocking=True)
        limits = None
        if meta.key_limits is not None:  # (each token's slot in the grid: its sequence's row, its column)
            grid_limits = query_positions.copy()
            seq = np.repeat(np.arange(len(lens)), lens)
            column = np.arange(rows) - (np.cumsum(lens) - lens)[seq]
            grid_limits[seq, column] = meta.key_limits[first_row : first_row + rows]
            if (grid_limits > query_positions).any():
                limits = torch.from_numpy(grid_limits).to(device, non_blocking=True)
        return AttentionGroup(
            rows=slice(first_row, first_row + rows),
            query_positions=torch.from_numpy(query_positions).to(device, non_blocking=True),
            first_query=int(starts.min()),
            q_index=None if q_index is None else q_index.to(device, non_blocking=True),
            key_slots=key_slots,
            query_limits=limits,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, groups: list[AttentionGroup]) -> torch.Tensor:
        if len(groups) == 1:
            return _attend(q, k, v, layer, groups[0])
        out = q.new_empty(*q.shape[:-1], layer.value_dim)
        for g in groups:
            out[g.rows] = _attend(q[g.rows], k[g.rows], v[g.rows], layer, g)
        return out


def _group(query_lens: list[int], context_lens: list[int] | None) -> list[list[int]]:
    """Consecutive sequences that share a grid: [B, widest queries] queries against [B, widest keys] keys
    (`context_lens`; None: no cache, a sequence's keys are its queries), which an SDPA call (and the key
    gather before it) costs in proportion to, padding included.
    - A decode (one query) joins while the padded keys stay within an eighth of the real ones, or
      MIN_PADDED_KEYS, so decodes of very different lengths (which the runner orders longest first) take a
      few calls instead of all reading the longest context (on the CPU, 64 decodes of 8-400-token prompts,
      SmolLM2's widths: ~30% less time a step).
    - A prefill chunk joins while both grids stay at most half padding, and only a group of its kind: fresh
      prompts read their own rows with no mask, and one beside a later chunk of a long prompt (or a
      prefix-cache hit) would read all its keys (half padding alone joins any pair). Chunks after cached
      keys share a call only while its mask, [B, widest queries, widest keys], stays within MAX_MASK (two
      2,048-token chunks after 100k keys each would need 3 GiB on CUDA); alone, a chunk needs none
      (`AttentionGroup.chunk_after_cache`)."""
    groups: list[list[int]] = []
    queries = widest_q = keys = widest_k = 0
    cached = False  # whether the open group's prefill chunks follow cached keys (its call builds a mask)
    for i, n in enumerate(query_lens):
        k = n if context_lens is None else context_lens[i]
        decode = n == 1
        if groups and decode == (query_lens[groups[-1][0]] == 1):
            size, q, wq, kk, wk = len(groups[-1]) + 1, queries + n, max(widest_q, n), keys + k, max(widest_k, k)
            if (
                size * wq - q <= q and size * wk - kk <= (max(MIN_PADDED_KEYS, kk // 8) if decode else kk)
                and (decode or (k > n) == cached and not (cached and size * wq * wk > MAX_MASK))
            ):  # fmt: skip
                groups[-1].append(i)
                queries, widest_q, keys, widest_k = q, wq, kk, wk
                continue
        groups.append([i])
        queries = widest_q = n
        keys = widest_k = k
        cached = k > n
    return groups


def _mask(g: AttentionGroup, reach: Reach) -> torch.Tensor | None:
    """Boolean [B, 1, max_q, keys from first_key(reach) on] (None: plain causal over keys that are the
    queries, SDPA's is_causal). Key j of a sequence sits at position j, so query position p may see keys
    from first_visible(reach, p) to p: p - window < j <= p, as in HF's sliding-window mask, or those of p's chunk; j <=
    its limit in place of j <= p where the grid has limits (an image's tokens that see each other both ways: HF's OR
    of the causal and the image's block)."""
    if g.key_slots is None and reach == FULL_REACH and g.query_limits is None:
        return None
    num_keys = g.max_q if g.key_slots is None else g.key_slots.shape[1]
    key_pos = torch.arange(g.first_key(reach), num_keys, device=g.query_positions.device)
    q = g.query_positions[:, None, :, None]
    allowed = key_pos <= (q if g.query_limits is None else g.query_limits[:, None, :, None])
    if reach != FULL_REACH:
        allowed &= key_pos >= first_visible(reach, q)
    return allowed


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, g: AttentionGroup) -> torch.Tensor:
    if g.key_slots is not None:
        first = g.first_key(layer.kind.reach)
        slots = g.key_slots[:, first:] if first else g.key_slots
        keys, values = gather(layer.k_cache, slots), gather(layer.v_cache, slots)
    else:
        keys, values = _to_grid(k, g), _to_grid(v, g)
    if layer.value_pad:  # (DeepSeek's values, padded to the keys' size: at their own, as HF hands SDPA them, which
        values = values[..., : -layer.value_pad]  # then takes the kernel HF's call takes)
    q, keys, values = _to_grid(q, g).transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    width = values.shape[-1]
    if not g.masked(layer.kind):  # (a 4,096-token chunk after 100k keys: no 3 GiB mask; Flash Attention on CUDA)
        from torch.nn.attention.bias import causal_lower_right  # (imports torch._dynamo: 1.4 s, here when used)

        causal = causal_lower_right(g.max_q, keys.shape[-2])
        out = sdpa(q, keys, values, attn_mask=causal, scale=layer.scale, enable_gqa=layer.num_kv_heads != layer.num_heads)
        return out.transpose(1, 2).reshape(-1, layer.num_heads, width)
    mask = g.masks[layer.kind.reach]
    stacked = g.stacked_masks.get((layer.kind.reach, layer.num_heads // layer.num_kv_heads))
    if written(layer.kind):
        out = written_attention(q, keys, values, mask, layer)
    elif stacked is not None:
        out = _stacked(q, keys, values, stacked, layer)
    elif g.max_q == 1 and layer.num_kv_heads != layer.num_heads:
        # One query per sequence: the query heads of a KV head are its query rows, which share its keys and
        # the row's mask, so SDPA needs no grouped-query mode (on the CPU ~10% faster than enable_gqa).
        batch, heads, _, dim = q.shape
        grouped = q.reshape(batch, layer.num_kv_heads, heads // layer.num_kv_heads, dim)
        out = sdpa(grouped, keys, values, attn_mask=mask, scale=layer.scale).reshape(batch, heads, 1, width)
    else:
        out = sdpa(
            q, keys, values, attn_mask=mask, is_causal=mask is None, scale=layer.scale,
            enable_gqa=layer.num_kv_heads != layer.num_heads,
        )  # fmt: skip
    out = out.transpose(1, 2).reshape(-1, layer.num_heads, width)
    return out if g.q_index is None else out.index_select(0, g.q_index)


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for [B, Lk] slots: index_select over the flat index copies whole rows (on the CPU 5x faster
    than advanced indexing, which computes every element's offset)."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """SDPA, never with cuDNN's kernel on CUDA: its flag is turned off around the call (under a microsecond;
    PyTorch's sdpa_kernel context costs 13) and restored, so the process's own SDPA calls are untouched.
    On CUDA only Flash Attention has a grouped-query mode, and it takes neither float32 nor a mask (but a
    bottom-right causal one), nor every card; where it cannot run, the KV heads are repeated, as the
    memory-efficient kernel then runs, where SDPA would fall back to its math kernel, which holds every
    score (32 heads over 8k float32 tokens: 8 GiB)."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    if kwargs.get("enable_gqa") and not _flash_takes(q, k, v, kwargs):
        kwargs["enable_gqa"] = False
        k, v = (x.repeat_interleave(q.shape[-3] // x.shape[-3], dim=-3) for x in (k, v))
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def _flash_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict) -> bool:
    """Whether Flash Attention runs this grouped-query call: no mask but a bottom-right causal one, and
    what this card and build take (16-bit, head size, sm80+)."""
    from torch.nn.attention.bias import CausalBias  # (imports torch._dynamo: 1.4 s, here when used)

    mask = kwargs.get("attn_mask")
    if not (mask is None or isinstance(mask, CausalBias)):
        return False
    return can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, bool(kwargs.get("is_causal")), True))


def _stacked_mask(mask: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Boolean [B, 1, q, Lk] -> additive [B, 1, heads * q, Lk] (0 or -inf, in `dtype`), its rows repeated
    for each of the query heads that share a KV head and padded in memory to a multiple of 16 keys, as the
    memory-efficient kernel takes a mask without copying it."""
    batch, _, rows, keys = mask.shape
    width = -(-keys // 16) * 16
    out = torch.full((batch, 1, heads, rows, width), float("-inf"), dtype=dtype, device=mask.device)
    out[..., :keys].masked_fill_(mask[:, :, None], 0.0)
    return out.view(batch, 1, heads * rows, width)[..., :keys]


def _stacked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, layer) -> torch.Tensor:
    """[B, H, q, d] attention over [B, H_kv, Lk, d] keys, the query heads of each KV head stacked along the
    query axis (head h = kv * heads + i is rows i * q .. of KV head kv), so one SDPA call without a
    grouped-query mode reads each key once; `mask` is `_stacked_mask`'s."""
    batch, num_heads, rows, dim = q.shape
    stacked = q.reshape(batch, layer.num_kv_heads, num_heads // layer.num_kv_heads * rows, dim)
    return sdpa(stacked, k, v, attn_mask=mask, scale=layer.scale).reshape(batch, num_heads, rows, v.shape[-1])


def written(kind: LayerKind) -> bool:
    """Whether layers of `kind` need the written-out attention: SDPA has no soft-cap, no sinks and (as vlens
    calls it) no per-head biases."""
    return kind.softcap is not None or kind.sinks or kind.alibi


def written_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, layer
) -> torch.Tensor:
    """[B, H, q, d] attention as HF's eager attention computes it: scores scaled, soft-capped, masked, a float32
    softmax (over the sinks too), probabilities in the model's dtype times the values. The queries are taken in
    chunks of rows whose scores stay within WRITTEN_SCORES (each row's softmax is its own: the same values), so a
    long prompt does not hold all its scores at once (32k tokens of gpt-oss's 64 heads: 256 GiB in float32)."""
    group = layer.num_heads // layer.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    batch, heads, rows, _ = q.shape
    step = max(1, WRITTEN_SCORES // (batch * heads * k.shape[2]))
    chunks = []
    for first in range(0, rows, step):
        part = slice(first, first + step)
        rows_mask = mask if mask is None or mask.shape[2] == 1 else mask[:, :, part]
        chunks.append(_written_rows(q[:, :, part], k, v, rows_mask, layer, first))
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)


def _written_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, layer, first: int
) -> torch.Tensor:
    """Query rows first .. of `written_attention` over all the keys (mask None: the keys are the queries, causal)."""
    scores = torch.matmul(q, k.transpose(2, 3)) * layer.scale
    if layer.alibi:  # (key j sits at position j, for ALiBi's layers have no window)
        scores = scores + layer.alibi_bias(k.shape[2], q.device).to(scores.dtype)
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if mask is None:
        rows = torch.arange(first, first + q.shape[2], device=q.device)
        mask = torch.arange(k.shape[2], device=q.device) <= rows[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    sinks = None if layer.sinks is None else layer.sinks.view(-1, 1)  # [H, 1]: against [B, H, q]
    return torch.matmul(probabilities(scores, sinks).to(q.dtype), v)


def probabilities(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The float32 softmax of [..., heads, (queries,) keys] scores over the keys; with `sinks` (a logit per head,
    shaped to broadcast against the scores without their keys), over the keys and the head's sink, whose weight
    is then dropped."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    # HF's order: the maximum taken off in the scores' dtype (in bfloat16 that rounds), then the softmax
    logits = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1]).unsqueeze(-1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(logits, dim=-1, dtype=torch.float32)[..., :-1]


def _to_grid(x: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """[rows, h, d] packed -> [B, max_q, h, d] grid (zeros in unused slots)."""
    if g.q_index is None:
        return x.view(g.batch, g.max_q, *x.shape[1:])
    grid = x.new_zeros(g.batch * g.max_q, *x.shape[1:])
    grid.index_copy_(0, g.q_index, x)
    return grid.view(g.batch, g.max_q, *x.shape[1:])
