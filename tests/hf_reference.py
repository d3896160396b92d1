"""The Hugging Face side of the parity tests: every vlens tap that has an HF counterpart, read off HF's own
modules with forward hooks (the table of docs/architectures.md), for one unpadded sequence.

Not a test module; imported by the parity tests. Kept apart so every family is held to the very same
definition of each tap. q and k are taken from the return value of HF's own `apply_rotary_pos_emb`
(patched for the call), so they are after q/k norm and rotary exactly as HF computes them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

from vlens.capture.names import CTX

# Tap kinds that exist in every dense decoder layer of the Llama family and have an HF counterpart.
# Spelled out here, not imported from vlens.capture.names, so a renamed or dropped hook fails the parity tests.
LAYER_KINDS = (
    "hook_resid_pre",
    "ln1.hook_scale",
    "ln1.hook_normalized",
    "ln1.hook_out",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_attn_scores",
    "attn.hook_pattern",
    "attn.hook_z",
    "hook_attn_out",
    "hook_resid_mid",
    "ln2.hook_scale",
    "ln2.hook_normalized",
    "ln2.hook_out",
    "mlp.hook_post",
    "hook_mlp_out",
    "hook_resid_post",
)


@dataclass(frozen=True)
class Family:
    """Where each tap lives in one family's HF modules (paths relative to a decoder layer)."""

    layers: str  # path from the CausalLM to its list of layers
    embed: str  # path from the CausalLM to the token embedding
    attn: str  # the layer's attention module
    outputs: dict[str, str]  # tap kind -> module whose output it is
    inputs: dict[str, str]  # tap kind -> module whose first input it is
    qkv: str  # module whose output holds the projections (v, and q/k for GPT-2)
    final_norm: str  # path from the CausalLM to the final norm
    extra: dict[str, str] = field(default_factory=dict)  # model-level taps: name -> module output
    post_norms: dict[str, str] = field(default_factory=dict)  # Gemma's ln1_post / ln2_post, OLMo's ln1 / ln2 -> module


LLAMA = Family(
    layers="model.layers",
    embed="model.embed_tokens",
    attn="self_attn",
    outputs={
        "ln1.hook_out": "input_layernorm",
        "hook_attn_out": "self_attn",
        "ln2.hook_out": "post_attention_layernorm",
        "hook_mlp_out": "mlp",
    },
    inputs={
        "hook_resid_mid": "post_attention_layernorm",
        "attn.hook_z": "self_attn.o_proj",
        "mlp.hook_post": "mlp.down_proj",
    },
    qkv="self_attn.v_proj",
    final_norm="model.norm",
)
GEMMA = Family(
    layers="model.layers",
    embed="model.embed_tokens",
    attn="self_attn",
    outputs={
        "ln1.hook_out": "input_layernorm",
        "hook_attn_out": "post_attention_layernorm",
        "ln2.hook_out": "pre_feedforward_layernorm",
        "hook_mlp_out": "post_feedforward_layernorm",
    },
    inputs={
        "hook_resid_mid": "pre_feedforward_layernorm",
        "attn.hook_z": "self_attn.o_proj",
        "mlp.hook_post": "mlp.down_proj",
        "attn.hook_out": "post_attention_layernorm",
        "mlp.hook_out": "post_feedforward_layernorm",
    },
    qkv="self_attn.v_proj",
    final_norm="model.norm",
    post_norms={"ln1_post": "post_attention_layernorm", "ln2_post": "post_feedforward_layernorm"},
)
# GLM-4: Gemma's sandwich under its own names (its post_attention_layernorm is the pre-MLP norm)
GLM4 = replace(
    GEMMA,
    outputs={"ln1.hook_out": "input_layernorm", "hook_attn_out": "post_self_attn_layernorm",
             "ln2.hook_out": "post_attention_layernorm", "hook_mlp_out": "post_mlp_layernorm"},
    inputs={"hook_resid_mid": "post_attention_layernorm", "attn.hook_z": "self_attn.o_proj",
            "mlp.hook_post": "mlp.down_proj", "attn.hook_out": "post_self_attn_layernorm",
            "mlp.hook_out": "post_mlp_layernorm"},
    post_norms={"ln1_post": "post_self_attn_layernorm", "ln2_post": "post_mlp_layernorm"},
)  # fmt: skip
# AFMoE: Gemma's sandwich under its own names
AFMOE = replace(
    GEMMA,
    outputs={"ln1.hook_out": "input_layernorm", "hook_attn_out": "post_attention_layernorm",
             "ln2.hook_out": "pre_mlp_layernorm", "hook_mlp_out": "post_mlp_layernorm"},
    inputs={"hook_resid_mid": "pre_mlp_layernorm", "attn.hook_z": "self_attn.o_proj", "mlp.hook_post": "mlp.down_proj",
            "attn.hook_out": "post_attention_layernorm", "mlp.hook_out": "post_mlp_layernorm"},
    post_norms={"ln1_post": "post_attention_layernorm", "ln2_post": "post_mlp_layernorm"},
)  # fmt: skip
# HyperCLOVA X: Granite's layer in Gemma's sandwich under its own names
HYPERCLOVAX = replace(
    GEMMA,
    outputs={"ln1.hook_out": "input_layernorm", "hook_attn_out": "post_norm1",
             "ln2.hook_out": "post_attention_layernorm", "hook_mlp_out": "post_norm2"},
    inputs={"hook_resid_mid": "post_attention_layernorm", "attn.hook_z": "self_attn.o_proj",
            "mlp.hook_post": "mlp.down_proj", "attn.hook_out": "post_norm1", "mlp.hook_out": "post_norm2"},
    post_norms={"ln1_post": "post_norm1", "ln2_post": "post_norm2"},
)  # fmt: skip
# Gemma 4: Gemma's names; the values are v_norm's output (its full layers have no v_proj where keys are values)
GEMMA4 = replace(GEMMA, qkv="self_attn.v_norm")
# LFM2: Llama's layer under its own names (its final norm embedding_norm); short convolutions beside
LFM2 = replace(
    LLAMA,
    outputs={"ln1.hook_out": "operator_norm", "hook_attn_out": "self_attn", "ln2.hook_out": "ffn_norm",
             "hook_mlp_out": "feed_forward"},  # fmt: skip
    inputs={"hook_resid_mid": "ffn_norm", "attn.hook_z": "self_attn.out_proj", "mlp.hook_post": "feed_forward.w2"},
    final_norm="model.embedding_norm",
)
# LFM3: LFM2's names (Qwen3's in its attention) in Gemma's sandwich
LFM3 = Family(
    layers="model.layers",
    embed="model.embed_tokens",
    attn="self_attn",
    outputs={"ln1.hook_out": "operator_norm", "hook_attn_out": "post_operator_norm", "ln2.hook_out": "ffn_norm",
             "hook_mlp_out": "post_ffn_norm"},
    inputs={"hook_resid_mid": "ffn_norm", "attn.hook_z": "self_attn.o_proj", "mlp.hook_post": "feed_forward.w2",
            "attn.hook_out": "post_operator_norm", "mlp.hook_out": "post_ffn_norm"},
    qkv="self_attn.v_proj",
    final_norm="model.embedding_norm",
    post_norms={"ln1_post": "post_operator_norm", "ln2_post": "post_ffn_norm"},
)  # fmt: skip
# Llama 4: Llama's layer, its MLP or experts under feed_forward
LLAMA4 = replace(LLAMA, outputs=LLAMA.outputs | {"hook_mlp_out": "feed_forward"},
                 inputs=LLAMA.inputs | {"mlp.hook_post": "feed_forward.down_proj"})  # fmt: skip
# Where a multimodal model (Gemma 3 4B-27B, Mistral 3, Llava) keeps its text model's modules
TEXT_MODEL = dict(layers="model.language_model.layers", embed="model.language_model.embed_tokens",
                  final_norm="model.language_model.norm")  # fmt: skip
