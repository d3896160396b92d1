"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2, SmolLM3; Gemma 1, with its own norm and embedding
scale; OLMo 1, with LayerNorms of no weight; Granite, with its multipliers, and HyperCLOVA X, the same with
post-norms; Helium, Seed-OSS, ERNIE 4.5, Hunyuan and the rest of the variants config flags describe), Phi-3 (the same layer with q/k/v and gate/up fused in its
checkpoints), the MoE variants Mixtral, Phi-3.5-MoE, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss, MiniMax-M2 and those with
DeepSeek's experts (GLM-4.5, dots.llm1, ERNIE 4.5's and Hunyuan's MoE models; the same layer with routed experts for
its MLP; gpt-oss's attention has sinks), and Apertus, Arcee, Nemotron, nanochat and StarCoder2 (the same attention
with an MLP that is not gated), with every tap written out.

Parameter names mirror HF's so checkpoints load by name. Each tap is an explicit line
`x = tap(NAME, x)` (vlens.context): a dict lookup when nobody asked, and plain code that survives
torch.compile and CUDA graphs (no module hooks). grep a hook name to find where it is tapped.
"""

from __future__ import annotations

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.context import ForwardContext, tap
from vlens.layers.linear import ColumnLinear, FusedLinear, RowLinear
from vlens.layers.mlp import DenseMLP, GatedMLP
from vlens.layers.moe import DeepseekMoE, SparseMoE
from vlens.layers.norm import make_norm
from vlens.layers.vocab import LMHead, VocabEmbedding
from vlens.models.base import AttentionHeads, DecoderLM, PostNormBlock, ResidualBlock, Rope

# MoE checkpoints name their block, its router (and, where the block keeps one, its bias per expert: LFM2-MoE's
# expert_bias, the default, MiniMax-M2's e_score_correction_bias) and each expert's gate/up/down projections
# differently (gpt-oss keeps all experts in one tensor per projection: vlens.layers.moe.ClampedExperts).
MOE_CHECKPOINT_NAMES = {
    "MixtralForCausalLM": (("block_sparse_moe", "gate"), ("w1", "w3", "w2")),
    "PhimoeForCausalLM": (("block_sparse_moe", "gate"), ("w1", "w3", "w2")),
    "Qwen2MoeForCausalLM": (("mlp", "gate"), ("gate_proj", "up_proj", "down_proj")),
    "Qwen3MoeForCausalLM": (("mlp", "gate"), ("gate_proj", "up_proj", "down_proj")),
    "Qwen3VLMoeTextModel": (("mlp", "gate"), None),  # (all experts in one tensor per projection)
    "OlmoeForCausalLM": (("mlp", "gate"), ("gate_proj", "up_proj", "down_proj")),
    "FlexOlmoForCausalLM": (("mlp", "gate"), ("gate_proj", "up_proj", "down_proj")),
    "GptOssForCausalLM": (("mlp", "router"), ("", "", "")),
    "Qwen3_5MoeForCausalLM": (("mlp", "gate"), ("gate_proj", "up_proj", "down_proj")),
    "Qwen3NextForCausalLM": (("mlp", "gate"), ("gate_proj", "up_proj", "down_proj")),
    "Lfm2MoeForCausalLM": (("feed_forward", "gate"), ("w1", "w3", "w2")),
    "MiniMaxM2ForCausalLM": (("block_sparse_moe", "gate", "e_score_correction_bias"), ("w1", "w3", "w2")),
    "Cohere2MoeForCausalLM": (("mlp", "gate"), ("gate_proj", "up_proj", "down_proj")),
}
# ... and those whose shared expert goes by another name
SHARED_EXPERT_NAMES = {"Cohere2MoeForCausalLM": "shared_experts"}

# DeepSeek-style MoE blocks whose checkpoints name some of their tensors otherwise (vlens.layers.moe.DeepseekMoE)
DEEPSEEK_MOE_NAMES = {
    "Ernie4_5_MoeForCausalLM": {"gate.e_score_correction_bias": "moe_statics.e_score_correction_bias"},
    "HunYuanMoEV1ForCausalLM": {"gate.weight": "gate.wg.weight", "shared_experts": "shared_mlp"},
    "AfmoeForCausalLM": {"gate.weight": "router.gate.weight", "gate.e_score_correction_bias": "expert_bias"},
    "ExaoneMoeForCausalLM": {"gate.e_score_correction_bias": "e_score_correction_bias"},
}
# ... and those whose checkpoints hold all experts in one tensor per projection, as transformers 5 saves them
FUSED_DEEPSEEK_EXPERTS = ("Mistral4ForCausalLM",)


class SelfAttention(AttentionHeads):
    """q_proj/k_proj/v_proj (fused into qkv_proj) and o_proj: Llama's, and Gemma's (Gemma 4's full layers have no
    v_proj where their keys are their values, and its shared layers q_proj alone); GPT-J, GPT-Neo and OPT name the
    output projection out_proj (`out_name`)."""

    out_name = "o_proj"

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        h, kv, d = cfg.num_heads, cfg.kv_heads_at(layer), self.head_dim
        gated = 2 if cfg.attn_output_gate else 1  # (Qwen 3.5: each head's query rows, then its gate's)
        parts = {"q_proj": h * d * gated, "k_proj": kv * d, "v_proj": kv * d}
        units, p = {"q_proj": h, "k_proj": kv, "v_proj": kv}, cfg.parallel
        if self.keys_are_values:
            del parts["v_proj"], units["v_proj"]
        if not self.own_kv:  # (Gemma 4's shared layers: an earlier layer's keys and values, no projections of them)
            parts, units = {"q_proj": parts["q_proj"]}, {"q_proj": h}
        self.qkv_proj = FusedLinear(cfg.hidden_size, parts, cfg.qkv_bias, cfg.stored_fused, parallel=p, units=units)
        setattr(self, self.out_name, RowLinear(h * d, cfg.hidden_size, cfg.o_bias, p, units=h))

    qkv = property(lambda self: self.qkv_proj)
    out = property(lambda self: self._modules[self.out_name])


class OutProjAttention(SelfAttention):
    out_name = "out_proj"


class OwnGateAttention(SelfAttention):
    """Llama's attention with a gate on each head's output from a projection of its own of the layer's input,
    `gate_proj` (AFMoE's a gate per channel, LFM3's one per head: `cfg.attn_gate_width` a head): z times the gate's
    sigmoid, as Qwen 3.5's gate from q_proj."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.gate_width = cfg.attn_gate_width  # (0: no gate, Llama's attention: LFM3 without use_attention_gate)
        if self.gate_width:
            self.gate_proj = ColumnLinear(cfg.hidden_size, cfg.num_heads * self.gate_width, False, cfg.parallel,
                                          units=cfg.num_heads)  # fmt: skip

    def project(
        self, x: torch.Tensor | tuple[torch.Tensor, ...], rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """q, k, v as Llama's; the gate [T, H, gate width] from the layer's input (where q, k and v read their own,
        TransformerLens's split inputs, q's: each head's gate from its own)."""
        q, k, v, gate = super().project(x, rope)
        if not self.gate_width:
            return q, k, v, gate
        source = x if isinstance(x, torch.Tensor) else x[0]
        if source.dim() == 2:
            gate = self.gate_proj(source)
        else:
            w = self.gate_proj.weight.view(self.heads, self.gate_width, source.shape[-1])
            gate = torch.einsum("thm,hdm->thd", source, w)
        return q, k, v, gate.reshape(-1, self.heads, self.gate_width)


def mlp_for(cfg: ModelConfig, layer: int) -> nn.Module:
    """The layer's MLP: routed experts on MoE layers, else the gated MLP."""
    if cfg.is_moe_layer(layer) and cfg.deepseek_moe:  # (GLM-4.5's: its shared expert gated as its MLP)
        hook = f"blocks.{layer}.mlp.shared_expert.hook_post"
        sizes = (cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act, cfg.mlp_bias)
        shared = GatedMLP(*sizes, hook, parallel=cfg.parallel) if cfg.shared_expert_intermediate_size else None
        names = None if cfg.architecture in FUSED_DEEPSEEK_EXPERTS else ("gate_proj", "up_proj", "down_proj")
        return DeepseekMoE(cfg, layer, shared, stored_as=DEEPSEEK_MOE_NAMES.get(cfg.architecture), expert_names=names)
    if cfg.is_moe_layer(layer) and not cfg.experts_beside_mlp:
        stored_as, expert_names = MOE_CHECKPOINT_NAMES[cfg.architecture]
        shared_as = SHARED_EXPERT_NAMES.get(cfg.architecture, "shared_expert")
        return SparseMoE(cfg, layer, stored_as, expert_names, shared_as)
    hook = f"blocks.{layer}.mlp.hook_post"
    sizes = (cfg.hidden_size, cfg.intermediate_size_at(layer), cfg.hidden_act, cfg.mlp_bias)
    return GatedMLP(*sizes, hook, cfg.stored_fused or cfg.gate_up_stored_fused, cfg.parallel)


class DecoderLayer(ResidualBlock):
    """Llama's layer (Granite's, MiniCPM3's: each sublayer's output times residual_multiplier before the add)."""

    attention: type[SelfAttention] = SelfAttention  # (Hunyuan's: its q/k norms' names)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.residual_multiplier = cfg.residual_multiplier
        self.input_layernorm = make_norm(cfg)
        self.self_attn = self.attention(cfg, layer)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = mlp_for(cfg, layer)

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.post_attention_layernorm)
    attn_heads = property(lambda self: self.self_attn)


