"""GLM-4 (Zhipu AI: GLM-4-0414, GLM-Z1): Gemma 2's sandwich layer under GLM-4's names — input_layernorm before
attention, post_self_attn_layernorm after it, post_attention_layernorm before the MLP (its pre-MLP norm, whatever
the name says), post_mlp_layernorm after it — with Llama's RMS norms, GLM's attention (q/k/v biases, rotary by pairs
over the leading half of each head) and a gated MLP whose gate and up are one stored gate_up_proj. GLM (GLM-4-9B-0614,
GLM-Edge) is Llama's layer with that attention and MLP: vlens.models.llama with config flags."""

from __future__ import annotations

from vlens.config import ModelConfig
from vlens.layers.norm import make_norm
from vlens.models.base import PostNormBlock
from vlens.models.llama import CausalLM, SelfAttention, mlp_for


class Glm4DecoderLayer(PostNormBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.input_layernorm = make_norm(cfg)
        self.self_attn = SelfAttention(cfg, layer)
        self.post_self_attn_layernorm = make_norm(cfg)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = mlp_for(cfg, layer)
        self.post_mlp_layernorm = make_norm(cfg)

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.post_attention_layernorm)
    attn_heads = property(lambda self: self.self_attn)
    attn_post_norm = property(lambda self: self.post_self_attn_layernorm)
    mlp_post_norm = property(lambda self: self.post_mlp_layernorm)


class Glm4ForCausalLM(CausalLM):
    layer_class = Glm4DecoderLayer
