"""GPT-NeoX / Pythia: LayerNorm, partial rotary (the first rotary_pct of each head rotates), a plain GELU
MLP, and by default the parallel residual x + attn(ln1(x)) + mlp(ln2(x)).

Under the parallel residual no tensor is "the residual after the attention add" — the MLP reads
ln2(x) of the layer input — so this family has no hook_resid_mid (vlens.capture.names.layer_hooks); with
use_parallel_residual=False it is sequential like GPT-2 and has one. The checkpoint's fused
query_key_value interleaves q, k, v per head; it is reordered to [q | k | v] at load."""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.layers.checkpoint import Transform
from vlens.layers.linear import FusedLinear, RowLinear
from vlens.layers.mlp import DenseMLP
from vlens.layers.norm import make_norm
from vlens.layers.vocab import LMHead, VocabEmbedding
from vlens.models.base import AttentionHeads, DecoderLM, ResidualBlock


def deinterleave_heads(heads: int, kv_heads: int | None = None) -> Transform:
    """Rows grouped by key-value head, [g0: its query heads, k, v; g1: ...] -> [q: h0 h1 ..., k: ..., v: ...] (weight
    or bias): NeoX's [h0: q k v, h1: q k v, ...] where every query head has its own (`kv_heads` None), Falcon's
    groups where they share one."""
    groups = kv_heads or heads
    per = heads // groups  # (query heads a group)

    def transform(t: torch.Tensor) -> torch.Tensor:
        g = t.reshape(groups, per + 2, -1, *t.shape[1:])
        return torch.cat([g[:, :per].flatten(0, 2), g[:, per].flatten(0, 1), g[:, per + 1].flatten(0, 1)])

    return transform


class GPTNeoXAttention(AttentionHeads):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        d = cfg.hidden_size
        order = deinterleave_heads(cfg.num_heads)
        transforms = {"weight": order, "bias": order}
        parts, h, p = {"q": d, "k": d, "v": d}, cfg.num_heads, cfg.parallel
        self.query_key_value = FusedLinear(d, parts, cfg.qkv_bias, True, transforms, p, dict.fromkeys(parts, h))
        self.dense = RowLinear(d, d, cfg.o_bias, p, units=h)

    qkv = property(lambda self: self.query_key_value)
    out = property(lambda self: self.dense)


class GPTNeoXLayer(ResidualBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.parallel = cfg.parallel_residual  # shadows ResidualBlock.parallel
        self.input_layernorm = make_norm(cfg)
        self.post_attention_layernorm = make_norm(cfg)
        self.attention = GPTNeoXAttention(cfg, layer)
        self.mlp = DenseMLP(cfg, layer, ("dense_h_to_4h", "dense_4h_to_h"))

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.post_attention_layernorm)
    attn_heads = property(lambda self: self.attention)


class GPTNeoXModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_in = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        self.layers = nn.ModuleList(GPTNeoXLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_layer_norm = make_norm(cfg)


class GPTNeoXForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.gpt_neox = GPTNeoXModel(cfg)
        self.embed_out = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel)

    embed_tokens = property(lambda self: self.gpt_neox.embed_in)
    layers = property(lambda self: self.gpt_neox.layers)
    final_norm = property(lambda self: self.gpt_neox.final_layer_norm)
    lm_head = property(lambda self: self.embed_out)  # HF's name for the unembedding here
