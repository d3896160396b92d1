"""Llama 4 (Scout, Maverick; their text model): Llama's layer under `feed_forward`, which is routed experts beside a
shared expert on the MoE layers and a dense MLP on the others. What sets the attention apart is config flags (rotary
by pairs in float32, weightless q/k norms after it, a temperature on the layers without rotary:
vlens.config._llama4); the experts are `Llama4MoE`.

The router's top k logits go through their sigmoids and each chosen expert reads the token times its weight (its
output is not weighed): TransformerLens's expert weights are those sigmoids, zeros elsewhere. The checkpoints hold all
experts in one tensor per projection, the input dimension first (gate_up_proj [E, d, 2I]: gate, then up).
"""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.layers.checkpoint import Slot
from vlens.layers.mlp import GatedMLP
from vlens.layers.moe import Experts, Routing
from vlens.layers.norm import make_norm
from vlens.models.base import ResidualBlock
from vlens.models.llama import CausalLM, SelfAttention


class Llama4Experts(Experts):
    """Experts stored as Llama 4's checkpoints hold them: one [E, d, 2I] gate_up_proj (gate columns, then up) and
    one [E, I, d] down_proj; each rank loads its intermediate columns."""

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        columns = self.columns

        def gate_up(stored: torch.Tensor) -> torch.Tensor:  # [E, d, 2I] -> [E, 2n, d]: this rank's gate, then up
            gate, up = stored.transpose(1, 2).chunk(2, dim=1)
            return torch.cat([gate[:, columns], up[:, columns]], dim=1)

        down = Slot(self.down_proj, transform=lambda w: w[:, columns].transpose(1, 2))  # [E, I, d] -> [E, d, n]
        return {f"{path}.gate_up_proj": Slot(self.gate_up_proj, transform=gate_up), f"{path}.down_proj": down}


class Llama4MoE(nn.Module):
    """`router` (a linear layer of the model's dtype), `experts`, and `shared_expert`, always on."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        sizes = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act, None, cfg.parallel)
        self.experts = Llama4Experts(*sizes, weigh_inputs=cfg.expert_weights_on_inputs)
        hook = f"blocks.{layer}.mlp.shared_expert.hook_post"
        sizes = (cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act, False, hook)
        self.shared_expert = GatedMLP(*sizes, parallel=cfg.parallel)
        self.routing = Routing(cfg, layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.routing(self.router(x))
        return self.experts(x, ids, weights) + self.shared_expert(x)


class Llama4DecoderLayer(ResidualBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.input_layernorm = make_norm(cfg)
        self.self_attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = make_norm(cfg)
        if cfg.is_moe_layer(layer):
            self.feed_forward = Llama4MoE(cfg, layer)
        else:
            sizes = (cfg.hidden_size, cfg.intermediate_size_at(layer), cfg.hidden_act, cfg.mlp_bias)
            self.feed_forward = GatedMLP(*sizes, f"blocks.{layer}.mlp.hook_post", parallel=cfg.parallel)

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.post_attention_layernorm)
    attn_heads = property(lambda self: self.self_attn)
    mlp = property(lambda self: self.feed_forward)


class Llama4ForCausalLM(CausalLM):
    layer_class = Llama4DecoderLayer
