"""GPT-J: Phi's layer under other names — GPT-NeoX's parallel residual with one LayerNorm for both sublayers,
x + attn(ln_1(x)) + mlp(ln_1(x)) — with rotary by pairs (dims 2i and 2i + 1) over the leading rotary_dim dims
of each head, no attention biases (q_proj, k_proj, v_proj, out_proj), a plain GELU MLP with biases (fc_in, fc_out)
and a biased unembedding.

As for Phi, TransformerLens ties ln2 to ln1: `ln2`'s taps read the one norm again (ResidualBlock.shared_norm).
"""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.layers.mlp import DenseMLP
from vlens.layers.norm import make_norm
from vlens.layers.vocab import LMHead, VocabEmbedding
from vlens.models.base import DecoderLM, ResidualBlock
from vlens.models.llama import OutProjAttention


class GPTJBlock(ResidualBlock):
    parallel = shared_norm = True

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.ln_1 = make_norm(cfg)
        self.attn = OutProjAttention(cfg, layer)
        self.mlp = DenseMLP(cfg, layer, ("fc_in", "fc_out"))

    ln1 = property(lambda self: self.ln_1)
    ln2 = property(lambda self: self.ln_1)  # (one norm for both sublayers)
    attn_heads = property(lambda self: self.attn)


class GPTJModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        self.h = nn.ModuleList(GPTJBlock(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = make_norm(cfg)


class GPTJForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.transformer = GPTJModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel, bias=True)

    embed_tokens = property(lambda self: self.transformer.wte)
    layers = property(lambda self: self.transformer.h)
    final_norm = property(lambda self: self.transformer.ln_f)
