"""DBRX (Databricks' DBRX Base and Instruct): Llama's pre-norm layer under DBRX's names — `norm_attn_norm` holds the
attention's norm (`norm_1`), the attention (`attn.Wqkv`: q, k and v as one projection, clamped where clip_qkv says;
`attn.out_proj`) and the MLP's norm (`norm_2`), both LayerNorms without biases — and routed experts on every layer
(`ffn`): the softmax over every expert of the router's logits (`ffn.router.layer`, in the model's dtype), its top k
divided by their p-norm (`moe_normalize_expert_weights`), the experts' three projections stored as one tensor each
across all experts (`ffn.experts.mlp.w1`, `v1`, `w2`: [experts x width, d])."""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.layers.checkpoint import Slot
from vlens.layers.linear import FusedLinear, RowLinear
from vlens.layers.moe import Experts, SparseMoE
from vlens.layers.norm import make_norm
from vlens.models.base import AttentionHeads, ResidualBlock
from vlens.models.mpt import MptForCausalLM


class DbrxAttention(AttentionHeads):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        d, kv, p = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.parallel
        parts = {"q": d, "k": kv, "v": kv}
        heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads, "v": cfg.num_kv_heads}
        self.Wqkv = FusedLinear(d, parts, False, True, None, p, heads)
        self.out_proj = RowLinear(d, d, False, p, units=cfg.num_heads)

    qkv = property(lambda self: self.Wqkv)
    out = property(lambda self: self.out_proj)


class DbrxExperts(Experts):
    """The experts' projections as DBRX stores them: w1 (gate) and v1 (up) [experts x width, d], w2 (down) the same
    shape, each expert's rows its width's transposed down projection."""

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        experts, n, columns = self.gate_up_proj.shape[0], self.columns.stop - self.columns.start, self.columns

        def rows(w: torch.Tensor) -> torch.Tensor:  # [experts x width, d] -> this rank's [experts, n, d]
            return w.view(experts, self.intermediate, -1)[:, columns]

        return {f"{path}.mlp.w1": Slot(self.gate_up_proj, (slice(None), slice(0, n)), rows),
                f"{path}.mlp.v1": Slot(self.gate_up_proj, (slice(None), slice(n, 2 * n)), rows),
                f"{path}.mlp.w2": Slot(self.down_proj, None, lambda w: rows(w).transpose(1, 2))}  # fmt: skip


class DbrxFFN(SparseMoE):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer, ("ffn", "router.layer"), None)
        self.experts = DbrxExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act, None,
                                   cfg.parallel)  # fmt: skip


class NormAttentionNorm(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.norm_1 = make_norm(cfg)
        self.attn = DbrxAttention(cfg, layer)
        self.norm_2 = make_norm(cfg)


class DbrxBlock(ResidualBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.norm_attn_norm = NormAttentionNorm(cfg, layer)
        self.ffn = DbrxFFN(cfg, layer)

    ln1 = property(lambda self: self.norm_attn_norm.norm_1)
    ln2 = property(lambda self: self.norm_attn_norm.norm_2)
    attn_heads = property(lambda self: self.norm_attn_norm.attn)
    mlp = property(lambda self: self.ffn)


class DbrxForCausalLM(MptForCausalLM):
    block = DbrxBlock
