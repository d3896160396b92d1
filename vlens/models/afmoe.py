"""AFMoE (Arcee's Trinity Nano, Mini and Large): Gemma's sandwich norms (each sublayer's output normed before the add;
OLMo 2's norms, scaled in float32) under AFMoE's names, attention with q/k norms head by head and an output gate of its
own projection (gate_proj: z times sigmoid(gate), as Qwen 3.5's gate from q_proj), rotary on its sliding-window layers
alone, and DeepSeek's experts after dense layers: each token's top k by the float32 sigmoid of the router's logits (the
router in the model's dtype) plus a bias per expert, renormalised and scaled, beside shared ones (DeepseekMoE)."""

from __future__ import annotations

from vlens.config import ModelConfig
from vlens.layers.norm import make_norm
from vlens.models.base import PostNormBlock
from vlens.models.llama import CausalLM, OwnGateAttention, mlp_for


class AfmoeDecoderLayer(PostNormBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.input_layernorm = make_norm(cfg)
        self.self_attn = OwnGateAttention(cfg, layer)
        self.post_attention_layernorm = make_norm(cfg)
        self.pre_mlp_layernorm = make_norm(cfg)
        self.mlp = mlp_for(cfg, layer)
        self.post_mlp_layernorm = make_norm(cfg)

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.pre_mlp_layernorm)
    attn_heads = property(lambda self: self.self_attn)
    mlp_post_norm = property(lambda self: self.post_mlp_layernorm)


class AfmoeForCausalLM(CausalLM):
    layer_class = AfmoeDecoderLayer