FAMILIES = {
    "llama": LLAMA,
    "phi3": replace(LLAMA, qkv="self_attn.qkv_proj"),
    "stablelm": LLAMA,  # (its rotary returns the leading partial_rotary_factor of each head alone)
    "starcoder2": replace(LLAMA, inputs=LLAMA.inputs | {"mlp.hook_post": "mlp.c_proj"}),  # (an MLP not gated)
    "apertus": replace(  # Llama's layer, its norms of their own names
        LLAMA,
        outputs=LLAMA.outputs | {"ln1.hook_out": "attention_layernorm", "ln2.hook_out": "feedforward_layernorm"},
        inputs=LLAMA.inputs | {"hook_resid_mid": "feedforward_layernorm"},
    ),
    # Cohere 1 and 2: Llama's names, one norm for both sublayers (TransformerLens's ln2 is ln1), no resid_mid
    "cohere": replace(
        LLAMA,
        outputs={"ln1.hook_out": "input_layernorm", "hook_attn_out": "self_attn", "ln2.hook_out": "input_layernorm",
                 "hook_mlp_out": "mlp"},  # fmt: skip
        inputs={"attn.hook_z": "self_attn.o_proj", "mlp.hook_post": "mlp.down_proj"},
    ),
    "gemma": GEMMA,
    "afmoe": AFMOE,
    "hyperclovax": HYPERCLOVAX,
    "nanochat": replace(LLAMA, inputs=LLAMA.inputs | {"mlp.hook_post": "mlp.fc2"}),  # (CLIP's MLP names)
    # VaultGemma: Gemma 2's layer without its post-norms, Llama's with Gemma's name for the pre-MLP norm
    "vaultgemma": replace(LLAMA, outputs=LLAMA.outputs | {"ln2.hook_out": "pre_feedforward_layernorm"},
                          inputs=LLAMA.inputs | {"hook_resid_mid": "pre_feedforward_layernorm"}),  # fmt: skip
    # OLMo 2 and 3: Gemma's post-norms without its pre-norms; TransformerLens calls the post-norms ln1 and ln2
    "olmo": replace(
        GEMMA,
        outputs={"hook_attn_out": "post_attention_layernorm", "hook_mlp_out": "post_feedforward_layernorm"},
        inputs=GEMMA.inputs | {"hook_resid_mid": "mlp"},
        post_norms={"ln1": "post_attention_layernorm", "ln2": "post_feedforward_layernorm"},
    ),
    # multimodal models (Gemma 3 4B-27B, Mistral 3, Llava): their text model, beside the vision tower
    "gemma3_multimodal": replace(GEMMA, **TEXT_MODEL),
    "gemma4": GEMMA4,
    "gemma4_multimodal": replace(GEMMA4, **TEXT_MODEL),
    "llama_multimodal": replace(LLAMA, **TEXT_MODEL),
    "phi": Family(  # one norm for both sublayers (TransformerLens's ln2 is ln1, read again); no resid_mid
        layers="model.layers",
        embed="model.embed_tokens",
        attn="self_attn",
        outputs={"ln1.hook_out": "input_layernorm", "hook_attn_out": "self_attn", "ln2.hook_out": "input_layernorm",
                 "hook_mlp_out": "mlp"},  # fmt: skip
        inputs={"attn.hook_z": "self_attn.dense", "mlp.hook_post": "mlp.fc2"},
        qkv="self_attn.v_proj",
        final_norm="model.final_layernorm",
    ),
    "lfm2": LFM2,
    "lfm3": LFM3,
    "olmo_hybrid": replace(  # (its attention layers: OLMo's; its linear layers Llama's names, as Qwen 3.5's)
        GEMMA,
        outputs={"hook_attn_out": "post_attention_layernorm", "hook_mlp_out": "post_feedforward_layernorm"},
        inputs=GEMMA.inputs | {"hook_resid_mid": "mlp"},
        post_norms={"ln1": "post_attention_layernorm", "ln2": "post_feedforward_layernorm"},
    ),
    "glm4": GLM4,
    "llama4": LLAMA4,
    "llama4_multimodal": replace(LLAMA4, layers="language_model.model.layers",
                                 embed="language_model.model.embed_tokens", final_norm="language_model.model.norm"),
    # DeepSeek-V2/V3: Llama's layer; each head's key part without positions and its value from kv_b_proj, the queries
    # from q_b_proj (or q_proj), the rotating parts from the rotary call
    "deepseek": replace(LLAMA, qkv="self_attn.kv_b_proj"),
    "granite_hybrid": replace(  # no one MLP module: the experts' and the shared MLP's outputs, summed (below)
        LLAMA,
        outputs={"ln1.hook_out": "input_layernorm", "hook_attn_out": "self_attn",
                 "ln2.hook_out": "post_attention_layernorm"},  # fmt: skip
        inputs=LLAMA.inputs | {"mlp.hook_post": "shared_mlp.output_linear"},
    ),
    "bamba": replace(  # Llama's layer under Bamba's names (its final norm final_layernorm); Mamba 2 mixers beside
        LLAMA,
        outputs=LLAMA.outputs | {"ln2.hook_out": "pre_ff_layernorm", "hook_mlp_out": "feed_forward"},
        inputs=LLAMA.inputs | {"hook_resid_mid": "pre_ff_layernorm", "mlp.hook_post": "feed_forward.down_proj"},
        final_norm="model.final_layernorm",
    ),
    # Mamba, Falcon Mamba, Mamba 2: a norm and a mixer a layer (its taps from HF's conv and scan calls, below)
    "mamba": Family(layers="backbone.layers", embed="backbone.embeddings", attn="mixer",
                    outputs={"ln1.hook_out": "norm"}, inputs={}, qkv="", final_norm="backbone.norm_f"),  # fmt: skip
    # Nemotron-H: a norm and one part a layer (NEMOTRON_PARTS: each part's taps)
    "nemotron_h": Family(layers="model.layers", embed="model.embeddings", attn="mixer", outputs={}, inputs={},
                         qkv="mixer.v_proj", final_norm="model.norm_f"),  # fmt: skip
    "glm4_multimodal": replace(GLM4, **TEXT_MODEL),
    "lfm2_multimodal": replace(LFM2, **TEXT_MODEL | dict(final_norm="model.language_model.embedding_norm")),
    "lfm3_multimodal": replace(LFM3, **TEXT_MODEL | dict(final_norm="model.language_model.embedding_norm")),
    "gpt2": Family(
        layers="transformer.h",
        embed="transformer.wte",
        attn="attn",
        outputs={
            "ln1.hook_out": "ln_1",
            "hook_attn_out": "attn",
            "ln2.hook_out": "ln_2",
            "hook_mlp_out": "mlp",
        },
        inputs={"hook_resid_mid": "ln_2", "attn.hook_z": "attn.c_proj", "mlp.hook_post": "mlp.c_proj"},
        qkv="attn.c_attn",
        final_norm="transformer.ln_f",
        extra={"hook_pos_embed": "transformer.wpe"},
    ),
    "gpt_neo": Family(  # GPT-2's layer, its attention one module deeper, q/k/v projected apart
        layers="transformer.h",
        embed="transformer.wte",
        attn="attn.attention",
        outputs={"ln1.hook_out": "ln_1", "hook_attn_out": "attn", "ln2.hook_out": "ln_2", "hook_mlp_out": "mlp"},
        inputs={"hook_resid_mid": "ln_2", "attn.hook_z": "attn.attention.out_proj", "mlp.hook_post": "mlp.c_proj"},
        qkv="attn.attention.v_proj",
        final_norm="transformer.ln_f",
        extra={"hook_pos_embed": "transformer.wpe"},
    ),
    "opt": Family(  # GPT-2's layer under its own names, its MLP's projections on the layer itself
        layers="model.decoder.layers",
        embed="model.decoder.embed_tokens",
        attn="self_attn",
        outputs={"ln1.hook_out": "self_attn_layer_norm", "hook_attn_out": "self_attn",
                 "ln2.hook_out": "final_layer_norm", "hook_mlp_out": "fc2"},  # fmt: skip
        inputs={"hook_resid_mid": "final_layer_norm", "attn.hook_z": "self_attn.out_proj", "mlp.hook_post": "fc2"},
        qkv="self_attn.v_proj",
        final_norm="model.decoder.final_layer_norm",
        extra={"hook_pos_embed": "model.decoder.embed_positions"},
    ),
    "bloom": Family(  # GPT-NeoX's fused q/k/v; its attention and MLP modules return their sum with the residual
        layers="transformer.h",
        embed="transformer.word_embeddings_layernorm",  # (hook_embed after the embedding's LayerNorm, as TL's)
        attn="self_attention",
        outputs={"ln1.hook_out": "input_layernorm", "hook_attn_out": "self_attention.dense",
                 "ln2.hook_out": "post_attention_layernorm", "hook_mlp_out": "mlp.dense_4h_to_h"},  # fmt: skip
        inputs={"hook_resid_mid": "post_attention_layernorm", "attn.hook_z": "self_attention.dense",
                "mlp.hook_post": "mlp.dense_4h_to_h"},  # fmt: skip
        qkv="self_attention.query_key_value",
        final_norm="transformer.ln_f",
    ),
    "gptj": Family(  # Phi's layer under GPT-2's names: one norm for both sublayers, no resid_mid
        layers="transformer.h",
        embed="transformer.wte",
        attn="attn",
        outputs={"ln1.hook_out": "ln_1", "hook_attn_out": "attn", "ln2.hook_out": "ln_1", "hook_mlp_out": "mlp"},
        inputs={"attn.hook_z": "attn.out_proj", "mlp.hook_post": "mlp.fc_out"},
        qkv="attn.v_proj",
        final_norm="transformer.ln_f",
    ),
    "mpt": Family(  # GPT-2's layer under MPT's names; its MLP module returns its output summed with the residual
        layers="transformer.blocks",
        embed="transformer.wte",
        attn="attn",
        outputs={"ln1.hook_out": "norm_1", "hook_attn_out": "attn", "ln2.hook_out": "norm_2",
                 "hook_mlp_out": "ffn.down_proj"},  # fmt: skip
        inputs={"hook_resid_mid": "norm_2", "attn.hook_z": "attn.out_proj", "mlp.hook_post": "ffn.down_proj"},
        qkv="attn.Wqkv",
        final_norm="transformer.norm_f",
    ),
    # DBRX: Llama's layer with both norms and the attention in norm_attn_norm, q, k and v one clamped projection
    "dbrx": Family(
        layers="transformer.blocks",
        embed="transformer.wte",
        attn="norm_attn_norm.attn",
        outputs={"ln1.hook_out": "norm_attn_norm.norm_1", "hook_attn_out": "norm_attn_norm.attn",
                 "ln2.hook_out": "norm_attn_norm.norm_2", "hook_mlp_out": "ffn"},  # fmt: skip
        inputs={"hook_resid_mid": "norm_attn_norm.norm_2", "attn.hook_z": "norm_attn_norm.attn.out_proj"},
        qkv="norm_attn_norm.attn.Wqkv",
        final_norm="transformer.norm_f",
    ),
    # Falcon: its sequential layer under GPT-NeoX's names (family_of: the parallel layers' norms)
    "falcon": Family(
        layers="transformer.h",
        embed="transformer.word_embeddings",
        attn="self_attention",
        outputs={"ln1.hook_out": "input_layernorm", "hook_attn_out": "self_attention",
                 "ln2.hook_out": "post_attention_layernorm", "hook_mlp_out": "mlp"},  # fmt: skip
        inputs={"hook_resid_mid": "post_attention_layernorm", "attn.hook_z": "self_attention.dense",
                "mlp.hook_post": "mlp.dense_4h_to_h"},  # fmt: skip
        qkv="self_attention.query_key_value",
        final_norm="transformer.ln_f",
    ),
    "gpt_neox": Family(
        layers="gpt_neox.layers",
        embed="gpt_neox.embed_in",
        attn="attention",
        outputs={
            "ln1.hook_out": "input_layernorm",
            "hook_attn_out": "attention",
            "ln2.hook_out": "post_attention_layernorm",
            "hook_mlp_out": "mlp",
        },
        inputs={
            "hook_resid_mid": "post_attention_layernorm",
            "attn.hook_z": "attention.dense",
            "mlp.hook_post": "mlp.dense_4h_to_h",
        },
        qkv="attention.query_key_value",
        final_norm="gpt_neox.final_layer_norm",
    ),
}
# Persimmon: GPT-NeoX's attention (a LayerNorm a head over q and over k) in Llama's sequential layer
FAMILIES["persimmon"] = replace(
    FAMILIES["gpt_neox"], layers="model.layers", embed="model.embed_tokens", attn="self_attn",
    outputs={"ln1.hook_out": "input_layernorm", "hook_attn_out": "self_attn",
             "ln2.hook_out": "post_attention_layernorm", "hook_mlp_out": "mlp"},
    inputs={"hook_resid_mid": "post_attention_layernorm", "attn.hook_z": "self_attn.dense",
            "mlp.hook_post": "mlp.dense_4h_to_h"},
    qkv="self_attn.query_key_value", final_norm="model.final_layernorm",
)  # fmt: skip
FAMILIES["persimmon_multimodal"] = replace(FAMILIES["persimmon"], **TEXT_MODEL | {
    "final_norm": "model.language_model.final_layernorm"})  # (Fuyu's)
