"""FlashInfer's paged kernels (CUDA only; `pip install 'vlens[cuda]'`): one plan per step and layer kind
on the host, then one kernel call per layer that reads the paged cache in place.

vlens's cache of a layer, [slots, H_kv, d] with slots = blocks x block size, is FlashInfer's NHD page
layout [pages, page size, H_kv, d] as a view. An engine step plans the paged prefill wrapper (decode
rows are queries of length 1); a cache-less forward (trace, harvest) plans the ragged one over the
packed keys. Sliding windows and Gemma 2's soft-capping are plan arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlens.attention.metadata import AttentionMetadata, LayerKind

WORKSPACE_BYTES = 128 << 20


HEAD_SIZES = (64, 128, 256)  # the head sizes its kernels are built for


def problem(kinds: set[LayerKind], dtype: torch.dtype) -> str | None:
    """Why FlashInfer cannot run a model with these layers at `dtype`, or None: its prefill kernels, which every
    step here plans (decode rows are queries of length 1), load 16-bit tiles only, so float32 fails only at the
    first step's plan, after the model has loaded; the wrappers vlens plans take no attention sinks; its kernels
    are built for a few head sizes."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"needs float16 or bfloat16 (its prefill kernels), not {str(dtype).removeprefix('torch.')}"
    if any(kind.sinks for kind in kinds):
        return "(as vlens plans it) has no attention sinks, which this model's layers have"
    if any(kind.alibi for kind in kinds):
        return "(as vlens plans it) adds no ALiBi biases, which this model's layers have"
    if any(kind.chunk for kind in kinds):
        return "(as vlens plans it) has no chunked attention, which this model's layers have"
    sizes = sorted({kind.head_dim for kind in kinds} - set(HEAD_SIZES))
    if sizes:  # (Gemma 4's full layers: 512)
        return f"takes heads of {', '.join(map(str, HEAD_SIZES))} dims, not {sizes}"
    return None


@dataclass
class FlashInferState:
    plans: dict[LayerKind, object]  # the planned wrapper of each layer kind
    block_size: int  # 0: no cache (ragged keys)


class FlashInferBackend:
    name = "flashinfer"

    def __init__(self, device: torch.device):
        import flashinfer  # an optional extra: imported only when chosen

        self.flashinfer, self.device = flashinfer, device
        self._wrappers: dict[tuple[bool, LayerKind], object] = {}  # plans of different kinds must not share

    def _wrapper(self, paged: bool, kind: LayerKind):
        key = (paged, kind)
        if key not in self._wrappers:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            cls = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper if paged else self.flashinfer.BatchPrefillWithRaggedKVCacheWrapper
            self._wrappers[key] = cls(workspace, "NHD")
        return self._wrappers[key]

    def prepare(self, meta: AttentionMetadata, kinds: set[LayerKind], dtype: torch.dtype) -> FlashInferState:
        qo_indptr = meta.cu_seqlens_q.to(self.device)
        plans = {}
        for kind in kinds:
            wrapper = self._wrapper(meta.paged, kind)
            common = dict(
                causal=True, sm_scale=kind.scale, window_left=-1 if kind.window is None else kind.window - 1,
                logits_soft_cap=kind.softcap or 0.0, q_data_type=dtype,
            )  # fmt: skip
            if meta.paged:
                bs = meta.block_size
                indptr, indices, last = meta.page_indptr, meta.page_indices, meta.last_page_lens
                wrapper.plan(
                    qo_indptr, indptr.to(self.device), indices.to(self.device), last.to(self.device),
                    kind.num_heads, kind.num_kv_heads, kind.head_dim, bs, kv_data_type=dtype, **common,
                )  # fmt: skip
            else:
                wrapper.plan(qo_indptr, qo_indptr, kind.num_heads, kind.num_kv_heads, kind.head_dim, **common)
            plans[kind] = wrapper
        return FlashInferState(plans, meta.block_size if meta.paged else 0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, state: FlashInferState) -> torch.Tensor:
        wrapper = state.plans[layer.kind]
        if state.block_size:
            pages = (-1, state.block_size, layer.num_kv_heads, layer.head_dim)
            return wrapper.run(q, (layer.k_cache.view(pages), layer.v_cache.view(pages)))
        return wrapper.run(q, k, v)
