"""Paged decode attention in Triton: each row's one query against its keys read in place from the paged
cache, through its block table, up to its context length — the static decode step's kernel on CUDA.

Why a kernel of our own: the portable path (vlens.attention.decode) gathers every row's keys and values
into a dense [B, keys, H, d] copy per layer, padded to the step's page bucket, and then masks the padding;
on an H200 that copy was the largest kernel of a batch-64 decode step (33 us a layer), and the masked
SDPA over padded keys the second. Here keys are read once, where they are, and only up to each row's
context, so a row's cost follows its own length, not the bucket's.

Split-K ("flash decoding"): program (row, KV head, split) reads one range of the row's keys for all the
query heads of that KV head and writes its running max, sum and weighted values; a second kernel merges the
splits. The split count depends only on the batch and page buckets, so a CUDA graph of the step stays valid.
Both products run on tensor cores (tl.dot; a KV head's query heads padded to 16 rows), accumulating in
float32; float32 caches multiply in full float32 (no TF32). Scores and the softmax are float32 and the
probabilities meet the values in the cache's dtype, as in HF's eager attention; soft-capping (Gemma 2) and
sliding windows (and Llama 4's chunks) are applied per key, as HF does; a sink (gpt-oss) joins the merge as one more
key with no value.

Tested on the CPU by Triton's interpreter (TRITON_INTERPRET=1) against the portable kernel.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, context_ptr, m_ptr, l_ptr, acc_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_tb, keys_per_split, scale, softcap, window, chunk,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits, heads = tl.num_programs(2), tl.num_programs(1) * GROUP
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    g_ok, d_ok = g < GROUP, d < HEAD_DIM
    head = kv_head * GROUP + g
    q_at = q_ptr + row * stride_qb + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_at, g_ok[:, None] & d_ok[None, :], other=0.0)
    context = tl.load(context_ptr + row)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, context)
    if WINDOW:  # HF's sliding window: the query at position context - 1 sees keys j > context - 1 - window
        lo = tl.maximum(lo, context - window)
    if CHUNK:  # Llama 4's chunks: the query sees the keys of its own chunk of positions
        lo = tl.maximum(lo, (context - 1) - (context - 1) % chunk)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        block = tl.load(tables_ptr + row * stride_tb + j // BLOCK_SIZE, j_ok, other=0).to(tl.int64)
        at = (block * BLOCK_SIZE + j % BLOCK_SIZE)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + at, kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N], float32
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(v_ptr + at, kv_ok, other=0.0)
        s_sum = s_sum * alpha + tl.sum(p, axis=1)
        # probabilities in the cache's dtype for the product, as HF's eager attention casts its softmax
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    part = (row * heads + head) * splits + split
    tl.store(m_ptr + part, m, g_ok)
    tl.store(l_ptr + part, s_sum, g_ok)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, g_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_kernel(m_ptr, l_ptr, acc_ptr, sinks_ptr, out_ptr, stride_ob, stride_oh, splits, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, SINKS: tl.constexpr):  # fmt: skip
    row, head = tl.program_id(0), tl.program_id(1)
    s, d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    s_ok, d_ok = s < splits, d < HEAD_DIM
    part = (row * tl.num_programs(1) + head) * splits + s
    m = tl.load(m_ptr + part, s_ok, other=float("-inf"))
    top = tl.max(m, axis=0)
    if SINKS:  # (gpt-oss: the head's sink logit is one more key, with no value)
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        top = tl.maximum(top, sink)
    w = tl.where(s_ok & (m > float("-inf")), tl.exp(m - top), 0.0)
    total = tl.sum(w * tl.load(l_ptr + part, s_ok, other=0.0), axis=0)
    if SINKS:
        total += tl.exp(sink - top)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / total
    tl.store(out_ptr + row * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), d_ok)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, context: torch.Tensor,
    block_size: int, layer, programs: int,
) -> torch.Tensor:  # fmt: skip
    """Attention output [B, H, d] of each row's query q [B, H, d] over keys 0 .. context[b] - 1 of its
    block table tables[b] in the caches [slots, H_kv, d]. `programs`: how many (row, KV head, split)
    programs to aim for, so that batch 1 keeps the card busy too."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    rows, heads, dim = q.shape
    kv_heads, group = layer.num_kv_heads, heads // layer.num_kv_heads
    block_g, block_d = max(16, _pow2(group)), max(16, _pow2(dim))  # tl.dot's smallest tile is 16
    block_n = 64 if block_d <= 128 else 32
    tiles = math.ceil(tables.shape[1] * block_size / block_n)
    splits = max(1, min(tiles, math.ceil(programs / (rows * kv_heads))))
    keys_per_split = math.ceil(tiles / splits) * block_n
    splits = math.ceil(tiles * block_n / keys_per_split)
    m = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    s_sum = torch.empty_like(m)
    acc = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
    _split_kernel[(rows, kv_heads, splits)](
        q, k_cache, v_cache, tables, context, m, s_sum, acc, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), tables.stride(0), keys_per_split, layer.scale, layer.softcap or 1.0, layer.window or 0,
        layer.kind.chunk or 1, GROUP=group, BLOCK_G=block_g, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, SOFTCAP=layer.softcap is not None, WINDOW=layer.window is not None,
        CHUNK=layer.kind.chunk is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 products in full float32
    )  # fmt: skip
    out = torch.empty(rows, heads, dim, dtype=q.dtype, device=q.device)
    _merge_kernel[(rows, heads)](
        m, s_sum, acc, m if layer.sinks is None else layer.sinks, out, out.stride(0), out.stride(1), splits,
        HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_S=max(2, _pow2(splits)), SINKS=layer.sinks is not None,
    )  # fmt: skip
    return out
