"""Rotary position embedding, computed from positions on the fly (no table to outgrow).

The frequencies follow HF's rope types; cos/sin are computed in float32 and cast to the activation
dtype exactly as HF does, so q and k match bit for bit in float32.
"""

from __future__ import annotations

import math

import torch

from vlens.config import ModelConfig, UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedModelError(f"rope_type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


class Rotary:
    def __init__(self, cfg: ModelConfig, device: torch.device | str):
        self.inv_freq = inverse_frequencies(cfg, device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] cos and sin, broadcast over heads."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
