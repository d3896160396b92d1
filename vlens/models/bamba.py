"""Bamba (IBM), Jamba (AI21) and Falcon-H1 (TII): Llama's layer (its norms input_layernorm and pre_ff_layernorm, its MLP
feed_forward, its final norm final_layernorm; Bamba's heads half-rotary, Jamba's without positions) on the attention
layers, and on the others (`ssm_layers`) a Mamba mixer in place of attention, whose states per sequence the runner
keeps in state slots: Bamba's a Mamba 2 mixer (vlens.layers.mamba2), Jamba's Mamba's selective scan with normed time
steps, B and C (vlens.layers.mamba1). Jamba's MLP is routed experts on every other layer (the top k of the router's
softmax, not renormalised). Falcon-H1's layer has both side by side (FalconH1DecoderLayer)."""

from __future__ import annotations

import torch

from vlens.config import ModelConfig
from vlens.context import tap
from vlens.layers.mamba1 import MambaMixer
from vlens.layers.mamba2 import Mamba2Mixer
from vlens.layers.mlp import GatedMLP
from vlens.layers.moe import SparseMoE
from vlens.layers.norm import make_norm
from vlens.models.base import MixerBlock, ResidualBlock, Rope
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


class FalconH1DecoderLayer(ResidualBlock):
    """Falcon-H1's layer: Bamba's, with attention and a Mamba 2 mixer side by side on the normed input (each read
    times its input multiplier), their outputs (each times its own) summed: mamba.hook_out and attn.hook_out are the
    modules' outputs, hook_attn_out the sum. The MLP's gate and output have multipliers of their own."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.input_layernorm = make_norm(cfg)
        self.mamba = Mamba2Mixer(cfg, layer)
        self.self_attn = SelfAttention(cfg, layer)
        self.pre_ff_layernorm = make_norm(cfg)
        self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias,
                                     f"blocks.{layer}.mlp.hook_post", parallel=cfg.parallel,
                                     multipliers=cfg.mlp_multipliers)  # fmt: skip
        self.multipliers = cfg.mixer_multipliers
        self.hook_mamba_out, self.hook_attn_raw = f"blocks.{layer}.mamba.hook_out", f"blocks.{layer}.attn.hook_out"

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.pre_ff_layernorm)
    mlp = property(lambda self: self.feed_forward)
    attn_heads = property(lambda self: self.self_attn)

    def mix(self, x: torch.Tensor, h: torch.Tensor, rope: Rope) -> torch.Tensor:
        attn_in, attn_out, ssm_in, ssm_out = self.multipliers
        m = tap(self.hook_mamba_out, self.mamba(h * ssm_in)) * ssm_out
        inputs = self.attention_input(x, h)
        inputs = inputs * attn_in if isinstance(inputs, torch.Tensor) else tuple(v * attn_in for v in inputs)
        return m + tap(self.hook_attn_raw, self.self_attn(inputs, rope)) * attn_out


class BambaModel(DecoderModel):
    norm_name = "final_layernorm"


class BambaForCausalLM(CausalLM):
    layer_class = BambaDecoderLayer
    model_class = BambaModel



class FalconH1ForCausalLM(CausalLM):
    layer_class = FalconH1DecoderLayer
    model_class = BambaModel