class HyperClovaxDecoderLayer(PostNormBlock):
    """HyperCLOVA X: Granite's layer with each sublayer's output normed (post_norm1, post_norm2) before its residual
    multiplier and the add (Gemma's sandwich)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.residual_multiplier = cfg.residual_multiplier
        self.input_layernorm = make_norm(cfg)
        self.self_attn = SelfAttention(cfg, layer)
        self.post_norm1 = make_norm(cfg)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = mlp_for(cfg, layer)
        self.post_norm2 = make_norm(cfg)

    ln1 = property(lambda self: self.input_layernorm)
    ln2 = property(lambda self: self.post_attention_layernorm)
    attn_heads = property(lambda self: self.self_attn)
    attn_post_norm = property(lambda self: self.post_norm1)
    mlp_post_norm = property(lambda self: self.post_norm2)


def hyperclovax_layer(cfg: ModelConfig, layer: int) -> ResidualBlock:
    """HyperCLOVA X's layer: with its post-norms (use_post_norm) or, without, Granite's (Llama's)."""
    return (HyperClovaxDecoderLayer if cfg.post_norms else DecoderLayer)(cfg, layer)


class DenseMLPLayer(ResidualBlock):
    """Llama's attention with an MLP that is not gated (act(fc_in(x)), then fc_out), its norms and projections under
    the names the family's checkpoints give them (`names`: ln1's, ln2's, fc_in's, fc_out's)."""

    names: tuple[str, str, str, str]

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        ln1, ln2, fc_in, fc_out = self.names
        setattr(self, ln1, make_norm(cfg))
        self.self_attn = SelfAttention(cfg, layer)
        setattr(self, ln2, make_norm(cfg))
        self.mlp = DenseMLP(cfg, layer, (fc_in, fc_out))

    ln1 = property(lambda self: self._modules[self.names[0]])
    ln2 = property(lambda self: self._modules[self.names[1]])
    attn_heads = property(lambda self: self.self_attn)


class ApertusDecoderLayer(DenseMLPLayer):
    """Apertus: q/k norms head by head (its config's flag), xIELU with learned weights (layers/mlp.XIELU)."""

    names = ("attention_layernorm", "feedforward_layernorm", "up_proj", "down_proj")


class ArceeDecoderLayer(DenseMLPLayer):
    """Arcee (AFM) and Nemotron: Llama's layer with an MLP not gated (up, then down), of squared ReLUs (Nemotron's
    norms are LayerNorms that scale by 1 + w, its rotary partial: config flags)."""

    names = ("input_layernorm", "post_attention_layernorm", "up_proj", "down_proj")


class Starcoder2DecoderLayer(DenseMLPLayer):
    """StarCoder2: LayerNorms, biases everywhere, a tanh-GELU MLP, sliding windows."""

    names = ("input_layernorm", "post_attention_layernorm", "c_fc", "c_proj")


class DecoderModel(nn.Module):
    norm_name = "norm"  # the final norm's name in the checkpoints (LFM2's: embedding_norm)

    def __init__(self, cfg: ModelConfig, layer_class: type[ResidualBlock]):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        self.layers = nn.ModuleList(layer_class(cfg, i) for i in range(cfg.num_layers))
        setattr(self, self.norm_name, make_norm(cfg))


class CausalLM(DecoderLM):
    """forward() runs the layers a batch needs and returns the residual stream; logits are separate,
    so callers pay for the unembedding only on the rows they sample or capture. Families laid out as
    Llama's, whose layers differ (Gemma, OLMo 2), name their own `layer_class`."""

    layer_class: type[ResidualBlock] = DecoderLayer
    model_class: type[DecoderModel] = DecoderModel  # (Gemma 4's holds its per-layer embeddings too)

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.model = self.model_class(cfg, self.layer_class)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel, cfg.lm_head_bias)

    embed_tokens = property(lambda self: self.model.embed_tokens)
    layers = property(lambda self: self.model.layers)
    final_norm = property(lambda self: self.model._modules[self.model.norm_name])