# CodeGen: GPT-J's, q, k and v in one projection (rows in four shards, each [q, v, k] of a quarter of the heads)
FAMILIES["codegen"] = replace(FAMILIES["gptj"], qkv="attn.qkv_proj")
# XGLM and BioGPT: OPT's layer under their models' own names (XGLM's positions a module without weights)
FAMILIES["xglm"] = replace(FAMILIES["opt"], layers="model.layers", embed="model.embed_tokens",
                           final_norm="model.layer_norm",
                           extra={"hook_pos_embed": "model.embed_positions"})  # fmt: skip
FAMILIES["biogpt"] = replace(FAMILIES["opt"], layers="biogpt.layers", embed="biogpt.embed_tokens",
                             final_norm="biogpt.layer_norm",
                             extra={"hook_pos_embed": "biogpt.embed_positions"})  # fmt: skip
# Idefics3 and SmolVLM keep their text model under model.text_model; Aya Vision's is Cohere 2
FAMILIES["idefics3_multimodal"] = replace(
    LLAMA, layers="model.text_model.layers", embed="model.text_model.embed_tokens", final_norm="model.text_model.norm"
)
FAMILIES["cohere_multimodal"] = replace(FAMILIES["cohere"], **TEXT_MODEL)
FAMILIES["olmo_multimodal"] = replace(FAMILIES["olmo"], **TEXT_MODEL)  # (EXAONE 4.5's: EXAONE 4's)
MODEL_TYPES = {"gemma2": "gemma", "gemma3_text": "gemma", "gpt2": "gpt2", "gpt_neox": "gpt_neox", "phi3": "phi3",
               "olmo2": "olmo", "olmo3": "olmo", "flex_olmo": "olmo", "olmo_hybrid": "olmo_hybrid", "phi": "phi",
               "gemma3": "gemma3_multimodal",
               "mistral3": "llama_multimodal", "llava": "llama_multimodal", "llava_next": "llama_multimodal",
               "llava_onevision": "llama_multimodal", "internvl": "llama_multimodal", "qwen2_vl": "llama_multimodal",
               "glm4v": "glm4_multimodal", "glm4v_moe": "llama_multimodal", "exaone4_5": "olmo_multimodal",
               "idefics3": "idefics3_multimodal", "smolvlm": "idefics3_multimodal", "aya_vision": "cohere_multimodal",
               "gptj": "gptj", "codegen": "codegen", "cohere": "cohere", "cohere2": "cohere", "cohere2_moe": "cohere",
               "exaone4": "olmo", "qwen2_5_vl": "llama_multimodal", "qwen3_vl": "llama_multimodal",
               "stablelm": "stablelm", "gpt_neo": "gpt_neo", "qwen3_vl_moe": "llama_multimodal",
               "gemma4_text": "gemma4", "gemma4": "gemma4_multimodal", "opt": "opt", "gpt_bigcode": "gpt2",
               "falcon": "falcon", "mpt": "mpt", "dbrx": "dbrx", "vaultgemma": "vaultgemma", "nanochat": "nanochat", "afmoe": "afmoe",
               "hyperclovax": "hyperclovax",
               "apertus": "apertus",
               "gemma4_unified_text": "gemma4",
               "gemma4_unified": "gemma4_multimodal", "bloom": "bloom", "starcoder2": "starcoder2",
               "qwen3_5": "llama_multimodal", "qwen3_5_moe": "llama_multimodal", "lfm2": "lfm2", "lfm2_moe": "lfm2",
               "lfm3": "lfm3",
               "bamba": "bamba", "granitemoehybrid": "granite_hybrid", "granitemoe": "granite_hybrid",
               "granitemoeshared": "granite_hybrid", "granitemoe_swa": "granite_hybrid",
               "lfm2_vl": "lfm2_multimodal", "lfm3_vl": "lfm3_multimodal", "mamba": "mamba", "falcon_mamba": "mamba",
               "mamba2": "mamba",
               "nemotron_h": "nemotron_h", "jamba": "bamba",
               "falcon_h1": "bamba", "glm4": "glm4", "deepseek_v2": "deepseek", "deepseek_v3": "deepseek",
               "glm4_moe_lite": "deepseek", "youtu": "deepseek", "mistral4": "deepseek", "minicpm3": "deepseek",
               "llama4_text": "llama4", "llama4": "llama4_multimodal", "xglm": "xglm", "biogpt": "biogpt",
               "persimmon": "persimmon", "fuyu": "persimmon_multimodal"}  # fmt: skip
