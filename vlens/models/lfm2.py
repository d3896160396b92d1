"""LFM2 (Liquid): Llama's layer (its attention's output projection named out_proj, its q/k norms q_layernorm and
k_layernorm, its MLP's projections w1, w3, w2) on a few layers, and on the others (`conv_layers`) a gated short
convolution in place of attention (vlens.layers.short_conv), whose last inputs per sequence the runner keeps in
state slots; its final norm is named embedding_norm. LFM2-MoE: routed experts, scored by sigmoids, on its later
layers' MLPs."""

from __future__ import annotations

from vlens.config import ModelConfig
from vlens.layers.mlp import GatedMLP
from vlens.layers.moe import SparseMoE
from vlens.layers.norm import make_norm
from vlens.layers.short_conv import GatedShortConv
from vlens.models.base import MixerBlock
from vlens.models.llama import MOE_CHECKPOINT_NAMES, CausalLM, DecoderModel, OutProjAttention


class Lfm2Attention(OutProjAttention):
    head_norms = ("q_layernorm", "k_layernorm")


class Lfm2DecoderLayer(MixerBlock):
    mixer_name = "conv"

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.operator_norm = make_norm(cfg)
        self.add_mixer(cfg, layer, Lfm2Attention, GatedShortConv)
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
