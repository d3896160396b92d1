"""Phi-1, Phi-1.5 and Phi-2: GPT-NeoX's parallel residual with one LayerNorm for both sublayers,
x + attn(ln(x)) + mlp(ln(x)), biases on every projection and on the unembedding, partial rotary (the first
partial_rotary_factor of each head rotates) and a plain GELU MLP (fc1, fc2).

TransformerLens's Phi ties ln2 to ln1, so `ln2`'s taps here are the same norm's, computed again only when a tap
asks (ResidualBlock.shared_norm); under the parallel residual there is no hook_resid_mid
(vlens.capture.names.layer_hooks).
"""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.layers.linear import FusedLinear, RowLinear
from vlens.layers.mlp import DenseMLP
from vlens.layers.norm import make_norm
from vlens.layers.vocab import LMHead, VocabEmbedding
from vlens.models.base import AttentionHeads, DecoderLM, ResidualBlock


class PhiAttention(AttentionHeads):
    """q_proj/k_proj/v_proj (fused into qkv_proj) and dense, all with biases."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        h, kv, d, p = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.parallel
        parts, units = {"q_proj": h * d, "k_proj": kv * d, "v_proj": kv * d}, {"q_proj": h, "k_proj": kv, "v_proj": kv}
        self.qkv_proj = FusedLinear(cfg.hidden_size, parts, cfg.qkv_bias, parallel=p, units=units)
        self.dense = RowLinear(h * d, cfg.hidden_size, cfg.o_bias, p, units=h)

    qkv = property(lambda self: self.qkv_proj)
    out = property(lambda self: self.dense)


class PhiDecoderLayer(ResidualBlock):
    parallel = shared_norm = True

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.input_layernorm = make_norm(cfg)
        self.self_attn = PhiAttention(cfg, layer)
        self.mlp = DenseMLP(cfg, layer, ("fc1", "fc2"))

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.input_layernorm)  # (one norm for both sublayers)
    attn_heads = property(lambda self: self.self_attn)


class PhiModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        self.layers = nn.ModuleList(PhiDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_layernorm = make_norm(cfg)


class PhiForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.model = PhiModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel, bias=True)

    embed_tokens = property(lambda self: self.model.embed_tokens)
    layers = property(lambda self: self.model.layers)
    final_norm = property(lambda self: self.model.final_layernorm)
