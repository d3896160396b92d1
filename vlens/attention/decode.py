"""Decode attention over fixed-shape buffers: the kernel of the runner's static decode step, which a CUDA
graph captures once per (batch bucket, page bucket) and replays.

Every tensor it reads is a front of the runner's buffers with the bucket's shape: the block tables
[B, pages] and the context lengths [B]. `prepare` turns them into key slots and masks with tensor ops
only (no host work, no data-dependent shape), so a replay recomputes them from whatever the host wrote.
Where a paged kernel runs and matches this file's on a trial problem, each row's keys are read in place
through its block table: Triton's on CUDA (vlens.attention.paged_decode), C on the CPU at float32
(vlens.attention.paged_decode_cpu). Otherwise each row's keys are gathered from the paged cache and read by
one SDPA call per layer; keys past a row's context are masked. Either way rows that only pad the batch
attend to the scratch slot they wrote.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from vlens.attention.metadata import AttentionMetadata, LayerKind, Reach, first_visible
from vlens.attention.sdpa import gather, sdpa, written, written_attention

log = logging.getLogger("vlens.engine")


@dataclass
class DecodeState:
    tables: torch.Tensor  # [B, pages] each row's KV blocks
    context: torch.Tensor  # [B] each row's keys
    block_size: int
    # The gathering kernel's: cache slot of key j of each row [B, pages * block size], and per reach (window,
    # chunk) which keys each row may see [B, 1, 1, keys]
    key_slots: torch.Tensor | None = None
    masks: dict[Reach, torch.Tensor] = field(default_factory=dict)


class DecodeBackend:
    name = "decode"

    def __init__(self, paged: Callable | None = None, programs: int = 0):
        self.paged, self.programs = paged, programs  # the paged kernel, and the programs Triton's aims for

    @classmethod
    def for_device(cls, device: torch.device, dtype: torch.dtype, kinds: Collection[LayerKind] = ()) -> DecodeBackend:
        """With a kernel that reads the paged cache in place where one runs here and agrees with the gathering
        kernel on a trial problem (GQA, a window, a soft cap) at each of the model's head sizes (its layers'
        `kinds`; Gemma 4's heads are of 256 and 512): Triton's on CUDA, the C one on the CPU (float32); without one
        otherwise (and for ALiBi, BLOOM's, which they do not add), saying why once."""
        if (device.type == "cpu" and dtype != torch.float32) or any(kind.alibi for kind in kinds):
            return cls()
        try:
            if device.type == "cuda":
                from vlens.attention.paged_decode import paged_decode

                sms = torch.cuda.get_device_properties(device).multi_processor_count
                paged, dtypes = cls(paged_decode, 8 * sms), (torch.float32, torch.bfloat16)
            else:
                from vlens.attention.paged_decode_cpu import paged_decode_cpu

                paged, dtypes = cls(paged_decode_cpu), (torch.float32,)
            for dim in sorted({kind.head_dim for kind in kinds} or {64}):
                _trial(paged, cls(), device, dtypes, dim)
            return paged
        except Exception as e:  # noqa: BLE001 - no compiler or Triton, or a kernel that cannot build or run right
            log.warning("decode attention gathers keys (the paged kernel is not used: %s)", e)
            return cls()

    def prepare(self, meta: AttentionMetadata, kinds: set[LayerKind], dtype: torch.dtype) -> DecodeState:
        tables, context = meta.block_tables_device, meta.context_lens_device
        bs = meta.block_size
        if self.paged is not None:
            return DecodeState(tables, context, bs)
        j = torch.arange(tables.shape[1] * bs, device=tables.device)
        key_slots = tables[:, j // bs] * bs + j % bs
        position = (context - 1)[:, None]  # each row is its sequence's last token
        masks = {}
        for reach in {kind.reach for kind in kinds}:
            allowed = (j[None, :] <= position) & (j[None, :] >= first_visible(reach, position))
            masks[reach] = allowed[:, None, None, :]
        return DecodeState(tables, context, bs, key_slots, masks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, state: DecodeState) -> torch.Tensor:
        if self.paged is not None:
            tables, context = state.tables, state.context
            return self.paged(q, layer.k_cache, layer.v_cache, tables, context, state.block_size, layer, self.programs)
        keys = gather(layer.k_cache, state.key_slots).transpose(1, 2)  # [B, H_kv, keys, d]
        values = gather(layer.v_cache, state.key_slots).transpose(1, 2)
        mask = state.masks[layer.kind.reach]
        if written(layer.kind):
            return written_attention(q[:, :, None, :], keys, values, mask, layer)[:, :, 0, :]
        # The query heads of one KV head share its keys and the row's mask: as that head's queries they need
        # no GQA support from the kernel, which lets SDPA take its memory-efficient (masked) kernel on CUDA.
        rows, heads, dim = q.shape
        grouped = q.view(rows, layer.num_kv_heads, heads // layer.num_kv_heads, dim)
        out = sdpa(grouped, keys, values, attn_mask=mask, scale=layer.scale)
        return out.reshape(rows, heads, dim)


def kernel_layer(
    kind: LayerKind, k_cache: torch.Tensor, v_cache: torch.Tensor, sinks: torch.Tensor | None = None
) -> SimpleNamespace:
    """What a decode kernel reads of an attention layer, for trials and tests: its kind, the kind's fields, its
    caches and its sinks."""
    return SimpleNamespace(**{**kind._asdict(), "sinks": sinks}, kind=kind, k_cache=k_cache, v_cache=v_cache)


def _trial(
    paged: DecodeBackend, gathering: DecodeBackend, device: torch.device, dtypes: tuple[torch.dtype, ...], dim: int
) -> None:
    """Raise unless both kernels agree on random pages, contexts 1 .. 96 (two key tiles, so a row's keys
    split and merge), with and without a window, a soft cap and sinks, and in chunks, in each of `dtypes`: float32
    within 1e-5, bfloat16 within its rounding. A disagreement is measured again before it counts: in roughly one
    process in ten that had built an HF model first, the gathering kernel's first call came out up to 1e-4 off
    its later ones (on this CPU, not reproduced in isolation), which refused the C kernel for a whole engine."""
    g = torch.Generator(device="cpu").manual_seed(0)
    bs, rows, width, kv_heads = 16, 6, 6, 2
    tables = torch.randperm(rows * width, generator=g).view(rows, width).to(device)
    context = torch.tensor([1, 5, 17, 40, 70, 96], device=device)
    meta = SimpleNamespace(block_tables_device=tables, context_lens_device=context, block_size=bs)
    for dtype in dtypes:
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        cache = torch.randn(2, rows * width * bs, kv_heads, dim, generator=g).to(device, dtype)
        q = torch.randn(rows, 8, dim, generator=g).to(device, dtype)
        sinks = torch.randn(8, generator=g).to(device, dtype)
        trials = ((None, None, False, None), (7, 30.0, True, None), (None, None, False, 32))  # (the last: in chunks)
        for window, softcap, sinked, chunk in trials:
            kind = LayerKind(8, kv_heads, dim, window, dim**-0.5, softcap, sinked, chunk=chunk)
            layer = kernel_layer(kind, cache[0], cache[1], sinks if sinked else None)
            errors = []
            for _ in range(2):  # (twice before refusing: see below)
                got, want = (
                    b.forward(q, None, None, layer, b.prepare(meta, {kind}, dtype)).float() for b in (paged, gathering)
                )
                errors.append(((got - want).norm() / want.norm()).item())
                if errors[-1] <= tolerance:
                    break
            else:
                raise RuntimeError(
                    f"the paged kernel differs from the gathering kernel by {errors[0]:.1e}, then {errors[1]:.1e}, in "
                    f"{dtype} at heads of {dim}"
                )
