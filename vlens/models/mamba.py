"""Mamba, Falcon Mamba and Mamba 2: models with neither attention nor MLPs. A layer is x + mixer(norm(x))
(vlens.models.base.SublayerBlock), the mixer Mamba's selective scan (vlens.layers.mamba1) or a Mamba 2 mixer
(vlens.layers.mamba2, Bamba's), whose states per sequence the runner keeps in state slots; the model's modules are
HF's (`backbone.embeddings`, `backbone.layers`, `backbone.norm_f`).

Taps, by TransformerLens's names where they have a meaning: hook_resid_pre, ln1 (the layer's one norm), the mixer's
under `mamba.` (as a hybrid's Mamba layers), hook_attn_out for what the mixer adds (as in every layer whose mixer is
not attention) and hook_resid_post; no hook_resid_mid, ln2 or MLP taps (vlens.capture.names.layer_hooks). Where the
checkpoint says residual_in_fp32 (Mamba's do), the stream between layers stays float32 as in HF; the model returns it
in its own dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.layers.mamba1 import MambaMixer
from vlens.layers.mamba2 import Mamba2Mixer
from vlens.layers.norm import make_norm
from vlens.layers.vocab import LMHead, VocabEmbedding
from vlens.models.base import DecoderLM, SublayerBlock


class MambaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        mixer = MambaMixer if cfg.ssm_dt_rank else Mamba2Mixer
        self.layers = nn.ModuleList(SublayerBlock(cfg, i, make_norm(cfg), mixer(cfg, i)) for i in range(cfg.num_layers))
        self.norm_f = make_norm(cfg)


class MambaForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.backbone = MambaModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel)

    embed_tokens = property(lambda self: self.backbone.embeddings)
    layers = property(lambda self: self.backbone.layers)
    final_norm = property(lambda self: self.backbone.norm_f)
