"""MPT (MosaicML's MPT-7B and MPT-30B, their instruct and chat models): GPT-2's sequential layer under MPT's names
(norm_1, attn.Wqkv, attn.out_proj, norm_2, ffn.up_proj, ffn.down_proj) with no position embedding: ALiBi adds each
head's slope times the key's position (MPT's slopes: layers/attention.Alibi), on the written-out attention, as BLOOM's.
LayerNorms without biases, no biases on any projection, an exact GELU, q, k and v clamped where clip_qkv says."""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.layers.linear import FusedLinear, RowLinear
from vlens.layers.mlp import DenseMLP
from vlens.layers.norm import make_norm
from vlens.layers.vocab import LMHead, VocabEmbedding
from vlens.models.base import AttentionHeads, DecoderLM, ResidualBlock


class MptAttention(AttentionHeads):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        d, h, p = cfg.hidden_size, cfg.num_heads, cfg.parallel
        parts = {"q": d, "k": d, "v": d}
        self.Wqkv = FusedLinear(d, parts, False, True, None, p, dict.fromkeys(parts, h))
        self.out_proj = RowLinear(d, d, False, p, units=h)

    qkv = property(lambda self: self.Wqkv)
    out = property(lambda self: self.out_proj)


class MptBlock(ResidualBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.norm_1 = make_norm(cfg)
        self.attn = MptAttention(cfg, layer)
        self.norm_2 = make_norm(cfg)
        self.ffn = DenseMLP(cfg, layer, ("up_proj", "down_proj"))

    ln1 = property(lambda self: self.norm_1)
    ln2 = property(lambda self: self.norm_2)
    attn_heads = property(lambda self: self.attn)
    mlp = property(lambda self: self.ffn)


class MptModel(nn.Module):
    def __init__(self, cfg: ModelConfig, block: type[ResidualBlock]):
        super().__init__()
        self.wte = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        self.blocks = nn.ModuleList(block(cfg, i) for i in range(cfg.num_layers))
        self.norm_f = make_norm(cfg)


class MptForCausalLM(DecoderLM):
    """(DBRX's model too, its own layers in the same names: `block`)"""

    block: type[ResidualBlock] = MptBlock

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.transformer = MptModel(cfg, self.block)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel)

    embed_tokens = property(lambda self: self.transformer.wte)
    layers = property(lambda self: self.transformer.blocks)
    final_norm = property(lambda self: self.transformer.norm_f)
