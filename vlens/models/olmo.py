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

OLMo Hybrid puts OLMo 3's attention layers (without windows) among Llama-style layers (pre-norms alone) whose token
mixer is a gated delta net (layers/gated_delta.py): ModelConfig.post_norm_layers says which layer is which.
"""

from __future__ import annotations

from vlens.config import ModelConfig
from vlens.layers.gated_delta import OlmoHybridGatedDeltaNet
from vlens.layers.norm import make_norm
from vlens.models.base import MixerBlock, PostNormBlock, ResidualBlock
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


class OlmoHybridLinearLayer(MixerBlock):
    """OLMo Hybrid's linear-attention layer: Llama's layer (pre-norms alone, OLMo's norms, under its checkpoints' names)
    with a gated delta net."""

    mixer_name = "linear_attn"

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.attention_layer_norm = make_norm(cfg)
        self.add_mixer(cfg, layer, SelfAttention, OlmoHybridGatedDeltaNet)
        self.feedforward_layer_norm = make_norm(cfg)
        self.mlp = mlp_for(cfg, layer)

    ln1 = property(lambda self: self.attention_layer_norm)
    ln2 = property(lambda self: self.feedforward_layer_norm)


class OlmoHybridAttentionLayer(PostNormBlock):
    """OLMo Hybrid's attention layer: OLMo 3's, its post-attention norm stored as feedforward_layer_norm."""

    pre_norms = False

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.self_attn = SelfAttention(cfg, layer)
        self.feedforward_layer_norm = make_norm(cfg)
        self.mlp = mlp_for(cfg, layer)
        self.post_feedforward_layernorm = make_norm(cfg)

    attn_heads = property(lambda self: self.self_attn)
    attn_post_norm = property(lambda self: self.feedforward_layer_norm)


def olmo_hybrid_layer(cfg: ModelConfig, layer: int) -> ResidualBlock:
    """OLMo Hybrid's layer `layer`: OLMo 3's (post-norms alone) where it attends, else a linear-attention one."""
    return (OlmoHybridLinearLayer if cfg.is_linear_layer(layer) else OlmoHybridAttentionLayer)(cfg, layer)


class OlmoHybridForCausalLM(CausalLM):
    layer_class = staticmethod(olmo_hybrid_layer)  # (a layer of either kind, as the config lists them)
