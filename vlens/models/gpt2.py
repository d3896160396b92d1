"""GPT-2: learned position embeddings (hook_pos_embed), LayerNorm with bias, a plain GELU MLP, and
HF's Conv1D layout: weights stored [in, out], q/k/v fused in one c_attn. The transposes happen once
at load (layers/linear.py), so the forward is ordinary nn.Linear work."""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.context import ForwardContext, tap
from vlens.layers.linear import ColumnLinear, FusedLinear, RowLinear
from vlens.layers.mlp import activation
from vlens.layers.norm import make_norm
from vlens.layers.vocab import LMHead, VocabEmbedding
from vlens.models.base import AttentionHeads, DecoderLM, ResidualBlock

CONV1D = {"weight": torch.Tensor.t}  # Conv1D keeps weight as [in, out]; nn.Linear as [out, in]


class GPT2Attention(AttentionHeads):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        d = cfg.hidden_size
        parts, h, p = {"q": d, "k": d, "v": d}, cfg.num_heads, cfg.parallel
        units = dict.fromkeys(parts, h)
        self.c_attn = FusedLinear(d, parts, cfg.qkv_bias, True, CONV1D, p, units)
        self.c_proj = RowLinear(d, d, cfg.o_bias, p, units=h, transforms=CONV1D)

    qkv = property(lambda self: self.c_attn)
    out = property(lambda self: self.c_proj)


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        sizes, p = (cfg.hidden_size, cfg.intermediate_size), cfg.parallel
        self.c_fc = ColumnLinear(*sizes, cfg.mlp_bias, p, transforms=CONV1D)
        self.c_proj = RowLinear(*reversed(sizes), cfg.mlp_bias, p, transforms=CONV1D)
        self.act = activation(cfg.hidden_act)
        self.hook_post = f"blocks.{layer}.mlp.hook_post"

    fc_in = property(lambda self: self.c_fc)  # as GatedMLP names its projections, for vlens.hooked_weights
    fc_out = property(lambda self: self.c_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.c_fc(x))
        h = tap(self.hook_post, h)
        return self.c_proj(h)


class GPT2Block(ResidualBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.ln_1 = make_norm(cfg)
        self.attn = GPT2Attention(cfg, layer)
        self.ln_2 = make_norm(cfg)
        self.mlp = GPT2MLP(cfg, layer)

    ln1 = property(lambda self: self.ln_1)
    ln2 = property(lambda self: self.ln_2)
    attn_heads = property(lambda self: self.attn)


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig, block: type[ResidualBlock]):
        super().__init__()
        self.wte = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(block(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = make_norm(cfg)


class GPT2LMHeadModel(DecoderLM):
    block: type[ResidualBlock] = GPT2Block  # (GPT-Neo: its own layer in GPT-2's model)

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.transformer = GPT2Model(cfg, self.block)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel)

    embed_tokens = property(lambda self: self.transformer.wte)
    layers = property(lambda self: self.transformer.h)
    final_norm = property(lambda self: self.transformer.ln_f)
    position_embeddings = property(lambda self: self.transformer.wpe.weight)  # (TransformerLens's W_pos)

    def embed(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.transformer.wte(input_ids)
        x = tap("hook_embed", x)
        pos = self.transformer.wpe(ctx.positions)
        pos = tap("hook_pos_embed", pos)
        return x + pos
