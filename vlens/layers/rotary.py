"""Rotary position embedding, computed from positions on the fly (no table to outgrow).

The frequencies follow HF's rope types; cos/sin are computed in float32 and cast to the activation
dtype exactly as HF does, so q and k match bit for bit in float32. A model may have two ropes (Gemma
3: one base for sliding-window layers, one for global ones), may rotate only the leading
`rotary_dim` dims of each head (NeoX, Phi, GPT-J), and may rotate them pair by pair (GPT-J).
"""

from __future__ import annotations

import math

import torch

from vlens.config import ModelConfig, UnsupportedModelError
from vlens.context import ForwardContext

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "proportional", "ntk_alpha")
FULL, SLIDING = "full", "sliding"


def inverse_frequencies(
    dim: int, theta: float, scaling: dict | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[dim / 2] inverse frequencies; for LongRoPE, [2, dim / 2]: the short factors, then the long ones."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    scaling = scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "ntk_alpha":  # (Hunyuan's "dynamic" with a fixed alpha: a larger base, the same for every length)
        theta = theta * scaling["alpha"] ** (dim / (dim - 2))
        kind = "default"
    if kind == "longrope":
        factors = torch.tensor([scaling["short_factor"], scaling["long_factor"]], dtype=torch.float32, device=device)
        return 1.0 / (factors * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
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
    if kind == "yarn":
        return _yarn(theta**exponents, dim, theta, scaling)
    if kind == "proportional":  # Gemma 4's full layers: the first partial_rotary_factor of the pairs turn, the rest
        # have frequency 0 (cos 1, sin 0: left as they are)
        turning = int(scaling.get("partial_rotary_factor", 1.0) * dim // 2)
        inv_freq[turning:] = 0
        return inv_freq / scaling.get("factor", 1.0)
    raise UnsupportedModelError(f"rope_type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _yarn(divisors: torch.Tensor, dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (gpt-oss, long-context Qwen): frequencies that turn fewer than `beta_slow` times over the original
    context are divided by `factor`, those that turn more than `beta_fast` times are kept, a linear ramp between
    (`divisors`: theta ** (2i / dim), whose inverses are the plain frequencies; HF's order of operations)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dimension(turns: float) -> float:  # the dimension whose frequency turns `turns` times over `original`
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.get("beta_fast") or 32), dimension(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=divisors.device) - low) / (high - low)
    kept = 1 - torch.clamp(ramp, 0, 1)
    return 1.0 / (factor * divisors) * (1 - kept) + 1.0 / divisors * kept


def _attention_factor(scaling: dict | None) -> float:
    """LongRoPE and YaRN scale cos and sin by this (HF's default when the config gives none)."""
    kind = (scaling or {}).get("rope_type")
    if kind not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor = scaling["factor"]
    if factor <= 1.0:
        return 1.0
    if kind == "yarn":
        mscale, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and all_dims:
            return (0.1 * mscale * math.log(factor) + 1) / (0.1 * all_dims * math.log(factor) + 1)
        return 0.1 * math.log(factor) + 1
    return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))


def _turn(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return angles.cos(), angles.sin()


# What a compiled forward calls instead: one kernel for every layer's cos and sin, where inductor would otherwise
# fuse them into each layer's rotary kernel and take them again for every head (it inlines a cheap producer into
# its consumers): ~40 us of a 1 ms decode step of a 2-layer model, and more the more layers and heads.
_turn_once = torch.library.custom_op("vlens::rope_cos_sin", _turn, mutates_args=())
_turn_once.register_fake(lambda angles: (torch.empty_like(angles), torch.empty_like(angles)))


class RopeTable:
    def __init__(
        self, dim: int, theta: float, scaling: dict | None, device: torch.device | str, pairs: bool = False,
        reversed: bool = False, sections: tuple[int, ...] = (), interleaved: bool = False,
    ):  # fmt: skip
        """`pairs`: each angle rotates dims 2i and 2i + 1 (GPT-J), not i and i + dim / 2; `reversed` (nanochat):
        by minus the angle, as its rotate_half (HF's negated) turns them: sin negated, the same numbers.
        `sections` (M-RoPE: ModelConfig.mrope_section): how many frequencies each of a row's three positions turns,
        in runs or `interleaved` (Qwen3-VL's), where the forward gives three (AttentionMetadata.rope_positions)."""
        self.inv_freq = inverse_frequencies(dim, theta, scaling, device)
        self.pairs, self.reversed = pairs, reversed
        self.which = None  # M-RoPE: the position (0, 1, 2: time, height, width) each frequency turns by
        if sections:
            cpu = torch.device("cpu")  # (a model is built on the meta device, then loaded)
            which = torch.arange(len(sections), device=cpu).repeat_interleave(torch.tensor(sections, device=cpu))
            if interleaved:  # (HF's: t everywhere, then h at 1, 4, 7, ... and w at 2, 5, 8, ... within 3 * size)
                j = torch.arange(sum(sections), device=cpu)
                which = torch.where((j % 3 == 1) & (j < 3 * sections[1]), 1,
                                    torch.where((j % 3 == 2) & (j < 3 * sections[2]), 2, 0))  # fmt: skip
            self.which = which.to(device)
        self.factor = _attention_factor(scaling)
        # LongRoPE switches to its long factors once a forward reaches past the original context
        # (HF decides per forward; vlens per sequence of the batch, which is the same for one sequence).
        self.switch_at = (scaling or {}).get("original_max_position_embeddings") if self.inv_freq.dim() == 2 else None

    def cos_sin(self, ctx: ForwardContext, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, dim] cos and sin, broadcast over heads."""
        inv_freq = self.inv_freq
        if self.switch_at is not None:
            inv_freq = inv_freq[(ctx.attention.sequence_ends >= self.switch_at).long()]  # [T, dim / 2]
        three = ctx.attention.rope_positions if self.which is not None else None
        if three is None:
            freqs = ctx.positions[:, None].float() * inv_freq
        else:  # (each frequency's angle from its own position, the product HF takes before it picks)
            freqs = three.float().index_select(0, self.which).T * inv_freq
        emb = (freqs.repeat_interleave(2, dim=-1) if self.pairs else torch.cat((freqs, freqs), dim=-1))[:, None, :]
        cos, sin = (_turn_once if torch.compiler.is_compiling() else _turn)(emb)
        if self.factor != 1.0:
            cos, sin = cos * self.factor, sin * self.factor
        return cos.to(dtype), (-sin if self.reversed else sin).to(dtype)


class Rotary:
    """The model's rope tables by kind: FULL for every layer, plus SLIDING where sliding-window layers
    have their own (Gemma 3). Empty when the model has no rotary (GPT-2)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str):
        self.tables: dict[str, RopeTable] = {}
        if cfg.rotary_dim:
            # each kind's rotary width (Gemma 4's full layers have larger heads than its sliding ones)
            dims = {self.kind(cfg, layer): cfg.rotary_dim_at(layer) for layer in range(cfg.num_layers)}
            full = dims.get(FULL, cfg.rotary_dim)
            self.tables[FULL] = RopeTable(full, cfg.rope_theta, cfg.rope_scaling, device, cfg.rotary_pairs,
                                          cfg.rotary_reversed, cfg.mrope_section, cfg.mrope_interleaved)  # fmt: skip
            if cfg.sliding_rope_theta is not None:
                table = RopeTable(dims.get(SLIDING, full), cfg.sliding_rope_theta, cfg.sliding_rope_scaling, device)
                self.tables[SLIDING] = table

    @staticmethod
    def kind(cfg: ModelConfig, layer: int) -> str:
        return SLIDING if cfg.sliding_rope_theta is not None and cfg.sliding_windows[layer] is not None else FULL

    def cos_sin(self, ctx: ForwardContext, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {kind: table.cos_sin(ctx, dtype) for kind, table in self.tables.items()}

