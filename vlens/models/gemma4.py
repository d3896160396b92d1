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
  not the sum of the layers' outputs (vlens.attribution refuses to split it so);
- E2B and E4B: per-layer embeddings, a second embedding of the tokens (one slice per layer) added to a projection
  of the first, from which each layer gets an input of its own that gates a small branch after its MLP
  (hook_per_layer_input, per_layer.hook_post, hook_per_layer_out); and their last `num_kv_shared_layers` layers
  attend to the keys and values of the last earlier layer of their kind (models/base.AttentionHeads), with MLPs
  twice as wide where `use_double_wide_mlp` says;
- 26B-A4B: routed experts beside each layer's MLP, reading the stream the MLP's norm reads through a norm of their
  own, with a router of its own kind (layers/moe.NormedRouter); each output normed (mlp.hook_dense_out,
  mlp.hook_experts_out), their sum (mlp.hook_out) normed again as the MLP's alone is elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.context import ForwardContext, get_context, tap
from vlens.layers.mlp import activation
from vlens.layers.moe import Experts, NormedRouter
from vlens.layers.norm import make_norm
from vlens.models.gemma import GemmaDecoderLayer
from vlens.models.llama import CausalLM, DecoderModel


class Gemma4DecoderLayer(GemmaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.index, size = layer, cfg.per_layer_input_size
        self.per_layer = bool(size)
        if size:
            self.per_layer_input_gate = nn.Linear(cfg.hidden_size, size, bias=False)
            self.per_layer_projection = nn.Linear(size, cfg.hidden_size, bias=False)
            self.post_per_layer_input_norm = make_norm(cfg)
            self.act = activation(cfg.hidden_act)
            p = f"blocks.{layer}."
            self.hook_per_layer_input, self.hook_per_layer_post = p + "hook_per_layer_input", p + "per_layer.hook_post"
            self.hook_per_layer_out = p + "hook_per_layer_out"
        self.experts_beside_mlp = cfg.experts_beside_mlp
        if cfg.experts_beside_mlp:
            self.router = NormedRouter(cfg, layer)
            sizes = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
            self.experts = Experts(*sizes, None, cfg.parallel)
            self.pre_feedforward_layernorm_2 = make_norm(cfg)
            self.post_feedforward_layernorm_1 = make_norm(cfg)
            self.post_feedforward_layernorm_2 = make_norm(cfg)
            p = f"blocks.{layer}.mlp."
            self.hook_dense_out, self.hook_experts_out = p + "hook_dense_out", p + "hook_experts_out"

    def mlp_block(self, h: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        if not self.experts_beside_mlp:
            return super().mlp_block(h, stream)
        dense = tap(self.hook_dense_out, self.post_feedforward_layernorm_1(self.mlp(h)))
        weights, ids = self.router(stream)
        experts = self.experts(self.pre_feedforward_layernorm_2(stream), ids, weights)
        return dense + tap(self.hook_experts_out, self.post_feedforward_layernorm_2(experts))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_layer:
            own = tap(self.hook_per_layer_input, get_context().per_layer_inputs[:, self.index])
            h = tap(self.hook_per_layer_post, self.act(self.per_layer_input_gate(x)) * own)
            x = x + tap(self.hook_per_layer_out, self.post_per_layer_input_norm(self.per_layer_projection(h)))
        return x * self.layer_scalar


class Gemma4Model(DecoderModel):
    """The decoder, and where per-layer embeddings are: the second embedding (`embed_tokens_per_layer`, every
    layer's slice side by side), the projection of the first onto every layer's inputs and its norm."""

    def __init__(self, cfg: ModelConfig, layer_class: type[Gemma4DecoderLayer]):
        super().__init__(cfg, layer_class)
        self.per_layer_size = size = cfg.per_layer_input_size
        n = cfg.num_layers
        if size:
            self.embed_tokens_per_layer = nn.Embedding(cfg.per_layer_vocab_size, n * size)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, n * size, bias=False)
            self.per_layer_projection_norm = make_norm(cfg, size)

    def per_layer_inputs(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[T, layers, size]: each layer's own input, from the tokens' second embedding (times sqrt(size), the
        factor rounded to the model's dtype) and the normed projection of their first (`embedded`, after
        hook_embed), as HF sums them."""
        n, size = len(self.layers), self.per_layer_size
        tokens = self.embed_tokens_per_layer(input_ids)
        tokens = (tokens * torch.tensor(size**0.5, dtype=tokens.dtype)).view(-1, n, size)
        projected = self.per_layer_model_projection(embedded) * embedded.shape[-1] ** -0.5
        projected = self.per_layer_projection_norm(projected.view(-1, n, size))
        return (projected + tokens) * 2**-0.5


class Gemma4ForCausalLM(CausalLM):
    layer_class = Gemma4DecoderLayer
    model_class = Gemma4Model

    def embed(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = super().embed(input_ids, ctx)
        if self.cfg.per_layer_input_size:
            ctx.per_layer_inputs = self.model.per_layer_inputs(input_ids, x)
        return x

    def forward(
        self, input_ids: torch.Tensor, num_layers: int | None = None, start: tuple[int, torch.Tensor] | None = None
    ) -> torch.Tensor:
        if start is not None and self.cfg.per_layer_input_size:  # (from a layer on: the inputs of the tokens alone,
            # the embedding as it was, for nothing before the layer changed)
            ctx = get_context()
            ctx.per_layer_inputs = self.model.per_layer_inputs(input_ids, self.embedding(input_ids))
        return super().forward(input_ids, num_layers, start)
