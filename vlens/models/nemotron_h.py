"""Nemotron-H (NVIDIA: Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano): a layer is one part alone after its norm,
x + mixer(norm(x)) (vlens.models.base.SublayerBlock), the part as `layer_types` says: a Mamba 2 mixer
(vlens.layers.mamba2, Bamba's), attention without positions (Llama's q/k/v/o projections, no biases), an MLP of
squared ReLUs, not gated (`up_proj`, `down_proj`), or routed experts of that kind beside a shared one (Nemotron
3). The checkpoint's modules: `backbone.embeddings`, `backbone.layers.L.norm` and `.mixer`, `backbone.norm_f`,
`lm_head` (HF's model calls the backbone `model` and maps the names as it loads).

Taps: a Mamba or attention layer has hook_resid_pre, ln1 (its norm), `mamba.*` or `attn.*`, hook_attn_out and
hook_resid_post; an MLP layer hook_resid_pre, ln2 (its norm), mlp.hook_post (an MoE layer: the router's taps and
mlp.shared_expert.hook_post), hook_mlp_out and hook_resid_post (vlens.capture.names.layer_hooks).
"""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.layers.mamba2 import Mamba2Mixer
from vlens.layers.mlp import DenseMLP
from vlens.layers.moe import DeepseekMoE
from vlens.layers.norm import make_norm
from vlens.layers.vocab import LMHead, VocabEmbedding
from vlens.models.base import DecoderLM, SublayerBlock
from vlens.models.llama import SelfAttention


def _part(cfg: ModelConfig, layer: int) -> nn.Module:
    if cfg.is_ssm_layer(layer):
        return Mamba2Mixer(cfg, layer)
    if cfg.attends(layer):
        return SelfAttention(cfg, layer)
    if cfg.is_moe_layer(layer):  # (Nemotron 3's experts and shared expert: squared ReLUs, not gated)
        return DeepseekMoE(cfg, layer, DenseMLP(cfg, layer, ("up_proj", "down_proj"), shared=True), gated=False)
    return DenseMLP(cfg, layer, ("up_proj", "down_proj"))


class NemotronHModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        self.layers = nn.ModuleList(SublayerBlock(cfg, i, make_norm(cfg), _part(cfg, i)) for i in range(cfg.num_layers))
        self.norm_f = make_norm(cfg)


class NemotronHForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.backbone = NemotronHModel(cfg)  # (HF's model., saved as the released checkpoints name it)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel)

    embed_tokens = property(lambda self: self.backbone.embeddings)
    layers = property(lambda self: self.backbone.layers)
    final_norm = property(lambda self: self.backbone.norm_f)
