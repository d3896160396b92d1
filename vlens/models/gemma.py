"""Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's quirks, every one of which changes the
activations if missed:

- embeddings times sqrt(hidden_size), the factor rounded to the model dtype first (hook_embed is after it);
- RMSNorm scaling by (1 + w) in float32 (layers/norm.py), also for Gemma 3's q/k norm;
- sandwich norms: post_attention_layernorm is applied to the attention output *before* the residual
  add (so hook_attn_out is after it) and pre_feedforward_layernorm is the pre-MLP norm, whose output
  post_feedforward_layernorm normalises again (hook_mlp_out is after it; base.PostNormBlock);
- softmax scale query_pre_attn_scalar ** -0.5; alternating sliding-window and global layers, Gemma 3
  with a rope base of its own for the sliding ones (layers/rotary.py);
- soft-capping of attention scores (Gemma 2 only) and of the final logits (base.py).

VaultGemma is Gemma 2 without the post-norms.
"""

from __future__ import annotations

from vlens.config import ModelConfig
from vlens.layers.norm import make_norm
from vlens.models.base import PostNormBlock, ResidualBlock
from vlens.models.llama import CausalLM, SelfAttention, mlp_for


class GemmaDecoderLayer(PostNormBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.input_layernorm = make_norm(cfg)
        self.self_attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = make_norm(cfg)
        self.pre_feedforward_layernorm = make_norm(cfg)
        self.mlp = mlp_for(cfg, layer)
        self.post_feedforward_layernorm = make_norm(cfg)

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.pre_feedforward_layernorm)
    attn_heads = property(lambda self: self.self_attn)


class GemmaForCausalLM(CausalLM):
    layer_class = GemmaDecoderLayer


class VaultGemmaDecoderLayer(ResidualBlock):
    """VaultGemma: Gemma 2's layer without its post-norms, Llama's layer with Gemma's pre-MLP norm's name."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.input_layernorm = make_norm(cfg)
        self.self_attn = SelfAttention(cfg, layer)
        self.pre_feedforward_layernorm = make_norm(cfg)
        self.mlp = mlp_for(cfg, layer)

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.pre_feedforward_layernorm)
    attn_heads = property(lambda self: self.self_attn)


class VaultGemmaForCausalLM(CausalLM):
    layer_class = VaultGemmaDecoderLayer
