"""AFMoE (Arcee's Trinity Nano, Mini and Large): Gemma's sandwich norms (each sublayer's output normed before the add;
OLMo 2's norms, scaled in float32) under AFMoE's names, attention with q/k norms head by head and an output gate of its
own projection (gate_proj: z times sigmoid(gate), as Qwen 3.5's gate from q_proj), rotary on its sliding-window layers
alone, and DeepSeek's experts after dense layers: each token's top k by the float32 sigmoid of the router's logits (the
router in the model's dtype) plus a bias per expert, renormalised and scaled, beside shared ones (DeepseekMoE)."""

from __future__ import annotations

import torch

from vlens.config import ModelConfig
from vlens.layers.linear import ColumnLinear
from vlens.layers.norm import make_norm
from vlens.models.base import PostNormBlock, Rope
from vlens.models.llama import CausalLM, SelfAttention, mlp_for


class AfmoeAttention(SelfAttention):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.gate_proj = ColumnLinear(cfg.hidden_size, cfg.num_heads * self.head_dim, False, cfg.parallel,
                                      units=cfg.num_heads)  # fmt: skip

    def project(
        self, x: torch.Tensor | tuple[torch.Tensor, ...], rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """q, k, v as Llama's; the gate [T, H, d] from the layer's input (where q, k and v read their own,
        TransformerLens's split inputs, q's: each head's gate from its own)."""
        q, k, v, _ = super().project(x, rope)
        source = x if isinstance(x, torch.Tensor) else x[0]
        if source.dim() == 2:
            gate = self.gate_proj(source)
        else:
            w = self.gate_proj.weight.view(self.heads, self.head_dim, source.shape[-1])
            gate = torch.einsum("thm,hdm->thd", source, w)
        return q, k, v, gate.reshape(-1, self.heads, self.head_dim)


class AfmoeDecoderLayer(PostNormBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.input_layernorm = make_norm(cfg)
        self.self_attn = AfmoeAttention(cfg, layer)
        self.post_attention_layernorm = make_norm(cfg)
        self.pre_mlp_layernorm = make_norm(cfg)
        self.mlp = mlp_for(cfg, layer)
        self.post_mlp_layernorm = make_norm(cfg)

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.pre_mlp_layernorm)
    attn_heads = property(lambda self: self.self_attn)
    mlp_post_norm = property(lambda self: self.post_mlp_layernorm)


class AfmoeForCausalLM(CausalLM):
    layer_class = AfmoeDecoderLayer
