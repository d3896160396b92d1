"""Granite 4.0 (IBM's GraniteMoeHybrid: the H models and their all-attention siblings) and Granite 3.x's MoE models
(GraniteMoe, GraniteMoeShared): Granite's multipliers (vlens.config `_granite`), attention with no rotary unless
`position_embedding_type` is "rope", on some layers a Mamba 2 mixer in place of attention (vlens.layers.mamba2,
Bamba's), and for the MLP a gated `shared_mlp` (gate and up in one stored `input_linear`) beside routed experts
where the model has them (a router that softmaxes its top k logits; the experts stacked in `input_linear` /
`output_linear`)."""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.layers.checkpoint import Slot, checkpoint_slots
from vlens.layers.mamba2 import Mamba2Mixer
from vlens.layers.mlp import GatedMLP
from vlens.layers.moe import Experts, Routing
from vlens.layers.norm import make_norm
from vlens.models.base import MixerBlock
from vlens.models.llama import CausalLM, SelfAttention

SHARED_MLP_NAMES = dict(names=("gate", "up", "output_linear"), fused="input_linear", stored_fused=True)


class GraniteMoE(nn.Module):
    """Routed experts plus, where the model has one, the shared MLP, their outputs summed (the layer's MLP output);
    `block_sparse_moe` in the checkpoints, its router's weight under `router.layer`, the experts' stacks under
    `input_linear` and `output_linear` (GraniteMoeSWA's, `NATIVE_NAMES`: transformers 5's own, `router.weight` and
    `experts.gate_up_proj`, `experts.down_proj`)."""

    NATIVE_NAMES = ("GraniteMoeSWAForCausalLM",)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.native = cfg.architecture in self.NATIVE_NAMES
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act, None,
                               cfg.parallel)  # fmt: skip
        self.routing = Routing(cfg, layer)
        hook = f"blocks.{layer}.mlp.shared_expert.hook_post"
        size = cfg.shared_expert_intermediate_size
        self.shared_mlp = None if not size else GatedMLP(cfg.hidden_size, size, cfg.hidden_act, False, hook,
                                                         parallel=cfg.parallel, **SHARED_MLP_NAMES)  # fmt: skip

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        layer = path.rpartition(".")[0]
        block, experts = f"{layer}.block_sparse_moe", self.experts.checkpoint_slots("experts")
        if self.native:
            stored = {f"{block}.{k}": s for k, s in experts.items()}
        else:
            stored = {f"{block}.{'input' if k.endswith('gate_up_proj') else 'output'}_linear.weight": s
                      for k, s in experts.items()}  # fmt: skip
        stored[f"{block}.router.{'weight' if self.native else 'layer.weight'}"] = Slot(self.gate.weight)
        return stored if self.shared_mlp is None else stored | checkpoint_slots(self.shared_mlp, f"{layer}.shared_mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.routing(self.gate(x))
        out = self.experts(x, ids, weights)
        return out if self.shared_mlp is None else out + self.shared_mlp(x)


class GraniteHybridDecoderLayer(MixerBlock):
    mixer_name = "mamba"

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.residual_multiplier = cfg.residual_multiplier
        self.input_layernorm = make_norm(cfg)
        self.add_mixer(cfg, layer, SelfAttention, Mamba2Mixer)
        self.post_attention_layernorm = make_norm(cfg)
        if cfg.is_moe_layer(layer):
            self.block_sparse_moe = GraniteMoE(cfg, layer)
        else:
            hook = f"blocks.{layer}.mlp.hook_post"
            self.shared_mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, False, hook,
                                       parallel=cfg.parallel, **SHARED_MLP_NAMES)  # fmt: skip

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.post_attention_layernorm)
    mlp = property(lambda self: self._modules.get("block_sparse_moe") or self.shared_mlp)


class GraniteMoeHybridForCausalLM(CausalLM):
    layer_class = GraniteHybridDecoderLayer
