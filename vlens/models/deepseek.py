"""DeepSeek-V2 and V3 (V3.1, R1, Kimi K2, Moonlight): Llama's layer with multi-head latent attention (MLA) and, past
the first dense layers, DeepSeek's routed experts beside shared ones (vlens.layers.moe.DeepseekMoE, via mlp_for).

MLA makes what a token gives every head's keys and values from one latent of the layer's input (kv_lora_rank dims,
normed): each head's key is its own part without positions (from the latent) and one rotating part shared by all
heads; its value is of its own size, smaller than the keys'. Queries come through a low-rank projection and its norm
(or one projection, V2-Lite's). The engine caches the keys and values the latent expands to, which is what HF's
attention reads too (HF caches the latent and expands it each step: the same numbers); the values are padded to the
keys' size there (vlens.layers.attention). The taps are TransformerLens's: hook_q and hook_k per head after rotary,
their no-position dims first, hook_v and hook_z of the values' size; and the latents themselves, after their norms
(attn.hook_q_latent, attn.hook_kv_latent: what a KV cache of MLA would hold, and what an edit there changes in every
head at once).

With `latent_kv_cache` (EngineConfig) the cache holds what a token gives every head, its normed latent and its
rotated key part (kv_lora_rank + rotary dims: V3's 576 against 128 heads x 2 x 192), as DeepSeek's own inference and
vLLM keep it. The heads then attend as one key-value head does to many queries: each head's query part without
positions goes through that head's rows of kv_b_proj that make its keys (scores q . (W_k c) = (W_k^T q) . c), its
rotating part meets the cached one, the values are the latents, and each head's output comes back through its rows
that make its values. The same sums in another order: float32 within 1e-5 of HF, bfloat16 not bit for bit. hook_k
and hook_v are HF's keys and values of the step's rows, expanded only where a request reads them; an edit of them
would have to reach keys the cache no longer holds, and is refused (an edit of attn.hook_kv_latent reaches them all).
"""

from __future__ import annotations

import torch

from vlens.capture.names import LATENT_HOOKS
from vlens.config import ModelConfig
from vlens.context import tap, tapped
from vlens.layers import fused
from vlens.layers.linear import ColumnLinear, RowLinear, StoredLinear
from vlens.layers.norm import RMSNorm
from vlens.models.base import AttentionHeads, Rope
from vlens.models.llama import CausalLM, DecoderLayer

LATENT_NORM_EPS = 1e-6  # (HF builds the latents' norms with its RMS norm's default eps, not rms_norm_eps)


