"""Qwen 3.5 (dense and MoE) and Qwen3-Next: Qwen3's layer with Gemma's (1 + w) norms, a gate on each attention
head's output, and on three layers in four (`linear_layers`) a gated delta net in place of attention
(vlens.layers.gated_delta), whose recurrent state per sequence the runner keeps in state slots beside the paged KV
cache of the attention layers; the MLP is Llama's, or Qwen2-MoE's experts beside a gated shared expert.

A linear-attention layer's taps are under `blocks.L.linear_attn.`; its hook_attn_out, hook_resid_mid, norms and MLP
are every layer's.
"""

from __future__ import annotations

from vlens.config import ModelConfig
from vlens.layers.gated_delta import GatedDeltaNet
from vlens.layers.norm import make_norm
from vlens.models.base import MixerBlock
from vlens.models.llama import CausalLM, SelfAttention, mlp_for


class Qwen3_5DecoderLayer(MixerBlock):
    mixer_name = "linear_attn"

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.input_layernorm = make_norm(cfg)
        self.add_mixer(cfg, layer, SelfAttention, GatedDeltaNet)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = mlp_for(cfg, layer)

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.post_attention_layernorm)


class Qwen3_5ForCausalLM(CausalLM):
    layer_class = Qwen3_5DecoderLayer
