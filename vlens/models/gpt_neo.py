"""GPT-Neo (125M-2.7B, and the TinyStories models): GPT-2's model (learned positions, LayerNorms with biases, a
GELU MLP, a tied unembedding) with a layer of its own: q, k and v projected apart with no bias (out_proj has one),
scores not scaled (no 1/sqrt(d_head): HF's and TransformerLens's scale is 1), and, on the layers
`attention_types` marks local (every other one in the released models), a window: a query sees the
`window_size` keys up to itself. HF keeps the attention one module deeper than GPT-2 (`attn.attention`)."""

from __future__ import annotations

from torch import nn

from vlens.config import ModelConfig
from vlens.layers.linear import FusedLinear, RowLinear
from vlens.layers.mlp import DenseMLP
from vlens.layers.norm import make_norm
from vlens.models.base import AttentionHeads, ResidualBlock
from vlens.models.gpt2 import GPT2LMHeadModel


class GPTNeoSelfAttention(AttentionHeads):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        d, h, p, names = cfg.hidden_size, cfg.num_heads, cfg.parallel, ("q_proj", "k_proj", "v_proj")
        self.qkv_proj = FusedLinear(d, dict.fromkeys(names, d), cfg.qkv_bias, parallel=p, units=dict.fromkeys(names, h))
        self.out_proj = RowLinear(d, d, cfg.o_bias, p, units=h)

    qkv = property(lambda self: self.qkv_proj)
    out = property(lambda self: self.out_proj)


class GPTNeoAttention(nn.Module):
    """HF's wrapper around the attention of either kind (its checkpoints name the weights attn.attention.*)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attention = GPTNeoSelfAttention(cfg, layer)


class GPTNeoBlock(ResidualBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.ln_1 = make_norm(cfg)
        self.attn = GPTNeoAttention(cfg, layer)
        self.ln_2 = make_norm(cfg)
        self.mlp = DenseMLP(cfg, layer, ("c_fc", "c_proj"))

    ln1 = property(lambda self: self.ln_1)
    ln2 = property(lambda self: self.ln_2)
    attn_heads = property(lambda self: self.attn.attention)


class GPTNeoForCausalLM(GPT2LMHeadModel):
    block = GPTNeoBlock
