"""Activations by their HF config names, the gated MLP (act(gate) * up, then down) that the Llama, Gemma, Phi-3
and Qwen2-MoE (dense layers, shared expert) families share, and the plain one (act(fc_in(x)), then fc_out) of
GPT-NeoX, Phi, GPT-J, GPT-Neo, OPT and Apertus (whose xIELU has weights)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vlens.config import ModelConfig, UnsupportedModelError
from vlens.context import tap
from vlens.distributed.parallel import SINGLE, Parallel
from vlens.layers import fused
from vlens.layers.linear import ColumnLinear, FusedLinear, RowLinear


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU written out: not bit-equal to torch's fused tanh GELU, and HF uses this form."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "relu": F.relu,  # (OPT)
    "relu2": lambda x: torch.square(F.relu(x)),  # (Nemotron-H's squared ReLU)
    "bloom_gelu": lambda x: x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))),  # (HF's BLOOM's)
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:  # a KeyError from deep in model construction says nothing
        raise UnsupportedModelError(f"hidden_act {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """`stored_fused`: the checkpoint keeps gate and up as one tensor, named `fused` (Phi-3's gate_up_proj, Granite
    4's input_linear).
    `parallel`: each rank holds its columns of gate and up and the matching ones of down. `fc_in` (parts gate,
    then up) and `fc_out` name the projections as every dense MLP does, so that weight views
    (vlens.hooked_weights) read every family alike."""

    def __init__(
        self, hidden: int, intermediate: int, act: str, bias: bool, hook_post: str, stored_fused: bool = False,
        parallel: Parallel = SINGLE, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        fused: str = "gate_up_proj", multipliers: tuple[float, float] = (1.0, 1.0),
    ):  # fmt: skip
        """`names`: the checkpoint's names of gate, up and down (LFM2's: w1, w3, w2). `multipliers` (Falcon-H1's µP):
        the gate's, inside the activation, and the output's."""
        super().__init__()
        gate, up, down = names
        parts = {gate: intermediate, up: intermediate}
        setattr(self, fused, FusedLinear(hidden, parts, bias, stored_fused=stored_fused, parallel=parallel))
        setattr(self, down, RowLinear(intermediate, hidden, bias, parallel))
        self.fused, self.down = fused, down
        self.act = activation(act)
        self.hook_post = hook_post
        self.multipliers = multipliers

    fc_in = property(lambda self: self._modules[self.fused])
    fc_out = property(lambda self: self._modules[self.down])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc_in.split(self.fc_in(x))
        into, out = self.multipliers
        h = fused.gated(self.act, gate if into == 1.0 else gate * into, up)
        h = tap(self.hook_post, h)
        h = self.fc_out(h)
        return h if out == 1.0 else h * out


class DenseMLP(nn.Module):
    """act(fc_in(x)), then fc_out, with the projections under the names the family's checkpoints give them
    (`names`: fc_in's, fc_out's); under tensor parallelism each rank holds its columns of fc_in and the matching
    rows of fc_out. `shared`: Nemotron 3's shared expert, of shared_expert_intermediate_size, its hook_post
    mlp.shared_expert.hook_post."""

    def __init__(self, cfg: ModelConfig, layer: int, names: tuple[str, str], shared: bool = False):
        super().__init__()
        width = cfg.shared_expert_intermediate_size if shared else cfg.intermediate_size
        sizes, p = (cfg.hidden_size, width), cfg.parallel
        self.names = names
        setattr(self, names[0], ColumnLinear(*sizes, cfg.mlp_bias, p))
        setattr(self, names[1], RowLinear(*reversed(sizes), cfg.mlp_bias, p))
        # (Apertus's xIELU has weights of its own in each layer, under HF's name for it)
        self.act_fn = XIELU() if cfg.hidden_act == "xielu" else activation(cfg.hidden_act)
        self.hook_post = f"blocks.{layer}.mlp.{'shared_expert.' if shared else ''}hook_post"

    # (as GatedMLP's, for vlens.hooked_weights; read from the registry, as GPT-J's own names are these)
    fc_in = property(lambda self: self._modules[self.names[0]])
    fc_out = property(lambda self: self._modules[self.names[1]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act_fn(self.fc_in(x))
        h = tap(self.hook_post, h)
        return self.fc_out(h)


class XIELU(nn.Module):
    """Apertus's activation (xIELU): a learned quadratic for positive inputs, a learned expm1 for negative ones, with
    HF's parametrisation (softplus of the stored alphas; beta and eps stored too) and its order of operations."""

    def __init__(self):
        super().__init__()
        self.alpha_p, self.alpha_n = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
        self.beta, self.eps = nn.Parameter(torch.zeros(())), nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        negative = (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x
        return torch.where(x > 0, alpha_p * x * x + self.beta * x, negative)
