"""Qwen 3.5 (dense and MoE) and Qwen3-Next: Qwen3's layer with Gemma's (1 + w) norms, a gate on each attention
head's output, and on three layers in four (`linear_layers`) a gated delta net in place of attention
(vlens.layers.gated_delta), whose recurrent state per sequence the runner keeps in state slots beside the paged KV
cache of the attention layers; the MLP is Llama's, or Qwen2-MoE's experts beside a gated shared expert.

A linear-attention layer's taps are under `blocks.L.linear_attn.`; its hook_attn_out, hook_resid_mid, norms and MLP
are every layer's.
"""

from __future__ import annotations

import torch

from vlens.config import ModelConfig
from vlens.layers.gated_delta import GatedDeltaNet
from vlens.layers.norm import make_norm
from vlens.models.base import ResidualBlock, Rope
from vlens.models.llama import CausalLM, SelfAttention, mlp_for


class Qwen3_5DecoderLayer(ResidualBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.input_layernorm = make_norm(cfg)
        self.is_linear = cfg.is_linear_layer(layer)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, layer)
        else:
            self.self_attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = mlp_for(cfg, layer)

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.post_attention_layernorm)
    attn_heads = property(lambda self: self.self_attn)

    def attn_out(self, h: torch.Tensor | tuple[torch.Tensor, ...], rope: Rope) -> torch.Tensor:
        return self.linear_attn(h) if self.is_linear else self.self_attn(h, rope)


class Qwen3_5ForCausalLM(CausalLM):
    layer_class = Qwen3_5DecoderLayer