# Nemotron-H's layers by their block type: (tap kind -> module whose output it is, ... whose first input it is)
NEMOTRON_PARTS = {
    "linear_attention": ({"ln1.hook_out": "norm"}, {}),
    "full_attention": ({"ln1.hook_out": "norm", "hook_attn_out": "mixer"}, {"attn.hook_z": "mixer.o_proj"}),
    "mlp": ({"ln2.hook_out": "norm", "hook_mlp_out": "mixer"}, {"mlp.hook_post": "mixer.down_proj"}),
    "moe": ({"ln2.hook_out": "norm", "hook_mlp_out": "mixer"}, {}),
}
# model types whose q_proj gives each head's query, then its output gate
GATED_ATTENTION = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# Families whose rotary returns the leading dims of each head alone (the rest are as projected)
PARTIAL_ROTARY = ("phi", "gptj", "codegen", "stablelm", "persimmon", "persimmon_multimodal")
ROTARY_FUNCTIONS = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave", "apply_rotary_emb")


def family_of(hf_model) -> tuple[str, Family]:
    """(name, Family); OLMo Hybrid's the family of its attention layers (OLMo's: LLAMA is its linear layers')."""
    cfg = hf_model.config
    name = MODEL_TYPES.get(cfg.model_type, "llama")
    if name == "hyperclovax" and not cfg.use_post_norm:  # (its post-norms Identities: Granite's layer)
        return "llama", LLAMA
    if name == "lfm3" and not cfg.use_sandwich_norm:  # (its post-norms Identities: LFM2's layer)
        fam = FAMILIES[name]
        return name, replace(fam, post_norms={}, outputs=fam.outputs | {"hook_attn_out": "self_attn",
                                                                         "hook_mlp_out": "feed_forward"},
                             inputs={k: v for k, v in fam.inputs.items() if not k.endswith(".hook_out")})  # fmt: skip
    if name == "falcon" and (cfg.parallel_attn or cfg.new_decoder_architecture):  # (no resid_mid; one norm or two)
        norms = ("ln_attn", "ln_mlp") if (cfg.num_ln_in_parallel_attn or 1) == 2 else ("input_layernorm",) * 2
        fam = FAMILIES[name]
        return name, replace(fam, outputs=fam.outputs | {"ln1.hook_out": norms[0], "ln2.hook_out": norms[1]},
                             inputs={k: v for k, v in fam.inputs.items() if k != "hook_resid_mid"})  # fmt: skip
    return name, FAMILIES[name]


def hf_attention(hf_model, layer: int) -> str:
    """The path of layer `layer`'s attention module in `hf_model`."""
    _, fam = family_of(hf_model)
    return f"{fam.layers}.{layer}.{fam.attn}"


def _first(x):
    """Modules return a tensor or a tuple whose first item is the tensor; either way the tensor."""
    return x[0] if isinstance(x, (tuple, list)) else x


def norm_inner(module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hook_scale, hook_normalized) of a norm from its input, as TransformerLens defines them: the
    divisor, and the input normalised before the weight (LayerNorm: centred first)."""
    h = x.float()
    if isinstance(module, torch.nn.LayerNorm) or type(module).__name__ in ("OlmoLayerNorm", "CohereLayerNorm",
                                                                           "Cohere2LayerNorm", "Cohere2MoeLayerNorm"):
        h = h - h.mean(-1, keepdim=True)
        # (OLMo 1's has no weight, no bias and a fixed eps; Cohere's calls its eps variance_epsilon)
        eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", 1e-5)
    else:  # the RMS norms of Llama, Gemma and the rest
        eps = getattr(module, "variance_epsilon", None) or module.eps
    variance = h.pow(2).mean(-1, keepdim=True) + eps
    # (times rsqrt, as HF's norms compute it: a quotient rounds otherwise, a bfloat16 ulp apart now and then)
    return variance.sqrt().to(x.dtype), (h * torch.rsqrt(variance)).to(x.dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, ...] of a batch of one: most modules see [1, T, ...], MoE blocks flatten to [T, ...] first."""
    return x[0] if x.dim() == 3 else x


