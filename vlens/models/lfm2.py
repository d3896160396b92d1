"""LFM2 (Liquid): Llama's layer (its attention's output projection named out_proj, its q/k norms q_layernorm and
k_layernorm, its MLP's projections w1, w3, w2) on a few layers, and on the others (`conv_layers`) a gated short
convolution in place of attention (vlens.layers.short_conv), whose last inputs per sequence the runner keeps in
state slots; its final norm is named embedding_norm. LFM2-MoE: routed experts, scored by sigmoids, on its later
layers' MLPs. LFM3: Qwen3's attention names with a gate a head, windows on some layers, each layer kind its rope, and
each sublayer's output normed before the add."""

from __future__ import annotations

import torch

from vlens.config import ModelConfig
from vlens.context import tap
from vlens.layers.mlp import GatedMLP
from vlens.layers.moe import SparseMoE
from vlens.layers.norm import make_norm
from vlens.layers.short_conv import GatedShortConv
from vlens.models.base import MixerBlock, PostNormBlock, ResidualBlock, Rope
from vlens.models.llama import (
    MOE_CHECKPOINT_NAMES,
    CausalLM,
    DecoderModel,
    OutProjAttention,
    OwnGateAttention,
    SelfAttention,
)


class Lfm2Attention(OutProjAttention):
    head_norms = ("q_layernorm", "k_layernorm")


class Lfm2DecoderLayer(MixerBlock):
    mixer_name = "conv"
    attention: type[SelfAttention] = Lfm2Attention

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.operator_norm = make_norm(cfg)
        self.add_mixer(cfg, layer, self.attention, GatedShortConv)
        self.ffn_norm = make_norm(cfg)
        if cfg.is_moe_layer(layer):  # (LFM2-MoE)
            self.feed_forward = SparseMoE(cfg, layer, *MOE_CHECKPOINT_NAMES[cfg.architecture])
        else:
            hook = f"blocks.{layer}.mlp.hook_post"
            self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, False, hook,
                                         parallel=cfg.parallel, names=("w1", "w3", "w2"))  # fmt: skip

    ln1 = property(lambda self: self.operator_norm)
    ln2 = property(lambda self: self.ffn_norm)
    mlp = property(lambda self: self.feed_forward)


class Lfm2Model(DecoderModel):
    norm_name = "embedding_norm"


class Lfm2ForCausalLM(CausalLM):
    layer_class = Lfm2DecoderLayer
    model_class = Lfm2Model


class Lfm3DecoderLayer(MixerBlock, PostNormBlock):
    """LFM3: LFM2's layer (Qwen3's attention names, a gate a head, `gate_proj`; or its short convolution) with each
    sublayer's output normed before the add (post_operator_norm, post_ffn_norm: Gemma's sandwich)."""

    mixer_name = "conv"

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.operator_norm = make_norm(cfg)
        self.add_mixer(cfg, layer, OwnGateAttention, GatedShortConv)
        self.post_operator_norm = make_norm(cfg)
        self.ffn_norm = make_norm(cfg)
        hook = f"blocks.{layer}.mlp.hook_post"
        self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, False, hook,
                                     parallel=cfg.parallel, names=("w1", "w3", "w2"))  # fmt: skip
        self.post_ffn_norm = make_norm(cfg)

    ln1 = property(lambda self: self.operator_norm)
    ln2 = property(lambda self: self.ffn_norm)
    mlp = property(lambda self: self.feed_forward)
    attn_post_norm = property(lambda self: self.post_operator_norm)
    mlp_post_norm = property(lambda self: self.post_ffn_norm)

    def attn_out(self, h: torch.Tensor | tuple[torch.Tensor, ...], rope: Rope) -> torch.Tensor:
        """The mixer's output (attention's or the convolution's), through its post-norm."""
        raw = MixerBlock.attn_out(self, h, rope)
        return self.attn_post_norm(tap(self.hook_attn_raw, raw), self.hook_attn_norm)


class Lfm3PlainLayer(Lfm2DecoderLayer):
    """LFM3's layer without its sandwich norms (use_sandwich_norm False): LFM2's with LFM3's attention."""

    attention = OwnGateAttention


def lfm3_layer(cfg: ModelConfig, layer: int) -> ResidualBlock:
    """LFM3's layer: with its sandwich norms (use_sandwich_norm) or without."""
    return (Lfm3DecoderLayer if cfg.post_norms else Lfm3PlainLayer)(cfg, layer)


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    layer_class = staticmethod(lfm3_layer)
