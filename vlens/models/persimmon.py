"""Persimmon (Adept's Persimmon-8B, and the language model of Fuyu-8B): GPT-NeoX's attention — q, k and v in one
projection with biases, each head's [q k v] rows together, `dense` after — with a LayerNorm over each head's queries
and one over its keys (`q_layernorm`, `k_layernorm`: weights and biases, before rotary), in Llama's sequential
layer of LayerNorms; rotary by halves over the leading `partial_rotary_factor` of each head, an MLP of squared
ReLUs."""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.layers.mlp import DenseMLP
from vlens.layers.norm import make_norm
from vlens.layers.vocab import LMHead, VocabEmbedding
from vlens.models.base import DecoderLM, ResidualBlock
from vlens.models.gpt_neox import GPTNeoXAttention


class PersimmonAttention(GPTNeoXAttention):
    head_norms = ("q_layernorm", "k_layernorm")


class PersimmonDecoderLayer(ResidualBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.input_layernorm = make_norm(cfg)
        self.self_attn = PersimmonAttention(cfg, layer)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = DenseMLP(cfg, layer, ("dense_h_to_4h", "dense_4h_to_h"))

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.post_attention_layernorm)
    attn_heads = property(lambda self: self.self_attn)


class PersimmonModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        self.layers = nn.ModuleList(PersimmonDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_layernorm = make_norm(cfg)


class PersimmonForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.model = PersimmonModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel)

    embed_tokens = property(lambda self: self.model.embed_tokens)
    layers = property(lambda self: self.model.layers)
    final_norm = property(lambda self: self.model.final_layernorm)