@contextlib.contextmanager
def _recording_rotary(attn_module, store: list):
    """Record what HF's rotary function returns, call by call: a (q, k) pair a layer, in order, or where it rotates
    one tensor a call (GPT-J, Gemma 4) each of them ([B, H, T, d]; _pair_rotations makes the pairs). The function is
    apply_rotary_pos_emb, or DeepSeek's: V3's apply_rotary_pos_emb_interleave, V2's apply_rotary_emb."""
    module = sys.modules[type(attn_module).__module__]
    names = [name for name in ROTARY_FUNCTIONS if hasattr(module, name)]  # (none: no rotary, GPT-2)
    originals = {name: getattr(module, name) for name in names}

    def recording(original):
        def record(*args, **kwargs):
            out = original(*args, **kwargs)
            if isinstance(out, torch.Tensor):  # GPT-J, Gemma 4: one tensor a call, [B, T, H, rotary_dim]
                store.append(out.clone().transpose(1, 2))
                return out
            q, k = out
            store.append((q.clone(), k.clone()))
            return q, k

        return record

    for name, original in originals.items():
        setattr(module, name, recording(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


def _pair_rotations(calls: list, name: str, own_kv: list[bool]) -> list:
    """(q, k) per rotating layer from one tensor a call: GPT-J and CodeGen rotate the keys then the queries, Gemma 4 the
    queries then the keys, and in a layer that attends to an earlier layer's keys the queries alone (k None)."""
    if not calls or not isinstance(calls[0], torch.Tensor):
        return calls
    it, pairs = iter(calls), []
    for own in own_kv:
        if name in ("gptj", "codegen"):
            k, q = next(it), next(it)
        else:
            q, k = next(it), next(it) if own else None
        pairs.append((q, k))
    return pairs


@contextlib.contextmanager
def _recording_delta_rule(block, store: list):
    """Record what HF's chunked gated delta rule (Qwen 3.5's linear attention) is given and returns, call by call:
    (q, k, v, g, beta, output), [B, T, ...] each."""
    module = sys.modules[type(block).__module__]
    original = getattr(module, "torch_chunk_gated_delta_rule", None)
    if original is None:
        yield
        return

    def recording(q, k, v, g, beta, *args, **kwargs):
        out = original(q, k, v, g, beta, *args, **kwargs)
        store.append(tuple(x.clone() for x in (q, k, v, g, beta, out[0])))
        return out

    module.torch_chunk_gated_delta_rule = recording
    try:
        yield
    finally:
        module.torch_chunk_gated_delta_rule = original


@contextlib.contextmanager
def _recording_convolutions(block, store: list):
    """Record what HF's causal_conv1d_forward (LFM2's short convolutions) returns, call by call: [B, d, T]."""
    module = sys.modules[type(block).__module__]
    original = getattr(module, "causal_conv1d_forward", None)
    if original is None:
        yield
        return

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        store.append(out.clone())
        return out

    module.causal_conv1d_forward = recording
    try:
        yield
    finally:
        module.causal_conv1d_forward = original


@contextlib.contextmanager
def _recording_scans(block, store: list):
    """Record each call of HF's Mamba 2 chunked scan (Bamba's): (its time steps after dt_bias and softplus, as the
    scan computes them, [B, T, heads]; its output [B, T, heads, head dim])."""
    module = sys.modules[type(block).__module__]
    original = getattr(module, "mamba2_chunk_scan", None)
    if original is None:
        yield
        return

    def recording(hidden_states, dt, *args, dt_bias=None, **kwargs):
        out = original(hidden_states, dt, *args, dt_bias=dt_bias, **kwargs)
        y = out[0] if isinstance(out, tuple) else out
        store.append((torch.nn.functional.softplus(dt + dt_bias.to(dt.dtype)), y.clone()))
        return out

    module.mamba2_chunk_scan = recording
    try:
        yield
    finally:
        module.mamba2_chunk_scan = original


@contextlib.contextmanager
def _recording_selective_scans(block, store: list):
    """Record each call of HF's Mamba selective scan (Mamba's, Falcon Mamba's): (x [B, channels, T], its time steps
    after their bias (in their dtype) and softplus, as the scan computes them, B and C [B, state size, T], the output
    before the gate [B, channels, T], the gate's input z), the output computed without the gate and gated after, as
    HF gates it."""
    module = sys.modules[type(block).__module__]
    original = getattr(module, "mamba_selective_scan", None)
    if original is None:
        yield
        return

    def recording(x, dt, a, b, c, *args, z=None, delta_bias=None, **kwargs):  # (HF passes them by keyword)
        out = original(x, dt, a, b, c, *args, z=None, delta_bias=delta_bias, **kwargs)
        y = out[0] if isinstance(out, tuple) else out
        store.append((x, torch.nn.functional.softplus(dt + delta_bias.to(dt.dtype)[..., None]), b, c, y.clone(), z))
        gated = y * torch.nn.functional.silu(z)
        return (gated, *out[1:]) if isinstance(out, tuple) else gated

    module.mamba_selective_scan = recording
    try:
        yield
    finally:
        module.mamba_selective_scan = original


@contextlib.contextmanager
def _recording_softmax(store: list, heads_flat: bool = False):
    """Record the input and output of every attention softmax ([B, heads, q, k]), call by call: HF's eager
    attention scores (scaled, soft-capped, the additive mask's huge negatives where keys are forbidden)
    and probabilities. `heads_flat`: the model's attention softmaxes [B * heads, q, k] (XGLM's), a batch of one."""
    original = torch.nn.functional.softmax

    def recording(x, dim=None, *args, **kwargs):
        out = original(x, dim, *args, **kwargs)
        if x.dim() == 4 and dim in (-1, 3):
            store.append((x.clone(), out.clone()))
        elif heads_flat and x.dim() == 3 and dim in (-1, 2):
            store.append((x.clone().unsqueeze(0), out.clone().unsqueeze(0)))
        return out

    torch.nn.functional.softmax = recording
    try:
        yield
    finally:
        torch.nn.functional.softmax = original


@torch.no_grad()
def hf_taps(
    hf_model, ids: list[int], layers: Iterable[int], patterns: bool = True, pixels: dict | None = None
) -> dict[str, torch.Tensor]:
    """vlens hook name -> HF's value [T, ...] for the token ids `ids` (batch of one, no padding); `pixels`: a
    multimodal model's other inputs (its processor's pixel_values, image_sizes, ...).

    Covers hidden_states.{i}, hook_embed (and hook_pos_embed), ln_final, logits and, for each layer in
    `layers`, every tap kind that layer has in HF (MoE layers: router logits and chosen experts). The
    attention scores and patterns come from a forward in HF's eager attention (`patterns=False` keeps the
    model's own attention implementation and leaves them out)."""
    cfg = hf_model.config.get_text_config()  # (a multimodal model's: its text model's)
    name, fam = family_of(hf_model)
    n = cfg.num_hidden_layers
    heads = getattr(cfg, "num_attention_heads", 0)  # (none in a Mamba)
    if getattr(cfg, "is_heterogeneous", False) or not heads:  # (Gemma 4: read per layer, below)
        kv_heads = head_dim = None
    else:
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    blocks = hf_model.get_submodule(fam.layers)
    layers = list(layers)
    # (per layer: 1 where it rotates; GraniteSWA's rope bases, 0 where it does not)
    rope = [bool(r) for r in getattr(cfg, "no_rope_layers", None) or getattr(cfg, "layer_rope_theta", None) or [1] * n]
    if (name in ("gpt_neo", "opt", "xglm", "biogpt", "bloom", "nemotron_h", "mpt") or cfg.model_type == "jamba"
            or getattr(cfg, "alibi", False) or getattr(cfg, "position_embedding_type", "rope") != "rope"):  # fmt: skip
        rope = [False] * n  # (learned positions, ALiBi, Granite 4's NoPE: q and k are the projections)
    elif cfg.model_type in ("cohere2", "afmoe") or (cfg.model_type in ("exaone4", "exaone_moe") and cfg.sliding_window):
        rope = [kind == "sliding_attention" for kind in cfg.layer_types]  # (rotary on the sliding-window layers alone)
    elif cfg.model_type == "cohere2_moe":  # (and on the dense layers where HF forces it)
        rope = [block.self_attn.sliding_window is not None or block.self_attn.force_rope
                for block in hf_model.get_submodule(fam.layers)]  # fmt: skip
    # (per layer: whether it has keys and values of its own; Gemma 4's shared layers attend to an earlier one's)
    own_kv = [mode != "reuse" for mode in getattr(cfg, "kv_sharing_modes", None) or [None] * n]
    # (per layer: a linear-attention layer, Qwen 3.5's, a short convolution, LFM2's, or a Mamba 2 mixer, Bamba's, in
    # place of attention)
    has = lambda block, name: getattr(block, name, None) is not None  # noqa: E731 - (Granite 4's layers hold None)
    mixers = [getattr(b, "mixer", None) for b in blocks]  # (a Mamba's, Nemotron-H's: its one part)
    mamba = [getattr(b, "mamba", None) or (m if type(m).__name__.endswith("Mixer") else None)
             for b, m in zip(blocks, mixers)]  # fmt: skip
    linear, ssm = [has(b, "linear_attn") for b in blocks], [m is not None for m in mamba]
    conv = [has(b, "conv") and not has(b, "self_attn") for b in blocks]
    mlp_only = [getattr(b, "block_type", None) in ("mlp", "moe") for b in blocks]  # (Nemotron-H's MLP layers)
    side_by_side = cfg.model_type == "falcon_h1"  # (attention beside a Mamba 2 mixer in every layer)
    attends = [side_by_side or not (lin or c or s or m) for lin, c, s, m in zip(linear, conv, ssm, mlp_only)]
    rope = [r and a for r, a in zip(rope, attends)]
    got: dict[str, torch.Tensor] = {}
    raw: dict[str, object] = {}
    handles = []

    def on_output(module, key, store=got, pick=_first):
        handles.append(module.register_forward_hook(lambda m, a, o: store.__setitem__(key, _rows(pick(o)).clone())))

    def on_input(module, key):
        handles.append(module.register_forward_hook(lambda m, a, o: got.__setitem__(key, _rows(a[0]).clone())))

    norms = {"ln_final": hf_model.get_submodule(fam.final_norm)}
    on_output(hf_model.get_submodule(fam.embed), "hook_embed")
    for hook, path in fam.extra.items():
        on_output(hf_model.get_submodule(path), hook)
    # (Qwen3-VL's deepstack: its first layers' outputs, HF's hidden_states, get more image rows before the next layer)
    deepstack = bool(getattr(getattr(hf_model.config, "vision_config", None), "deepstack_visual_indexes", None))
    for layer in layers:
        block, p = blocks[layer], f"blocks.{layer}."
        on_output(block, p + "raw_resid_post", raw)
        if deepstack:
            on_input(block, p + "hook_resid_pre")
        if linear[layer]:  # (the rest from the delta rule's calls, below)
            on_output(block.linear_attn, p + "hook_attn_out")
            net = block.linear_attn  # (OLMo Hybrid's norm and output projection: o_norm, o_proj)
            norm, out_proj = getattr(net, "norm", None) or net.o_norm, getattr(net, "out_proj", None) or net.o_proj
            handles.append(norm.register_forward_hook(  # (its second input: the gate's, z)
                lambda m, a, o, key=p + "linear_attn.hook_gate": got.__setitem__(key, a[1].clone())))
            on_input(out_proj, p + "linear_attn.hook_z")
        elif ssm[layer]:  # (the rest from HF's conv and scan calls, below)
            on_output(mamba[layer], p + ("mamba.hook_out" if side_by_side else "hook_attn_out"))
            norm = getattr(mamba[layer], "norm", None)  # (Falcon-H1's may be an Identity, not called)
            if isinstance(norm, torch.nn.Module) and not isinstance(norm, torch.nn.Identity):  # (its gate: z)
                handles.append(mamba[layer].norm.register_forward_hook(
                    lambda m, a, o, key=p + "mamba.hook_gate": got.__setitem__(key, a[1][0].clone())))
            elif side_by_side:  # (Falcon-H1 without the norm: z as projected, times its multiplier)
                on_output(mamba[layer].in_proj, p + "in_proj", raw)
            on_input(mamba[layer].out_proj, p + "mamba.hook_z")
            if side_by_side:
                on_output(block.self_attn, p + "attn.hook_out")
        elif conv[layer]:  # (its convolution's output from HF's conv calls, below; LFM3's before its post-norm)
            on_output(block.conv, p + ("attn.hook_out" if fam.post_norms else "hook_attn_out"))
            on_output(block.conv.in_proj, p + "conv.bcx", raw)
            on_input(block.conv.out_proj, p + "conv.hook_z")
        if own_kv[layer] and attends[layer] and not (linear[layer] or conv[layer] or (ssm[layer] and not side_by_side)):
            on_output(block.get_submodule(fam.qkv), p + "qkv", raw)
        if getattr(block, "hidden_size_per_layer_input", 0):  # Gemma 4's per-layer embeddings: the layer's own input
            # (its second argument), the branch's hidden activation, what it adds
            handles.append(block.register_forward_pre_hook(
                lambda m, a, key=p + "hook_per_layer_input": got.__setitem__(key, _rows(a[1]).clone())))
            on_input(block.per_layer_projection, p + "per_layer.hook_post")
            on_output(block.post_per_layer_input_norm, p + "hook_per_layer_out")
        if name.startswith("llama4") and hasattr(block.self_attn, "qk_norm"):  # (one weightless norm, of q then k)
            handles.append(block.self_attn.qk_norm.register_forward_hook(
                lambda m, a, o, key=p + "qk_normed": raw.setdefault(key, []).append(o[0].clone())))
        if hasattr(getattr(block, "self_attn", None), "query_layernorm"):  # (Hunyuan: q, k as its norms leave them)
            on_output(block.self_attn.query_layernorm, p + "q_normed", raw, pick=lambda o: o)
            on_output(block.self_attn.key_layernorm, p + "k_normed", raw, pick=lambda o: o)
        elif name == "nanochat":  # (its weightless q/k norms after rotary)
            on_output(block.self_attn.q_norm, p + "q_normed", raw, pick=lambda o: o)
            on_output(block.self_attn.k_norm, p + "k_normed", raw, pick=lambda o: o)
        if name == "deepseek":  # (its queries as projected: their no-position dims; the latents, normed)
            on_output(getattr(block.self_attn, "q_b_proj", None) or block.self_attn.q_proj, p + "q", raw)
            on_output(block.self_attn.kv_a_layernorm, p + "attn.hook_kv_latent")
            if block.self_attn.q_a_layernorm is not None:
                on_output(block.self_attn.q_a_layernorm, p + "attn.hook_q_latent")
        if cfg.model_type in GATED_ATTENTION and attends[layer]:  # (each head's query, then its gate)
            on_output(block.self_attn.q_proj, p + "q_and_gate", raw)
        gate_proj = getattr(getattr(block, "self_attn", None), "g_proj", None) or getattr(
            getattr(block, "self_attn", None), "gate_proj", None)  # (LFM3's gate, AFMoE's: of their own projection)
        if gate_proj is not None:
            on_output(gate_proj, p + "attn.hook_gate")
        fused = ("bloom", "falcon", "mpt", "codegen", "persimmon", "persimmon_multimodal")
        if (not rope[layer] or name in PARTIAL_ROTARY) and name not in fused and attends[layer]:
            # (the projections: NoPE's q and k, the parts past a partial rotary; BLOOM's, Falcon's and CodeGen's are in
            # their fused qkv)
            attn = block.get_submodule(fam.attn)
            if not rope[layer] and hasattr(attn, "q_norm"):  # (EXAONE 4's NoPE layers: after the q/k norm, which
                # reads [B, H, T, d]; AFMoE's [B, T, H, d])
                heads_first = (lambda o: o) if name == "afmoe" else (lambda o: o.transpose(1, 2))
                on_output(attn.q_norm, p + "q", raw, pick=heads_first)
                on_output(attn.k_norm, p + "k", raw, pick=heads_first)
            else:
                on_output(attn.q_proj, p + "q", raw)
                on_output(attn.k_proj, p + "k", raw)
        outputs, inputs = NEMOTRON_PARTS[block.block_type] if name == "nemotron_h" else (fam.outputs, fam.inputs)
        layer_post_norms = fam.post_norms
        if name == "olmo_hybrid" and linear[layer]:  # (Llama's layer)
            outputs, inputs, layer_post_norms = LLAMA.outputs, LLAMA.inputs, {}
        for kind, path in outputs.items():
            skip = (not attends[layer] or side_by_side) and not (conv[layer] and fam.post_norms)  # (LFM3's: normed)
            if skip and kind == "hook_attn_out":
                continue
            on_output(block.get_submodule(path), p + kind)
            if kind.endswith(".hook_out"):  # a norm: its inner values are computed from its input
                norms[p + kind.split(".")[0]] = block.get_submodule(path)
        for norm, path in layer_post_norms.items():  # (their outputs are hook_attn_out and hook_mlp_out)
            norms[p + norm] = block.get_submodule(path)
        # (OPT keeps its MLP's projections on the layer; LFM2 names it feed_forward; Granite 4 has experts beside a
        # shared MLP, whose outputs are summed)
        mlp = getattr(block, "mlp", None) or getattr(block, "feed_forward", None) or getattr(block, "block_sparse_moe",
                                                                                              None)  # fmt: skip
        if mlp_only[layer]:  # (Nemotron-H's: its one part)
            mlp = block.mixer
        if name == "dbrx":
            mlp = block.ffn
        if name == "granite_hybrid":  # (the shared MLP where the model has one, the experts where it has them)
            if getattr(block, "shared_mlp", None) is not None:
                on_output(block.shared_mlp, p + "shared", raw)
            if mlp is not None:
                on_output(mlp, p + "routed", raw)
                if getattr(block, "shared_mlp", None) is not None:
                    on_input(block.shared_mlp.output_linear, p + "mlp.shared_expert.hook_post")
        parallel = getattr(cfg, "use_parallel_residual", False)
        for kind, path in inputs.items():
            if kind == "hook_resid_mid" and parallel:
                continue  # under the parallel residual the norm reads resid_pre: no resid_mid in HF
            if kind == "mlp.hook_post" and hasattr(mlp, "experts") or not attends[layer] and kind.startswith("attn."):
                continue
            on_input(block.get_submodule(path), p + kind)
        if hasattr(mlp, "experts") and name.startswith("llama4"):  # (its router gives every expert's score, zeros
            # but the chosen, then the logits, whose top k chose)
            def llama4_router(m, a, o, p=p, k=cfg.num_experts_per_tok):
                scores, logits = _rows(o[0]), _rows(o[1])
                ids = logits.topk(k, dim=-1).indices
                raw[p + "router"] = (logits.clone(), scores.gather(-1, ids), ids)
                got[p + "mlp.hook_router_logits"] = logits.clone()
                got[p + "mlp.hook_expert_ids"] = got[p + "mlp.hook_expert_indices"] = ids

            handles.append(mlp.router.register_forward_hook(llama4_router))
            on_input(mlp.shared_expert.down_proj, p + "mlp.shared_expert.hook_post")
        elif hasattr(mlp, "experts") and name == "dbrx":  # (its router gives the logits alone: their softmax's top k
            # chose)
            def dbrx_router(m, a, o, p=p, k=cfg.ffn_config.moe_top_k):
                logits = _rows(o)
                ids = logits.softmax(-1).topk(k, dim=-1).indices
                raw[p + "router"] = (logits.clone(), None, ids)
                got[p + "mlp.hook_router_logits"] = logits.clone()
                got[p + "mlp.hook_expert_ids"] = got[p + "mlp.hook_expert_indices"] = ids

            handles.append(mlp.router.register_forward_hook(dbrx_router))
        elif hasattr(mlp, "experts"):
            router = getattr(mlp, "router", None) or mlp.gate  # (gpt-oss: router)
            on_output(router, p + "mlp.hook_router_logits", pick=lambda o: o[0])
            on_output(router, p + "mlp.hook_expert_ids", pick=lambda o: o[2])
            on_output(router, p + "mlp.hook_expert_indices", pick=lambda o: o[2])
            handles.append(router.register_forward_hook(  # (logits, weights of the chosen, chosen)
                lambda m, a, o, key=p + "router": raw.__setitem__(key, tuple(_rows(x).clone() for x in o))))
            if hasattr(mlp, "shared_expert"):
                on_input(mlp.shared_expert.down_proj, p + "mlp.shared_expert.hook_post")
            elif getattr(mlp, "shared_experts", None) is not None:  # (Nemotron 3's; ERNIE 4.5's may have none)
                on_input(mlp.shared_experts.down_proj, p + "mlp.shared_expert.hook_post")
            elif hasattr(mlp, "shared_mlp"):  # (Hunyuan's)
                on_input(mlp.shared_mlp.down_proj, p + "mlp.shared_expert.hook_post")
        if hasattr(block, "router"):  # Gemma 4 26B-A4B: experts beside the MLP, each output normed
            on_output(block.router.proj, p + "mlp.hook_router_logits")
            for kind, at in (("hook_expert_weights", 0), ("hook_expert_ids", 2), ("hook_expert_indices", 2)):
                on_output(block.router, p + "mlp." + kind, pick=lambda o, at=at: o[at])
            on_output(block.post_feedforward_layernorm_1, p + "mlp.hook_dense_out")
            on_output(block.post_feedforward_layernorm_2, p + "mlp.hook_experts_out")
    for prefix, module in norms.items():
        handles.append(
            module.register_forward_hook(lambda m, a, o, prefix=prefix: raw.__setitem__(prefix, _rows(a[0]).clone()))
        )
    rotated: list[tuple[torch.Tensor, torch.Tensor]] = []
    softmaxes: list[tuple[torch.Tensor, torch.Tensor]] = []
    deltas: list[tuple[torch.Tensor, ...]] = []
    convolved: list[torch.Tensor] = []
    scans: list[tuple[torch.Tensor, torch.Tensor]] = []
    selective: list[tuple[torch.Tensor, ...]] = []
    implementation = hf_model.config._attn_implementation
    if patterns:
        hf_model.set_attn_implementation("eager")  # the attention whose scores can be recorded
    try:
        with (
            _recording_rotary(blocks[attends.index(True)].get_submodule(fam.attn) if any(attends) else None, rotated),
            _recording_selective_scans(blocks[0], selective),
            _recording_softmax(softmaxes, heads_flat=cfg.model_type == "xglm"),
            _recording_delta_rule(blocks[0], deltas),
            _recording_convolutions(blocks[0], convolved),
            _recording_scans(blocks[0], scans),
        ):
            out = hf_model(torch.tensor([ids]), **(pixels or {}), output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        hf_model.set_attn_implementation(implementation)

    if pixels:  # (the vision tower's softmaxes came first)
        softmaxes = softmaxes[len(softmaxes) - sum(attends) :]
    for prefix, module in norms.items():
        got[prefix + ".hook_scale"], got[prefix + ".hook_normalized"] = norm_inner(module, raw[prefix])
    for layer in layers:  # TransformerLens's expert weights [E]: gpt-oss's chosen weights (zeros elsewhere), LFM2-MoE's
        # sigmoid of every logit, or the softmax over every expert where the router takes the top k of it
        if f"blocks.{layer}.router" in raw:
            logits, scores, experts = raw.pop(f"blocks.{layer}.router")
            block = blocks[layer]
            moe = getattr(block, "mlp", None) or getattr(block, "feed_forward", None) or getattr(
                block, "block_sparse_moe", None) or getattr(block, "ffn", None) or block.mixer  # fmt: skip
            bias = getattr(getattr(moe, "gate", None), "e_score_correction_bias", None)  # (MiniMax-M2's: the block's)
            bias = getattr(moe, "e_score_correction_bias", getattr(moe, "expert_bias", bias))  # (AFMoE's: expert_bias)
            if hasattr(moe, "use_expert_bias") or bias is not None:
                weights = logits.float().sigmoid() if cfg.model_type == "minimax_m2" else logits.sigmoid()
            # (the softmax's top k; Cohere 2's MoE: the top k's own softmax or sigmoids, zeros elsewhere)
            elif cfg.model_type != "cohere2_moe" and (getattr(moe, "router", None) is None
                                                      or cfg.model_type in ("jamba", "dbrx")):  # fmt: skip
                weights = logits.float().softmax(-1)
            else:
                weights = torch.zeros_like(logits).scatter(-1, experts, scores.to(logits.dtype))
            got[f"blocks.{layer}.mlp.hook_expert_weights"] = weights.to(logits.dtype)
            if bias is not None or cfg.model_type == "deepseek_v2":  # (DeepSeek's routers take an unsorted top k:
                # its experts in vlens's order, by what chose them, their sigmoid plus the bias or their softmax)
                chosen = (weights if bias is None else weights + bias).gather(-1, experts)
                experts = experts.gather(-1, torch.argsort(chosen, dim=-1, descending=True, stable=True))
                got[f"blocks.{layer}.mlp.hook_expert_ids"] = got[f"blocks.{layer}.mlp.hook_expert_indices"] = experts
    t = len(ids)
    rotated = _pair_rotations(rotated, name, [own for own, r in zip(own_kv, rope) if r])
    # (Granite: what the stream gets is the embedding and each sublayer's output times their multipliers)
    mup = cfg.hidden_size**0.5 if getattr(cfg, "mup_enabled", False) else 1.0  # (AFMoE's µP: the same, by another name)
    got["hook_embed"] = got["hook_embed"] * getattr(cfg, "embedding_multiplier", mup)
    for layer in layers:
        parts = [raw.get(f"blocks.{layer}.{part}") for part in ("routed", "shared")]
        if any(x is not None for x in parts):  # (Granite's: the experts' output plus the shared MLP's, as HF sums)
            got[f"blocks.{layer}.hook_mlp_out"] = sum(x for x in parts if x is not None)
        # (MiniCPM3's: scale_depth / sqrt(layers))
        depth = cfg.scale_depth / cfg.num_hidden_layers**0.5 if cfg.model_type == "minicpm3" else 1.0
        scale = getattr(cfg, "residual_multiplier", depth)
        for kind in ("hook_attn_out", "hook_mlp_out"):
            if f"blocks.{layer}.{kind}" in got:  # (a Mamba layer has no MLP)
                got[f"blocks.{layer}.{kind}"] = got[f"blocks.{layer}.{kind}"] * scale
    for i, h in enumerate(out.hidden_states):
        got[f"hidden_states.{i}"] = h[0]
    if name == "nanochat" or pixels:  # (nanochat's embedding normed, by the final norm's module; an image's rows:
        # its features, HF's inputs_embeds there. hook_embed is what enters layer 0)
        got["hook_embed"] = got["hidden_states.0"]
    got["ln_final.hook_out"] = out.hidden_states[n][0]
    got["unembed.hook_out"] = out.logits[0]
    for layer in layers:
        p = f"blocks.{layer}."
        if cfg.model_type in ("mamba", "falcon_mamba"):  # (their hidden_states are the layers' outputs)
            got[p + "hook_resid_pre"] = got["hook_embed"] if layer == 0 else raw[f"blocks.{layer - 1}.raw_resid_post"]
        elif not deepstack:
            got[p + "hook_resid_pre"] = out.hidden_states[layer][0]
        got[p + "hook_resid_post"] = raw[p + "raw_resid_post"]
        if linear[layer]:
            kinds = ("hook_q", "hook_k", "hook_v", "hook_decay", "hook_beta", "hook_core_out")
            for kind, x in zip(kinds, deltas[sum(linear[:layer])]):
                got[p + "linear_attn." + kind] = x[0]
            value_heads, value_dim = cfg.linear_num_value_heads, cfg.linear_value_head_dim
            for kind in ("hook_gate", "hook_z"):
                got[p + "linear_attn." + kind] = got[p + "linear_attn." + kind].reshape(t, value_heads, value_dim)
            continue
        if conv[layer]:  # (in_proj's output: B, C, x)
            for kind, x in zip(("hook_b", "hook_c", "hook_x"), raw[p + "conv.bcx"].chunk(3, -1)):
                got[p + "conv." + kind] = x
            got[p + "conv.hook_conv_out"] = convolved[sum(conv[:layer])][0].T
            continue
        if ssm[layer] and selective:  # (Mamba's: the scan's inputs and output)
            x, dt, b, c, y, z = (v[0].T for v in selective[sum(ssm[:layer])])
            for kind, v in zip(("x", "dt", "b", "c", "ssm_out", "gate"), (x, dt, b, c, y, z)):
                got[p + "mamba.hook_" + kind] = v
            continue
        if side_by_side:  # (what the stream gets: each output times its multiplier)
            got[p + "hook_attn_out"] = (got[p + "mamba.hook_out"] * cfg.ssm_out_multiplier
                                        + got[p + "attn.hook_out"] * cfg.attention_out_multiplier)  # fmt: skip
            if p + "in_proj" in raw:
                got[p + "mamba.hook_gate"] = raw[p + "in_proj"][:, : mamba[layer].intermediate_size] * \
                    cfg.ssm_multipliers[0]  # fmt: skip
        if ssm[layer]:  # (the convolution's output, after its activation: x, B, C; the scan's time steps and output)
            mixer, nth = mamba[layer], sum(ssm[:layer])
            groups = (mixer.n_groups, mixer.ssm_state_size)
            x, b, c = convolved[nth][0].T.split([mixer.intermediate_size, *(groups[0] * groups[1],) * 2], -1)
            got[p + "mamba.hook_x"] = x.reshape(t, mixer.num_heads, mixer.head_dim)
            got[p + "mamba.hook_b"], got[p + "mamba.hook_c"] = b.reshape(t, *groups), c.reshape(t, *groups)
            got[p + "mamba.hook_dt"], got[p + "mamba.hook_ssm_out"] = (v[0] for v in scans[nth])
            if not side_by_side:
                continue
        if not attends[layer]:  # (Nemotron-H's MLP layers)
            continue
        if getattr(cfg, "is_heterogeneous", False):  # (Gemma 4's full layers: heads of their own size and number)
            head_dim, kv_heads = cfg.per_layer_config[layer].head_dim, cfg.per_layer_config[layer].num_key_value_heads
        got[p + "attn.hook_z"] = got[p + "attn.hook_z"].view(t, heads, -1)  # (DeepSeek's: of the values' size)
        qkv = raw.get(p + "qkv")  # (none in a layer that attends to an earlier layer's keys and values)
        if name.startswith("persimmon"):  # (each head's [q k v] rows together; q and k normed head by head, if at all)
            q_rows, k_rows = (x.reshape(t, -1) for x in qkv.view(t, heads, 3, head_dim).unbind(2)[:2])
            attn = blocks[layer].self_attn
            raw[p + "q"], raw[p + "k"] = (q_rows, k_rows) if not attn.qk_layernorm else (
                attn.q_layernorm(q_rows.view(t, heads, head_dim)), attn.k_layernorm(k_rows.view(t, heads, head_dim)))
        elif name == "codegen":  # (its four shards of rows, [q, v, k] each: as q, k and v projected apart)
            q_rows, v_rows, k_rows = (x.reshape(t, -1) for x in qkv.view(t, 4, 3, -1).unbind(2))
            raw[p + "q"], raw[p + "k"], qkv = q_rows, k_rows, torch.cat([q_rows, k_rows, v_rows], -1)
        if name == "deepseek":  # (each head's part without positions, then the rotating part, the keys' shared)
            nope = cfg.qk_nope_head_dim
            q_rot, k_rot = (x[0].transpose(0, 1) for x in rotated[sum(rope[:layer])])
            q = torch.cat([raw[p + "q"].view(t, heads, -1)[..., :nope], q_rot], -1)
            kv = qkv.view(t, heads, nope + cfg.v_head_dim)
            k, v = torch.cat([kv[..., :nope], k_rot.expand(-1, heads, -1)], -1), kv[..., nope:]
        elif name in ("gpt2", "mpt") and getattr(cfg, "multi_query", True):  # ([q | k | v]; multi-query GPTBigCode's
            sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]  # k, v one head each)
            q, k, v = (x.view(t, -1, head_dim) for x in qkv.split(sizes, dim=-1))
            clip = getattr(cfg, "attn_config", None) and cfg.attn_config.clip_qkv  # (MPT clamps Wqkv's output)
            q, k, v = (x.clamp(-clip, clip) for x in (q, k, v)) if clip else (q, k, v)
        elif name in ("bloom", "gpt2") or name == "falcon" and not rope[layer]:  # (per head: q, k, v; GPTBigCode's
            q, k, v = qkv.view(t, heads, 3, head_dim).unbind(2)  # without multi_query too, Falcon-RW's)
        else:
            if p + "q_normed" in raw:  # (Hunyuan, nanochat: their q/k norms after rotary)
                q, k = (raw[p + f"{x}_normed"][0].transpose(0, 1) for x in ("q", "k"))
            elif p + "qk_normed" in raw:  # (Llama 4: its norm's two calls, [T, H, d])
                q, k = raw[p + "qk_normed"]
            elif rope[layer] and name.startswith("llama4"):  # (its rotary's [B, T, H, d])
                q, k = (x[0] for x in rotated[sum(rope[:layer])])
            elif rope[layer]:  # (the rotary calls of the layers that have one, in order)
                q, k = (None if x is None else x[0].transpose(0, 1) for x in rotated[sum(rope[:layer])])
                if name in PARTIAL_ROTARY:  # they rotate the leading dims alone: the rest as projected
                    dim = q.shape[-1]
                    q = torch.cat([q, raw[p + "q"].view(t, heads, head_dim)[..., dim:]], -1)
                    k = torch.cat([k, raw[p + "k"].view(t, kv_heads, head_dim)[..., dim:]], -1)
            else:  # (SmolLM3's NoPE layers call no rotary: q and k are the projections)
                q, k = raw[p + "q"].reshape(t, heads, head_dim), raw[p + "k"].reshape(t, kv_heads, head_dim)
            if qkv is None:
                v = None
            elif name in ("gpt_neox", "falcon") or name.startswith("persimmon"):  # (grouped by key-value head: its
                # queries, its key, its value)
                v = qkv.view(t, kv_heads, -1, head_dim)[:, :, -1]
            elif name.startswith("gemma4"):  # (v_norm's output, [1, T, H_kv, d])
                v = qkv[0]
            else:  # v_proj's output, or the tail of Phi-3's fused qkv_proj
                v = qkv[:, -kv_heads * head_dim :].reshape(t, kv_heads, head_dim)
            clip = getattr(cfg, "clip_qkv", None)  # (OLMoE clamps v_proj's output in place, after the hook saw it)
            clip = cfg.attn_config.clip_qkv if cfg.model_type == "dbrx" else clip  # (DBRX clamps Wqkv's output)
            v = v if clip is None else v.clamp(-clip, clip)
        got[p + "attn.hook_q"] = q
        if p + "q_and_gate" in raw:
            got[p + "attn.hook_gate"] = raw[p + "q_and_gate"].view(t, heads, 2 * head_dim)[..., head_dim:]
        elif p + "attn.hook_gate" in got:
            got[p + "attn.hook_gate"] = got[p + "attn.hook_gate"].view(t, heads, -1)
        if own_kv[layer]:
            got[p + "attn.hook_k"], got[p + "attn.hook_v"] = k, v
        if patterns:
            scores, probs = (x[0].transpose(0, 1) for x in softmaxes[sum(attends[:layer])])
            sinks = getattr(blocks[layer].get_submodule(fam.attn), "sinks", None)
            if sinks is not None and cfg.model_type in ("granite_swa", "granitemoe_swa"):  # (its softmax has no sink:
                # the output is scaled by sigmoid(logsumexp(scores) - sink), the weights' sum a sink would leave)
                probs = probs * torch.sigmoid(torch.logsumexp(scores, -1) - sinks).unsqueeze(-1)
            elif sinks is not None:  # gpt-oss: the softmax saw [scores, sink] less their maximum, sink - maximum last
                scores = scores[..., :-1] + (sinks - scores[..., -1]).unsqueeze(-1)
                probs = probs[..., :-1]
            if name == "mpt":  # (HF measures its ALiBi from the forward's last key, vlens's taps from each query:
                slopes = -build_mpt_alibi_tensor(heads, 2)[:, 0, 0]  # a constant a row, which the softmax ignores)
                scores = scores + (t - 1 - torch.arange(t))[:, None, None] * slopes[:, None]
            got[p + "attn.hook_attn_scores"] = scores.masked_fill(scores < -1e30, float("-inf"))  # masked: -inf
            got[p + "attn.hook_pattern"] = probs.to(q.dtype)
    return got


def rows_shape(shape: tuple, n: int) -> tuple[int, ...]:
    """The shape of a hook's rows for one n-token sequence traced whole: its per-token shape, with the
    context dimension of attention scores and patterns as wide as the sequence."""
    return (n, *(n if d == CTX else d for d in shape))


def same(value: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    """Within `tol` (relative, in float64), with attention scores' -inf (forbidden keys) at the same places."""
    masked = torch.isinf(ref)
    if not torch.equal(torch.isinf(value), masked):
        return False
    a, b = value[~masked].double(), ref[~masked].double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() <= tol


def layer_hooks(layers: Iterable[int]) -> list[str]:
    return [f"blocks.{layer}.{kind}" for layer in layers for kind in LAYER_KINDS]


def generate_with_hook(hf, tok, prompt: str, module, hook, n: int = 6) -> tuple[list[int], torch.Tensor]:
    """HF greedy tokens for `prompt` with forward hook `hook` on `module`, and the logits of the whole
    sequence under the same hook: the reference of steering, ablation and SAE edits."""
    handle = module.register_forward_hook(hook)
    try:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            g = hf.generate(ids, max_new_tokens=n, do_sample=False)
            logits = hf(g[:, :-1]).logits[0]
        return g[0, ids.shape[1] :].tolist(), logits
    finally:
        handle.remove()
