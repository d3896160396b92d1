"""Apertus (Swiss AI): Llama's attention with q/k norms head by head, its norms under names of its own
(`attention_layernorm`, `feedforward_layernorm`), and an MLP that is not gated: xIELU(up_proj(x)), then down_proj,
the activation's weights learned in every layer (layers/mlp.XIELU)."""

from __future__ import annotations

from vlens.config import ModelConfig
from vlens.layers.mlp import DenseMLP
from vlens.layers.norm import make_norm
from vlens.models.base import ResidualBlock
from vlens.models.llama import CausalLM, SelfAttention


class ApertusDecoderLayer(ResidualBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.attention_layernorm = make_norm(cfg)
        self.self_attn = SelfAttention(cfg, layer)
        self.feedforward_layernorm = make_norm(cfg)
        self.mlp = DenseMLP(cfg, layer, ("up_proj", "down_proj"))

    ln1 = property(lambda self: self.attention_layernorm)
    ln2 = property(lambda self: self.feedforward_layernorm)
    attn_heads = property(lambda self: self.self_attn)


class ApertusForCausalLM(CausalLM):
    layer_class = ApertusDecoderLayer
