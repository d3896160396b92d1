"""OLMo 2 and OLMo 3: Llama's projections and MLP with the norms moved, each of which changes the activations
if missed:

- no norm before attention or the MLP: both read the residual stream itself;
- one norm after each, before the residual add (base.PostNormBlock), so hook_attn_out and hook_mlp_out are after
  them and attn.hook_out and mlp.hook_out before; TransformerLens calls them ln1 and ln2;
- q and k each normalised over the whole projection, every head together, before the split into heads
  (layers/norm.ProjectionNorm);
- every RMSNorm scales by its weight in float32 and rounds last, and rotary runs in float32 (HF keeps OLMo 2's
  cos and sin in float32): the same numbers as Llama's order in float32, not in bfloat16;
- OLMo 3: sliding-window layers (three in four), each layer type with its rope (layers/rotary.py).
"""

from __future__ import annotations

from vlens.config import ModelConfig
from vlens.layers.norm import make_norm
from vlens.models.base import PostNormBlock
from vlens.models.llama import CausalLM, SelfAttention, mlp_for


class OlmoDecoderLayer(PostNormBlock):
    pre_norms = False

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.self_attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = mlp_for(cfg, layer)
        self.post_feedforward_layernorm = make_norm(cfg)

    attn_heads = property(lambda self: self.self_attn)


class OlmoForCausalLM(CausalLM):
    layer_class = OlmoDecoderLayer
