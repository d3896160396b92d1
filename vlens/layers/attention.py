"""The attention layer: it writes the new keys and values into its slice of the KV cache, computes the
attention scores and patterns a request asked for, and leaves the attention itself to the step's
backend (vlens.attention), which alone knows how the batch is laid out.

gpt-oss's sinks are the layer's: one learned logit per head that joins every softmax as a key that holds no
value, so a head can attend to nothing (a row's weights then sum to less than one). HF keeps them beside the
projections (`self_attn.sinks`), where the checkpoint slot looks for them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlens.attention.metadata import LayerKind
from vlens.context import attention_tap, get_context
from vlens.layers.checkpoint import Slot


def alibi_slopes(total: int, heads: range, device: torch.device) -> torch.Tensor:
    """ALiBi's slope of each of `heads` of a model with `total` heads, as HF's BLOOM computes them: powers of
    2^(-8/n) for the largest power of two n <= total, then odd powers of 2^(-4/n) for the rest."""
    n = 2 ** math.floor(math.log2(total))

    def powers(base: float, stop: int, step: int) -> torch.Tensor:  # (filled on the device: no copy from the host,
        # which a CUDA graph's capture would refuse)
        exponents = torch.arange(1, stop, step, device=device, dtype=torch.int32)
        return torch.pow(torch.full((), base, device=device, dtype=torch.float32), exponents)

    slopes = powers(2 ** (-(2 ** -(math.log2(n) - 3))), 1 + n, 1)
    if n != total:
        slopes = torch.cat([slopes, powers(2 ** (-(2 ** -(math.log2(2 * n) - 3))), 1 + 2 * min(n, total - n), 2)])
    return slopes[heads.start : heads.stop]


@dataclass(frozen=True)
class Alibi:
    """ALiBi (no position embedding: each head's scores plus its slope times the key's position) as a family's HF code
    builds it, `kind`: BLOOM's (`alibi_slopes`, the products in float32), Falcon-RW's (those slopes and their products
    rounded to bfloat16, over sqrt(head_dim)) or MPT's (2^(-8i/n) for the next power of two n of heads, where the model
    has fewer every other one first; HF's MPT reads no alibi_bias_max)."""

    heads: int  # (the model's, all ranks')
    kind: str = "bloom"

    def slopes(self, heads: range, device: torch.device) -> torch.Tensor:
        if self.kind != "mpt":
            return alibi_slopes(self.heads, heads, device)
        n = 2 ** math.ceil(math.log2(self.heads))
        slopes = 1.0 / torch.pow(2, torch.arange(1, n + 1, device=device).float() * (8 / n))
        if n != self.heads:
            slopes = torch.cat([slopes[1::2], slopes[::2]])[: self.heads]
        return slopes[heads.start : heads.stop]

    def bias(
        self, keys: int, heads: range, head_dim: int, device: torch.device, rows: torch.Tensor | None = None
    ) -> torch.Tensor:  # fmt: skip
        """[heads, 1, keys] (float32): what `heads`' scores of keys 0 .. keys - 1 get, each head's slope times the
        key's position (the rows' scores differ from relative distances by a constant per row, which the softmax
        ignores); given the query rows' positions [R], [heads, R, keys] as a tap reads the scores: MPT's relative to
        each query, as HF's are at a decode step (its prefill's are a constant apart in each row: HF measures from the
        forward's last key); BLOOM's and Falcon's from the sequence's start, as HF's always are."""
        slopes = self.slopes(heads, device)[:, None, None]
        if self.kind == "falcon":
            products = slopes.bfloat16() * torch.arange(keys, device=device)  # (bfloat16, as HF's product is)
            return products.float() / math.sqrt(head_dim)
        bias = slopes * torch.arange(keys, device=device, dtype=torch.float32)
        return bias - slopes * rows.float()[:, None] if rows is not None and self.kind == "mpt" else bias


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
        sinks: bool = False,
        rank_heads: range | None = None,
        reads_kv_of: int | None = None,
        alibi: Alibi | None = None,
        value_dim: int | None = None,
        chunk: int | None = None,
    ):
        """`rank_heads`: which of the model's heads are this rank's (tensor parallelism; None: all of them).
        `reads_kv_of`: the earlier layer whose keys and values this one attends to (Gemma 4's shared layers: the
        engine binds that layer's cache here, and this layer never writes it); None: its own. `alibi`: where the
        scores have ALiBi's biases (BLOOM, Falcon-RW, MPT), how the family builds them. `value_dim`: the
        values' head size where it is less than the queries' and keys' (DeepSeek's latent attention): the values are
        padded with zeros to theirs, in the cache and for the backends, and the output cut back, as HF pads them for
        flash attention (the SDPA backend cuts them back first, as HF's SDPA takes them). `chunk`: Llama 4's chunked
        attention, a query seeing the keys of its own chunk of positions alone (LayerKind.chunk)."""
        super().__init__()
        self.reads_kv_of = reads_kv_of
        self.alibi = alibi
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.value_dim = value_dim or head_dim
        self.value_pad = head_dim - self.value_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window
        self.softcap = softcap
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        self.rank_heads = rank_heads
        self.kind = LayerKind(num_heads, num_kv_heads, head_dim, window, self.scale, softcap, sinks, alibi is not None,
                              chunk)  # fmt: skip
        self.hook_attn_scores, self.hook_pattern = patterns
        # Bound by the engine to [num_slots, num_kv_heads, head_dim] views of its cache.
        self.k_cache = self.v_cache = torch.empty(0)

    def alibi_bias(self, keys: int, device: torch.device, rows: torch.Tensor | None = None) -> torch.Tensor:
        """What ALiBi adds to this layer's (this rank's) heads' scores (`Alibi.bias`). Made on the device per call: a
        few small kernels, no buffer for the meta-device build to leave empty."""
        heads = self.rank_heads if self.rank_heads is not None else range(self.num_heads)
        return self.alibi.bias(keys, heads, self.head_dim, device, rows)

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        if self.sinks is None:
            return {}
        rows = None if self.rank_heads is None else (slice(self.rank_heads.start, self.rank_heads.stop),)
        return {f"{path.rpartition('.')[0]}.sinks": Slot(self.sinks, source=rows)}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if self.value_pad:
            v = F.pad(v, (0, self.value_pad))
        slots = ctx.attention.slot_mapping
        if slots is not None and self.reads_kv_of is None:
            self.k_cache.index_copy_(0, slots, k)
            self.v_cache.index_copy_(0, slots, v)
            if ctx.attention.kv_copy is not None:
                src, dst = ctx.attention.kv_copy
                self.k_cache.index_copy_(0, dst, self.k_cache.index_select(0, src))
                self.v_cache.index_copy_(0, dst, self.v_cache.index_select(0, src))
        # Scores and probabilities of only the rows asked for, from their queries and their sequence's
        # keys (the cache holds every key of every sequence; a cache-less forward packs them in k).
        keys = self.k_cache if slots is not None else k
        for site in (self.hook_attn_scores, self.hook_pattern):
            t = attention_tap(site)
            if t is not None:
                t.attend(q, keys, self)
        out = ctx.backend.forward(q, k, v, self, ctx.backend_state)
        return out[..., : self.value_dim] if out.shape[-1] != self.value_dim else out
