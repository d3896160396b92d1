"""BLOOM (560M to 176B; and its fine-tunes, BLOOMZ): GPT-NeoX's attention modules (q, k and v fused and interleaved
per head, which the load reorders) in a sequential layer, a LayerNorm right after the embedding (hook_embed is after
it, as TransformerLens's, and so HF's first hidden state; the row before it is W_E's), a GELU of its own, and no
position embedding:
ALiBi adds each head's slope times the key's position to its scores (layers/attention.Attention.alibi_bias), which
vlens computes on its written-out attention path, as HF's eager attention does."""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.context import ForwardContext, tap
from vlens.layers.mlp import DenseMLP
from vlens.layers.norm import make_norm
from vlens.layers.vocab import LMHead, VocabEmbedding
from vlens.models.base import DecoderLM, ResidualBlock
from vlens.models.gpt_neox import GPTNeoXAttention


class BloomBlock(ResidualBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.input_layernorm = make_norm(cfg)
        self.self_attention = GPTNeoXAttention(cfg, layer)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = DenseMLP(cfg, layer, ("dense_h_to_4h", "dense_4h_to_h"))

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.post_attention_layernorm)
    attn_heads = property(lambda self: self.self_attention)


class BloomModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        self.word_embeddings_layernorm = make_norm(cfg)
        self.h = nn.ModuleList(BloomBlock(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = make_norm(cfg)


class BloomForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.transformer = BloomModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel)

    embed_tokens = property(lambda self: self.transformer.word_embeddings)
    layers = property(lambda self: self.transformer.h)
    final_norm = property(lambda self: self.transformer.ln_f)

    def embed(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.transformer.word_embeddings_layernorm(self.embed_tokens(input_ids))
        return tap("hook_embed", x)
