"""The norms of the supported families, with HF's numerics, and their taps as TransformerLens names them.

RMSNorm normalises in float32. Llama-style models cast back and then scale; OLMo 2 scales by w and
Gemma by (1 + w) while still in float32, and cast last. In float32 the orders agree; in bfloat16 they
round differently, so each family gets its own. LayerNorm (GPT-2, NeoX) is torch's fused kernel, as
in HF, unless a tap needs its inner values.

Taps (`NormHooks`): `hook_scale` is the divisor ([1] per token: sqrt(mean(x²) + eps), or for LayerNorm
sqrt(var + eps)), `hook_normalized` the input normalised *before* the weight (x / scale; LayerNorm
centres first) — TransformerLens's meaning — and `hook_out` the norm's output after weight and bias,
the module output HF reports; a post-norm (Gemma's, OLMo 2's) has no `hook_out`, its output being the layer's
hook_attn_out or hook_mlp_out, and a q/k norm no taps. A tap that only captures returns the very tensor it
was given, and then the output is computed exactly as without it; an edited scale or normalized value is
carried on through the weight (and bias).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlens.config import ModelConfig
from vlens.context import tap, tap_widened, tapped
from vlens.distributed.parallel import all_reduce
from vlens.layers import fused
from vlens.layers.checkpoint import Slot


@dataclass(frozen=True)
class NormHooks:
    scale: str = ""
    normalized: str = ""
    out: str = ""

    @classmethod
    def at(cls, prefix: str) -> NormHooks:
        return cls(prefix + ".hook_scale", prefix + ".hook_normalized", prefix + ".hook_out")


NO_HOOKS = NormHooks()  # names no tap ever has


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kind: str = "rms"):
        super().__init__()
        # (nanochat's norms have no weight: their output is their normalised input)
        self.weight = None if kind == "rms_unweighted" else nn.Parameter(torch.ones(dim))
        self.eps = eps
        # ModelConfig.norm: "rms", "rms_float", "rms_offset" (Gemma: w stored, 1 + w the scale) or "rms_unweighted"
        self.kind = kind

    def forward(self, x: torch.Tensor, hooks: NormHooks = NO_HOOKS) -> torch.Tensor:
        """x's norm, in x's dtype; its taps' rows in the weight's (the model's: Mamba's final norm reads a float32
        stream in a bfloat16 model)."""
        rows = x.dtype if self.weight is None else self.weight.dtype
        if not (tapped(hooks.scale) or tapped(hooks.normalized)):  # nothing asks for its inner values
            return tap_widened(hooks.out, fused.rms_norm(x, self.weight, self.eps, self.kind), rows)
        dtype = x.dtype
        h = x.float()
        variance = h.pow(2).mean(-1, keepdim=True) + self.eps
        h = h * torch.rsqrt(variance)
        if tapped(hooks.scale):
            scale = variance.sqrt().to(dtype)
            edited = tap_widened(hooks.scale, scale, rows)
            if edited is not scale:
                h = x.float() / edited.float()
        if tapped(hooks.normalized):
            normalized = h.to(dtype)
            edited = tap_widened(hooks.normalized, normalized, rows)
            if edited is not normalized:
                h = edited.float()
        out = fused.scaled(h, self.weight, self.kind, dtype)
        return tap_widened(hooks.out, out, rows)

    def apply_scale(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """This norm with its divisor given, not computed from x: x / scale times the weight. Linear in x,
        so parts of a stream, each put through with the whole stream's scale (its hook_scale), sum to the
        norm's output: what direct logit attribution needs."""
        return fused.scaled(x.float() / scale.float(), self.weight, self.kind, x.dtype)