class ApertusForCausalLM(CausalLM):
    layer_class = ApertusDecoderLayer


class HyperClovaxForCausalLM(CausalLM):
    layer_class = staticmethod(hyperclovax_layer)


class HunYuanAttention(SelfAttention):
    head_norms = ("query_layernorm", "key_layernorm")  # (HF's names; applied after rotary)


class HunYuanDecoderLayer(DecoderLayer):
    """Hunyuan (dense): Llama's layer, its q/k norms under their own names, after rotary."""

    attention = HunYuanAttention


class HunYuanForCausalLM(CausalLM):
    layer_class = HunYuanDecoderLayer


class ArceeForCausalLM(CausalLM):
    layer_class = ArceeDecoderLayer


class Starcoder2ForCausalLM(CausalLM):
    layer_class = Starcoder2DecoderLayer


class NanoChatDecoderLayer(DenseMLPLayer):
    """nanochat: Arcee's layer (an MLP of squared ReLUs, not gated) under CLIP's MLP names, norms without weights."""

    names = ("input_layernorm", "post_attention_layernorm", "fc1", "fc2")


class NanoChatForCausalLM(CausalLM):
    """nanochat's final norm (it has no weight) also normalises the embedding: hook_embed is after it, what enters
    layer 0 (as BLOOM's)."""

    layer_class = NanoChatDecoderLayer

    def embed(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return tap("hook_embed", self.final_norm(self.embedding(input_ids)))
