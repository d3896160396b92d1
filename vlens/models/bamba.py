"""Bamba (IBM): Llama's layer (half-rotary heads; its norms input_layernorm and pre_ff_layernorm, its MLP
feed_forward, its final norm final_layernorm) on the layers `attn_layer_indices` names, and on the others
(`ssm_layers`) a Mamba 2 mixer in place of attention (vlens.layers.mamba2), whose SSM states per sequence the runner
keeps in state slots."""

from __future__ import annotations

from vlens.config import ModelConfig
from vlens.layers.mamba2 import Mamba2Mixer
from vlens.layers.mlp import GatedMLP
from vlens.layers.norm import make_norm
from vlens.models.base import MixerBlock
from vlens.models.llama import CausalLM, DecoderModel, SelfAttention


class BambaDecoderLayer(MixerBlock):
    mixer_name = "mamba"

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.input_layernorm = make_norm(cfg)
        self.add_mixer(cfg, layer, SelfAttention, Mamba2Mixer)
        self.pre_ff_layernorm = make_norm(cfg)
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