class ProjectionNorm(nn.Module):
    """OLMo's q/k norm: an RMSNorm over all the heads' queries (or keys) of a token together, before they are split
    into heads. Under tensor parallelism a rank holds its heads' share of the weight and the sum of squares is added
    up over the ranks (where ranks share a key-value head, each counts it: the divisor counts it as often)."""

    def __init__(self, cfg: ModelConfig, heads: int):
        super().__init__()
        units, d, p = cfg.parallel.units(heads), cfg.head_dim, cfg.parallel
        self.weight = nn.Parameter(torch.ones(len(units) * d))
        self.eps, self.kind, self.parallel = cfg.norm_eps, cfg.norm, p
        self.rows = slice(units.start * d, units.stop * d)  # this rank's share of the stored weight
        self.width = heads * d * max(1, p.size // heads)

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        return {f"{path}.weight": Slot(self.weight, source=(self.rows,) if self.parallel.size > 1 else None)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return fused.rms_norm(x, self.weight, self.eps, self.kind)
        h = x.float()
        squares = all_reduce(h.pow(2).sum(-1, keepdim=True), self.parallel)
        return fused.scaled(h * torch.rsqrt(squares / self.width + self.eps), self.weight, self.kind, x.dtype)


class UnscaledRMSNorm(nn.Module):
    """Gemma 4's value norm: an RMSNorm in float32 with no weight, rounded last."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class LayerNorm(nn.Module):
    """`offset` (Nemotron's LayerNorm1P): the scale is 1 + w, w as stored, added in the weight's dtype as HF adds it."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps, self.offset = eps, offset

    def scale_weight(self) -> torch.Tensor:
        return self.weight + 1.0 if self.offset else self.weight

    def forward(self, x: torch.Tensor, hooks: NormHooks = NO_HOOKS) -> torch.Tensor:
        weight = self.scale_weight()
        out = F.layer_norm(x, x.shape[-1:], weight, self.bias, self.eps)
        if tapped(hooks.scale) or tapped(hooks.normalized):
            edited = _centred_taps(x, self.eps, hooks)
            if edited is not None:
                out = (edited.float() * weight.float() + self.bias.float()).to(x.dtype)
        return tap(hooks.out, out)

    def apply_scale(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """This norm with its divisor given (see RMSNorm.apply_scale): x centred, over scale, times the
        weight, without the bias, which is a constant of the norm and belongs to no part of the stream."""
        return (x - x.mean(-1, keepdim=True)) / scale * self.scale_weight()


class PlainLayerNorm(nn.Module):
    """A LayerNorm without a bias, computed in float32 and rounded to the input's dtype, as HF's: OLMo 1's, with no
    weight either (its output is its normalised input: `hook_out` and `hook_normalized` hold one value), MPT's, with a
    weight (`dim`) applied in float32, and Cohere's, `stepwise`: HF's float32 ops one by one (torch's kernel rounds
    otherwise, which a bfloat16 result can tell)."""

    def __init__(self, eps: float, dim: int | None = None, stepwise: bool = False):
        super().__init__()
        self.eps, self.stepwise = eps, stepwise
        self.weight = None if dim is None else nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, hooks: NormHooks = NO_HOOKS) -> torch.Tensor:
        h = x.float()
        weight = None if self.weight is None else self.weight.float()
        if self.stepwise:
            centred = h - h.mean(-1, keepdim=True)
            out = (weight * (centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)
        else:
            out = F.layer_norm(h, h.shape[-1:], weight, None, self.eps).to(x.dtype)
        if tapped(hooks.scale) or tapped(hooks.normalized):
            edited = _centred_taps(x, self.eps, hooks)
            if edited is not None:
                out = edited if weight is None else (edited.float() * weight).to(x.dtype)
        return tap(hooks.out, out)

    def apply_scale(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """This norm with its divisor given (see RMSNorm.apply_scale): x centred, over scale (times the weight)."""
        h = x.float()
        h = (h - h.mean(-1, keepdim=True)) / scale.float()
        return (h if self.weight is None else h * self.weight.float()).to(x.dtype)


def _centred_taps(x: torch.Tensor, eps: float, hooks: NormHooks) -> torch.Tensor | None:
    """A LayerNorm's inner taps of `x`: its divisor sqrt(var + eps) and its input centred and divided by it, computed
    in float32 and rounded last (as torch's kernel and TransformerLens's LayerNorm compute them). The normalised
    input as the taps leave it, or None where they only read (the norm's output is then its own)."""
    h = x.float()
    centred = h - h.mean(-1, keepdim=True)
    divisor = (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    scale = divisor.to(x.dtype)
    edited_scale = tap(hooks.scale, scale)
    normalized = (centred / (divisor if edited_scale is scale else edited_scale.float())).to(x.dtype)
    edited = tap(hooks.normalized, normalized)
    return None if edited_scale is scale and edited is normalized else edited


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The model's norm over `dim` features (default: the residual width)."""
    dim = cfg.hidden_size if dim is None else dim
    if cfg.norm in ("layer", "layer_offset"):
        return LayerNorm(dim, cfg.norm_eps, cfg.norm == "layer_offset")
    if cfg.norm in ("layer_plain", "layer_nobias", "layer_cohere"):
        return PlainLayerNorm(cfg.norm_eps, None if cfg.norm == "layer_plain" else dim, cfg.norm == "layer_cohere")
    return RMSNorm(dim, cfg.norm_eps, cfg.norm)
