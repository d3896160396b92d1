"""Gemma 4 (text): Gemma 3's layer (sandwich norms, q/k norms, sliding and full layers with a rope each, the
embedding times sqrt(d), soft-capped logits) with what changes the activations if missed:

- every RMSNorm scales by w, not 1 + w, in float32 (`rms_float`);
- scores are not scaled (the q/k norms take the place of 1/sqrt(d_head));
- values are RMS-normalised head by head too, with no weight (hook_v is after that norm);
- the full-attention layers have heads of their own size (`global_head_dim`) and, where keys are values
  (`attention_k_eq_v`: the larger models), no v_proj and their own number of key-value heads: the values are the
  key projection's output before the key norm; their rotary turns only the first quarter of each head's frequency
  pairs ("proportional" rope, layers/rotary.py);
- each layer's output is multiplied by a learned scalar (`layer_scalar`) before hook_resid_post, so the stream is
  not the sum of the layers' outputs (vlens.attribution refuses to split it so).
"""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.models.gemma import GemmaDecoderLayer
from vlens.models.llama import CausalLM


class Gemma4DecoderLayer(GemmaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.layer_scalar = nn.Parameter(torch.ones(1))


class Gemma4ForCausalLM(CausalLM):
    layer_class = Gemma4DecoderLayer
