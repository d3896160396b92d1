"""GPTBigCode (SantaCoder, StarCoder 1 and StarCoderBase, and their fine-tunes: WizardCoder, OctoCoder): GPT-2's model
(learned positions, LayerNorms with biases, a tanh-GELU MLP, a tied unembedding) in nn.Linear's layout, with one
key and value head for all the query heads (multi_query, the released models), kept as one head in the cache.
c_attn projects [q | k | v] where attention is multi-query, else q, k and v interleaved per head (GPT-NeoX's
layout), which the load reorders."""

from __future__ import annotations

from vlens.config import ModelConfig
from vlens.layers.linear import FusedLinear, RowLinear
from vlens.layers.mlp import DenseMLP
from vlens.layers.norm import make_norm
from vlens.models.base import AttentionHeads, ResidualBlock
from vlens.models.gpt2 import GPT2LMHeadModel
from vlens.models.gpt_neox import deinterleave_heads


class GPTBigCodeAttention(AttentionHeads):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        d, h, kv, p = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.parallel
        order = deinterleave_heads(h, kv)  # (multi-query: one group, [q | k | v] as stored)
        transforms = {"weight": order, "bias": order}
        parts, units = {"q": d, "k": kv * cfg.head_dim, "v": kv * cfg.head_dim}, {"q": h, "k": kv, "v": kv}
        self.c_attn = FusedLinear(d, parts, cfg.qkv_bias, True, transforms, p, units)
        self.c_proj = RowLinear(d, d, cfg.o_bias, p, units=h)

    qkv = property(lambda self: self.c_attn)
    out = property(lambda self: self.c_proj)


class GPTBigCodeBlock(ResidualBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.ln_1 = make_norm(cfg)
        self.attn = GPTBigCodeAttention(cfg, layer)
        self.ln_2 = make_norm(cfg)
        self.mlp = DenseMLP(cfg, layer, ("c_fc", "c_proj"))

    ln1 = property(lambda self: self.ln_1)
    ln2 = property(lambda self: self.ln_2)
    attn_heads = property(lambda self: self.attn)


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    block = GPTBigCodeBlock
