"""Bamba (IBM) and Jamba (AI21): Llama's layer (its norms input_layernorm and pre_ff_layernorm, its MLP
feed_forward, its final norm final_layernorm; Bamba's heads half-rotary, Jamba's without positions) on the attention
layers, and on the others (`ssm_layers`) a Mamba mixer in place of attention, whose states per sequence the runner
keeps in state slots: Bamba's a Mamba 2 mixer (vlens.layers.mamba2), Jamba's Mamba's selective scan with normed time
steps, B and C (vlens.layers.mamba1). Jamba's MLP is routed experts on every other layer (the top k of the router's
softmax, not renormalised)."""

from __future__ import annotations

from vlens.config import ModelConfig
from vlens.layers.mamba1 import MambaMixer
from vlens.layers.mamba2 import Mamba2Mixer
from vlens.layers.mlp import GatedMLP
from vlens.layers.moe import SparseMoE
from vlens.layers.norm import make_norm
from vlens.models.base import MixerBlock
from vlens.models.llama import CausalLM, DecoderModel, SelfAttention


class BambaDecoderLayer(MixerBlock):
    mixer_name = "mamba"

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.input_layernorm = make_norm(cfg)
        self.add_mixer(cfg, layer, SelfAttention, MambaMixer if cfg.ssm_dt_rank else Mamba2Mixer)
        self.pre_ff_layernorm = make_norm(cfg)
        if cfg.is_moe_layer(layer):  # (Jamba's: its router `router`)
            self.feed_forward = SparseMoE(cfg, layer, ("feed_forward", "router"), ("gate_proj", "up_proj", "down_proj"))
        else:
            hook = f"blocks.{layer}.mlp.hook_post"
            self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias, hook,
                                         parallel=cfg.parallel)  # fmt: skip

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.pre_ff_layernorm)
    mlp = property(lambda self: self.feed_forward)


class BambaModel(DecoderModel):
    norm_name = "final_layernorm"


class BambaForCausalLM(CausalLM):
    layer_class = BambaDecoderLayer
    model_class = BambaModel