class LatentAttention(AttentionHeads):
    """q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa (the latent, then the shared rotating part of
    the keys), kv_a_layernorm, kv_b_proj (each head's key part without positions, then its value) and o_proj, as HF
    names them. Under tensor parallelism q_b_proj, kv_b_proj and o_proj are split by heads; the latents' projections
    are small and every rank computes them whole."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        h, d, p = cfg.num_heads, cfg.hidden_size, cfg.parallel
        self.rope_dim, self.latent_dim = cfg.rotary_dim, cfg.kv_lora_rank
        self.nope_dim = self.head_dim - self.rope_dim
        # (rotated here, the rotating parts alone: `attend` takes q and k as they come)
        self.rope_table, self.rope_kind = self.rope_kind, None
        self.interleaved, self.q_lora = cfg.rotary_interleaved, bool(cfg.q_lora_rank)
        if self.q_lora:
            self.q_a_proj = StoredLinear(d, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, cfg.norm)
            self.q_b_proj = ColumnLinear(cfg.q_lora_rank, h * self.head_dim, False, p, units=h)
        else:
            self.q_proj = ColumnLinear(d, h * self.head_dim, False, p, units=h)
        self.kv_a_proj_with_mqa = StoredLinear(d, self.latent_dim + self.rope_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, LATENT_NORM_EPS, cfg.norm)
        self.kv_b_proj = ColumnLinear(self.latent_dim, h * (self.nope_dim + self.value_dim), False, p, units=h)
        self.o_proj = RowLinear(h * self.value_dim, d, cfg.o_bias, p, units=h)
        self.hook_q_latent, self.hook_kv_latent = (f"blocks.{layer}.{hook}" for hook in LATENT_HOOKS)
        self.latent_cached = cfg.latent_kv_cache

    out = property(lambda self: self.o_proj)

    def cached_kv(self, cfg: ModelConfig) -> tuple[int, int, int]:
        if cfg.latent_kv_cache:  # (one "head" a token, the latent and the rotating key part; the values its latent)
            return 1, cfg.kv_lora_rank + cfg.rotary_dim, cfg.kv_lora_rank
        return super().cached_kv(cfg)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, ...], rope: Rope) -> torch.Tensor:
        if not self.latent_cached:
            return super().forward(x, rope)
        q, latent, k_rot = self._latents(x, rope)
        q = tap(self.hook_q, q)
        if tapped(self.hook_k) or tapped(self.hook_v):  # (HF's keys and values of these rows, for their readers)
            k, v = self._expanded(latent, k_rot)
            if tap(self.hook_k, k) is not k or tap(self.hook_v, v) is not v:
                raise ValueError(f"{self.hook_k} and {self.hook_v} cannot be edited with latent_kv_cache=True: the "
                                 "cache holds the latents (edit attn.hook_kv_latent instead)")  # fmt: skip
        w_k, w_v = self.kv_b_proj.weight.view(self.heads, -1, self.latent_dim).split([self.nope_dim, self.value_dim], 1)
        q_nope, q_rot = self.scaled_query(q).split([self.nope_dim, self.rope_dim], -1)
        query = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_k), q_rot], -1)
        z = self.attn(query, torch.cat([latent[:, None], k_rot], -1), latent[:, None])
        return self.output(tap(self.hook_z, torch.einsum("thr,hvr->thv", z, w_v)).flatten(1))

    def project(
        self, x: torch.Tensor | tuple[torch.Tensor, ...], rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        """q and k [T, H*d] after rotary, v [T, H*d_v] (`x` [T, d]: no input per head, vlens.capture.names)."""
        q, latent, k_rot = self._latents(x, rope)
        k, v = self._expanded(latent, k_rot)
        return q.flatten(1), k.flatten(1), v.flatten(1), None

    def _latents(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the queries [T, H, d] after rotary, the normed latent [T, kv_lora_rank], the rotated key part
        [T, 1, rotary_dim]) of the layer's input [T, d]."""
        if self.q_lora:
            q = self.q_b_proj(tap(self.hook_q_latent, self.q_a_layernorm(self.q_a_proj(x))))
        else:
            q = self.q_proj(x)
        q_nope, q_rot = q.view(-1, self.heads, self.head_dim).split([self.nope_dim, self.rope_dim], -1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.latent_dim, self.rope_dim], -1)
        latent = tap(self.hook_kv_latent, self.kv_a_layernorm(latent))
        return torch.cat([q_nope, self._rotated(q_rot, rope)], -1), latent, self._rotated(k_rot[:, None], rope)

    def _expanded(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's keys [T, H, d] and values [T, H, d_v] of the latents [T, kv_lora_rank] (HF's)."""
        kv = self.kv_b_proj(latent).view(-1, self.heads, self.nope_dim + self.value_dim)
        k_nope, v = kv.split([self.nope_dim, self.value_dim], -1)
        return torch.cat([k_nope, k_rot.expand(-1, self.heads, -1)], -1), v

    def _rotated(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """[T, heads, rotary_dim] rotated by position: V3's pairs (2i, 2i + 1) laid out by halves first, as HF's
        rope_interleave rotates them; V2's by pairs in float32 tables, rounded back (HF's complex product)."""
        cos, sin = rope[self.rope_table]
        if self.interleaved:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], -1)
        return (fused.rotate_pairs if self.rotary_pairs else fused.rotate)(x, cos, sin).to(x.dtype)


class DeepseekDecoderLayer(DecoderLayer):
    attention = LatentAttention


class DeepseekForCausalLM(CausalLM):
    layer_class = DeepseekDecoderLayer
