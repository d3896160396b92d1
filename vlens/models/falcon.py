"""Falcon (TII: 7B, 40B, 180B, Falcon 2 11B, and their instruct models): GPT-NeoX's parallel residual, x + attn(ln(x))
+ mlp(ln(x)), with rotary positions, a GELU MLP and, by default, no biases. Its layouts, as the config says:
the 7B's one LayerNorm for both sublayers and one key-value head (multi_query); the new decoder architecture's
(40B, 180B) grouped key-value heads and a LayerNorm for each sublayer (ln_attn, ln_mlp), or one (Falcon 2 11B,
num_ln_in_parallel_attn=1); and a sequential layer (parallel_attn=False), as GPT-2's. query_key_value holds the
projections grouped by key-value head (each group's query heads, then its key and value), which the load reorders.

TransformerLens's ln2 is ln1 where the layer has one norm (ResidualBlock.shared_norm), and under the parallel residual
there is no hook_resid_mid (vlens.capture.names.layer_hooks)."""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.layers.linear import FusedLinear, RowLinear
from vlens.layers.mlp import DenseMLP
from vlens.layers.norm import make_norm
from vlens.layers.vocab import LMHead, VocabEmbedding
from vlens.models.base import AttentionHeads, DecoderLM, ResidualBlock
from vlens.models.gpt_neox import deinterleave_heads


class FalconAttention(AttentionHeads):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        h, kv, d, p = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.parallel
        order = deinterleave_heads(h, kv)
        parts, units = {"q": h * d, "k": kv * d, "v": kv * d}, {"q": h, "k": kv, "v": kv}
        self.query_key_value = FusedLinear(cfg.hidden_size, parts, cfg.qkv_bias, True, {"weight": order, "bias": order},
                                           p, units)  # fmt: skip
        self.dense = RowLinear(h * d, cfg.hidden_size, cfg.o_bias, p, units=h)

    qkv = property(lambda self: self.query_key_value)
    out = property(lambda self: self.dense)


class FalconDecoderLayer(ResidualBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.parallel, self.shared_norm = cfg.parallel_residual, cfg.shared_norm  # (shadow ResidualBlock's)
        self.self_attention = FalconAttention(cfg, layer)
        self.mlp = DenseMLP(cfg, layer, ("dense_h_to_4h", "dense_4h_to_h"))
        if self.parallel and not self.shared_norm:  # (the new decoder architecture's two)
            self.norm_names = ("ln_attn", "ln_mlp")
        else:
            self.norm_names = ("input_layernorm", "input_layernorm" if self.parallel else "post_attention_layernorm")
        for name in dict.fromkeys(self.norm_names):
            setattr(self, name, make_norm(cfg))

    ln1 = property(lambda self: self._modules[self.norm_names[0]])
    ln2 = property(lambda self: self._modules[self.norm_names[1]])
    attn_heads = property(lambda self: self.self_attention)


class FalconModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        self.h = nn.ModuleList(FalconDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = make_norm(cfg)


class FalconForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.transformer = FalconModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel)

    embed_tokens = property(lambda self: self.transformer.word_embeddings)
    layers = property(lambda self: self.transformer.h)
    final_norm = property(lambda self: self.transformer.ln_f)
