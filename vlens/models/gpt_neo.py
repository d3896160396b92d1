"""GPT-Neo (125M-2.7B, and the TinyStories models): GPT-2's model (learned positions, LayerNorms with biases, a
GELU MLP, a tied unembedding) with a layer of its own: q, k and v projected apart with no bias (out_proj has one),
scores not scaled (no 1/sqrt(d_head): HF's and TransformerLens's scale is 1), and, on the layers
`attention_types` marks local (every other one in the released models), a window: a query sees the
`window_size` keys up to itself. HF keeps the attention one module deeper than GPT-2 (`attn.attention`)."""

from __future__ import annotations

from torch import nn

from vlens.config import ModelConfig
from vlens.layers.mlp import DenseMLP
from vlens.layers.norm import make_norm
from vlens.models.base import ResidualBlock
from vlens.models.gpt2 import GPT2LMHeadModel
from vlens.models.llama import OutProjAttention


class GPTNeoAttention(nn.Module):
    """HF's wrapper around the attention of either kind (its checkpoints name the weights attn.attention.*)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attention = OutProjAttention(cfg, layer)


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
