"""Cohere (Command R, Aya Expanse) and Cohere 2 (Command R7B, Command A): Llama's modules under Llama's names, in
GPT-NeoX's parallel residual with one norm for both sublayers, x + attn(ln(x)) + mlp(ln(x)); the norm a LayerNorm
with a weight and no bias (in float32), rotary by pairs (Cohere 2: on its sliding-window layers only), the logits
scaled by logit_scale.

As for Phi and GPT-J, TransformerLens's ln2 is ln1: `ln2`'s taps read the one norm again (ResidualBlock.shared_norm).
"""

from __future__ import annotations

import torch

from vlens.config import ModelConfig
from vlens.layers.norm import make_norm
from vlens.models.base import ResidualBlock
from vlens.models.llama import CausalLM, SelfAttention, mlp_for


class CohereDecoderLayer(ResidualBlock):
    parallel = shared_norm = True

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.input_layernorm = make_norm(cfg)
        self.self_attn = SelfAttention(cfg, layer)
        self.mlp = mlp_for(cfg, layer)

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.input_layernorm)  # (one norm for both sublayers)
    attn_heads = property(lambda self: self.self_attn)

    def parallel_sum(self, x: torch.Tensor, a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return x + a + m  # (HF's Cohere: residual + attention + MLP)


class CohereForCausalLM(CausalLM):
    layer_class = CohereDecoderLayer
