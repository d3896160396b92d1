"""GPT-J: Phi's layer under other names — GPT-NeoX's parallel residual with one LayerNorm for both sublayers,
x + attn(ln_1(x)) + mlp(ln_1(x)) — with rotary by pairs (dims 2i and 2i + 1) over the leading rotary_dim dims
of each head, no attention biases (q_proj, k_proj, v_proj, out_proj), a plain GELU MLP with biases (fc_in, fc_out)
and a biased unembedding. CodeGen (Salesforce's code models, CodeGen 1 and 2) is GPT-J with q, k and v in one
projection, `qkv_proj`, stored in the model-parallel layout it was trained in.

As for Phi, TransformerLens ties ln2 to ln1: `ln2`'s taps read the one norm again (ResidualBlock.shared_norm).
"""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.layers.linear import FusedLinear, RowLinear
from vlens.layers.mlp import DenseMLP
from vlens.layers.norm import make_norm
from vlens.layers.vocab import LMHead, VocabEmbedding
from vlens.models.base import AttentionHeads, DecoderLM, ResidualBlock
from vlens.models.llama import OutProjAttention

CODEGEN_SHARDS = 4  # (HF's mp_num: the model-parallel ranks CodeGen was trained on, which its qkv_proj's rows follow)


def codegen_rows(t: torch.Tensor) -> torch.Tensor:
    """qkv_proj's rows (weight), [shard 0: q, v, k of its quarter of the heads; shard 1: ...] -> [q, k, v]."""
    g = t.reshape(CODEGEN_SHARDS, 3, -1, *t.shape[1:])
    return torch.cat([g[:, 0].flatten(0, 1), g[:, 2].flatten(0, 1), g[:, 1].flatten(0, 1)])


class CodeGenAttention(AttentionHeads):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        d, h, p = cfg.hidden_size, cfg.num_heads, cfg.parallel
        parts = {"q": d, "k": d, "v": d}
        self.qkv_proj = FusedLinear(d, parts, False, True, {"weight": codegen_rows}, p, dict.fromkeys(parts, h))
        self.out_proj = RowLinear(d, d, False, p, units=h)

    qkv = property(lambda self: self.qkv_proj)
    out = property(lambda self: self.out_proj)


class GPTJBlock(ResidualBlock):
    parallel = shared_norm = True
    attention = OutProjAttention

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.ln_1 = make_norm(cfg)
        self.attn = self.attention(cfg, layer)
        self.mlp = DenseMLP(cfg, layer, ("fc_in", "fc_out"))

    ln1 = property(lambda self: self.ln_1)
    ln2 = property(lambda self: self.ln_1)  # (one norm for both sublayers)
    attn_heads = property(lambda self: self.attn)


class CodeGenBlock(GPTJBlock):
    attention = CodeGenAttention


class GPTJModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        block = CodeGenBlock if cfg.family == "codegen" else GPTJBlock
        self.wte = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        self.h = nn.ModuleList(block(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = make_norm(cfg)


class GPTJForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.transformer = GPTJModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel, bias=True)

    embed_tokens = property(lambda self: self.transformer.wte)
    layers = property(lambda self: self.transformer.h)
    final_norm = property(lambda self: self.transformer.ln_f)
