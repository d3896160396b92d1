"""Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's quirks, every one of which changes the
activations if missed:

- embeddings times sqrt(hidden_size), the factor rounded to the model dtype first (hook_embed is after it);
- RMSNorm scaling by (1 + w) in float32 (layers/norm.py), also for Gemma 3's q/k norm;
- sandwich norms: post_attention_layernorm is applied to the attention output *before* the residual
  add (so hook_attn_out is after it) and pre_feedforward_layernorm is the pre-MLP norm, whose output
  post_feedforward_layernorm normalises again (hook_mlp_out is after it);
- softmax scale query_pre_attn_scalar ** -0.5; alternating sliding-window and global layers, Gemma 3
  with a rope base of its own for the sliding ones (layers/rotary.py);
- soft-capping of attention scores (Gemma 2 only) and of the final logits (base.py).
"""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.context import tap
from vlens.layers.mlp import GatedMLP
from vlens.layers.norm import NormHooks, make_norm
from vlens.layers.vocab import LMHead, VocabEmbedding
from vlens.models.base import DecoderLM, ResidualBlock, Rope
from vlens.models.llama import SelfAttention


class GemmaDecoderLayer(ResidualBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        p = f"blocks.{layer}."  # (the post-norms' taps as TransformerLens names them; their outputs are the layer's
        # hook_attn_out and hook_mlp_out)
        self.hook_ln1_post = NormHooks(p + "ln1_post.hook_scale", p + "ln1_post.hook_normalized")
        self.hook_ln2_post = NormHooks(p + "ln2_post.hook_scale", p + "ln2_post.hook_normalized")
        self.hook_attn_raw, self.hook_mlp_raw = p + "attn.hook_out", p + "mlp.hook_out"  # (before their post-norms)
        self.input_layernorm = make_norm(cfg)
        self.self_attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = make_norm(cfg)
        self.pre_feedforward_layernorm = make_norm(cfg)
        hook_post = f"blocks.{layer}.mlp.hook_post"
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, False, hook_post, parallel=cfg.parallel)
        self.post_feedforward_layernorm = make_norm(cfg)

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.pre_feedforward_layernorm)
    attn_heads = property(lambda self: self.self_attn)

    def attn_out(self, h: torch.Tensor, rope: Rope) -> torch.Tensor:
        # (the sandwich norm: inside the tap)
        return self.post_attention_layernorm(tap(self.hook_attn_raw, self.self_attn(h, rope)), self.hook_ln1_post)

    def mlp_out(self, h: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm(tap(self.hook_mlp_raw, self.mlp(h)), self.hook_ln2_post)


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg)


class GemmaForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.model = GemmaModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel)

    embed_tokens = property(lambda self: self.model.embed_tokens)
    layers = property(lambda self: self.model.layers)
    final_norm = property(lambda self: self.model.norm)
