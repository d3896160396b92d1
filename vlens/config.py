"""Model description: one flat dataclass of per-architecture flags, read from a Hugging Face config.

Like litgpt, architectures differ by flags (norm kind, biases, soft-capping, parallel residual,
experts), not by subclasses of the config; `family` picks the model code (vlens.models), and the
model code reads only this dataclass, never the HF config object.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlens.distributed.parallel import SINGLE, Parallel


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture vlens has no model code for."""


def _gemma(hf: Any) -> dict[str, Any]:
    if getattr(hf, "use_bidirectional_attention", False):  # EmbeddingGemma: not a causal LM
        raise UnsupportedModelError("use_bidirectional_attention=True is not supported; vlens runs causal LMs")
    return dict(
        hidden_act=hf.hidden_activation,
        attn_scale=hf.query_pre_attn_scalar**-0.5,
        final_softcap=hf.final_logit_softcapping,
    )


def _gemma4(hf: Any) -> dict[str, Any]:
    """Gemma 4: its full-attention layers have heads of their own size (`global_head_dim`) and, where keys are
    values (`attention_k_eq_v`), their own number of key-value heads; scores are not scaled (q/k norms take the
    place of 1/sqrt(d)); the full layers' rotary turns a fraction of each head's frequency pairs ("proportional"
    rope). E2B and E4B: per-layer embeddings, and the last `num_kv_shared_layers` layers attend to the keys and
    values of the last earlier layer of their kind (with MLPs twice as wide where `use_double_wide_mlp`). 26B-A4B:
    routed experts beside each layer's MLP."""
    if hf.use_bidirectional_attention == "all":  # ("vision": images attend both ways, text causally, as vlens runs it)
        raise UnsupportedModelError("use_bidirectional_attention='all' is not supported for Gemma 4: vlens runs its "
                                    "causal text model")  # fmt: skip
    n, kinds = hf.num_hidden_layers, hf.layer_types
    layers = [hf.per_layer_config[i] for i in range(n)]
    # (the last num_kv_shared_layers layers reuse an earlier layer's keys and values: what newer transformers spell
    # out as kv_sharing_modes, older ones compute in each layer)
    shared = [i >= n - hf.num_kv_shared_layers for i in range(n)]
    # (a shared layer reads the keys and values of the last unshared layer of its kind, as HF's KVSharingDict keeps
    # them)
    source = {kind: max(i for i in range(n) if kinds[i] == kind and not shared[i]) for kind in set(kinds)}
    fields = dict(
        hidden_act=hf.hidden_activation,
        attn_scale=1.0,
        final_softcap=hf.final_logit_softcapping,
        layer_head_dims=tuple(c.head_dim for c in layers),
        layer_kv_heads=tuple(c.num_key_value_heads for c in layers),
        keys_are_values=tuple(hf.attention_k_eq_v and kind == "full_attention" for kind in kinds),
        # (each layer rotates its whole head; the full layers' rope gives some of its frequency pairs none)
        rotary_dim=_global(hf, "head_dim"),
        kv_layers=tuple(source[kinds[i]] if shared[i] else i for i in range(n)),
    )
    if hf.use_double_wide_mlp and any(shared):
        fields["layer_intermediate_sizes"] = tuple(hf.intermediate_size * (2 if s else 1) for s in shared)
    # (the 12B's config, Gemma4UnifiedTextConfig, has no per-layer embeddings and no MoE fields at all)
    if getattr(hf, "hidden_size_per_layer_input", 0):
        fields |= dict(per_layer_input_size=hf.hidden_size_per_layer_input,
                       per_layer_vocab_size=hf.vocab_size_per_layer_input)  # fmt: skip
    if getattr(hf, "enable_moe_block", False):
        fields |= dict(num_experts=hf.num_experts, experts_per_token=hf.top_k_experts, moe_layers=(True,) * n,
                       moe_intermediate_size=hf.moe_intermediate_size, experts_beside_mlp=True)  # fmt: skip
    return fields


def _qwen3_5(hf: Any) -> dict[str, Any]:
    """Qwen 3.5: three layers in four a gated delta net (linear attention over a recurrent state, after a short
    causal convolution), the fourth gated full attention over a quarter-rotary head."""
    return dict(
        linear_layers=tuple(kind == "linear_attention" for kind in hf.layer_types),
        linear_key_heads=hf.linear_num_key_heads,
        linear_value_heads=hf.linear_num_value_heads,
        linear_key_dim=hf.linear_key_head_dim,
        linear_value_dim=hf.linear_value_head_dim,
        linear_conv_kernel=hf.linear_conv_kernel_dim,
    )


def _qwen3_5_moe(hf: Any) -> dict[str, Any]:
    """Qwen 3.5's MoE models (35B-A3B, 122B-A10B, 397B-A17B): its layers with Qwen2-MoE's experts on every layer,
    the top k of the router's softmax renormalised, beside a shared expert behind a sigmoid gate."""
    return _qwen3_5(hf) | dict(
        intermediate_size=hf.moe_intermediate_size,  # (no dense MLP; TransformerLens's d_mlp of an MoE is an expert's)
        num_experts=hf.num_experts,
        experts_per_token=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
        moe_layers=(True,) * hf.num_hidden_layers,
    )


def _olmo_hybrid(hf: Any) -> dict[str, Any]:
    """OLMo Hybrid: OLMo 3's attention layers (post-norms alone) among gated delta nets in Llama's layer (pre-norms
    alone); rotary on the attention layers where the config has a base (none: no positions)."""
    linear = tuple(kind == "linear_attention" for kind in hf.layer_types)
    theta = (hf.rope_parameters or {}).get("rope_theta")
    return dict(
        linear_layers=linear,
        post_norm_layers=tuple(not x for x in linear),
        linear_key_heads=hf.linear_num_key_heads,
        linear_key_dim=hf.linear_key_head_dim,
        linear_value_heads=hf.linear_num_value_heads,
        linear_value_dim=hf.linear_value_head_dim,
        linear_conv_kernel=hf.linear_conv_kernel_dim,
        linear_beta_scale=2.0 if hf.linear_allow_neg_eigval else 1.0,
        **({} if theta is not None else dict(rotary_dim=0)),
    )


def _qwen3_next(hf: Any) -> dict[str, Any]:
    """Qwen3-Next (80B-A3B): Qwen 3.5's layers, with Qwen2-MoE's experts and their checkpoint's projections of a
    linear layer fused and grouped by key head (`linear_stored_grouped`)."""
    return _qwen3_5(hf) | _qwen_moe(hf) | dict(linear_stored_grouped=True)


def _lfm2(hf: Any) -> dict[str, Any]:
    """LFM2 (Liquid): gated short convolutions on most layers, attention on the others (`layer_types`); the MLP's
    width adjusted from the config's as HF adjusts it (two thirds, times a multiplier, rounded up to a multiple)."""
    size = hf.intermediate_size
    if hf.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if hf.block_ffn_dim_multiplier is not None:
            size = int(hf.block_ffn_dim_multiplier * size)
            size = hf.block_multiple_of * -(-size // hf.block_multiple_of)
    return _lfm2_layers(hf) | dict(intermediate_size=size)


def _lfm2_layers(hf: Any) -> dict[str, Any]:
    return dict(
        norm_eps=hf.norm_eps,
        conv_layers=tuple(kind == "conv" for kind in hf.layer_types),
        conv_kernel=hf.conv_L_cache,
        conv_bias=bool(hf.conv_bias),
    )


def _lfm3(hf: Any) -> dict[str, Any]:
    """LFM3 (Liquid): LFM2's layers, attention with a gate a head (use_attention_gate), windows on its
    sliding-attention layers, each layer kind its rope (the full layers' proportional: every head rotates, some of its
    pairs at frequency 0; cos and sin in float32), each sublayer's output normed before the add (use_sandwich_norm)."""
    head_dim = _global(hf, "head_dim") or hf.hidden_size // hf.num_attention_heads
    return _lfm2_layers(hf) | dict(post_norms=bool(hf.use_sandwich_norm), rotary_dim=head_dim,
                                   attn_gate_width=1 if hf.use_attention_gate else 0)  # fmt: skip


def _lfm2_moe(hf: Any) -> dict[str, Any]:
    """LFM2's MoE models (8B-A1B): LFM2's layers, the first `num_dense_layers` with its MLP, the others routed experts
    scored by the sigmoid of the router's logits, chosen by the score plus a learned bias per expert."""
    n = hf.num_hidden_layers
    return _lfm2_layers(hf) | dict(
        num_experts=hf.num_experts,
        experts_per_token=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=bool(hf.norm_topk_prob),
        moe_layers=tuple(i >= hf.num_dense_layers for i in range(n)),
        sigmoid_routing=True,
        expert_bias=bool(hf.use_expert_bias),
        routed_scaling=float(hf.routed_scaling_factor),
    )


def _bamba(hf: Any) -> dict[str, Any]:
    """Bamba (IBM): Mamba 2 mixers on most layers, attention over half-rotary heads on `attn_layer_indices`."""
    return _mamba2(hf) | dict(mlp_bias=bool(hf.mlp_bias))


def _granite_hybrid(hf: Any) -> dict[str, Any]:
    """Granite 4.0 (GraniteMoeHybrid): Granite's multipliers, Mamba 2 mixers on the layers `layer_types` marks
    "mamba", attention without positions unless `position_embedding_type` is "rope", a shared MLP on every layer and
    routed experts beside it where `num_local_experts`."""
    experts = hf.num_local_experts
    fields = _granite_multipliers(hf) | _mamba2(hf) | dict(intermediate_size=hf.shared_intermediate_size)
    if hf.position_embedding_type != "rope":
        fields["rotary_dim"] = 0
    if experts:  # (the shared MLP beside them, as Qwen2-MoE's shared expert; TransformerLens's d_mlp an expert's)
        fields |= _granite_moe(hf) | dict(intermediate_size=hf.intermediate_size)
    return fields


def _granite_moe(hf: Any) -> dict[str, Any]:
    """Granite 3.0/3.1's MoE models (GraniteMoe; GraniteMoeShared with a shared MLP beside the experts): Granite's
    multipliers, the top k of the router's logits softmaxed, on every layer."""
    return _granite_multipliers(hf) | dict(
        num_experts=hf.num_local_experts,
        experts_per_token=hf.num_experts_per_tok,
        moe_layers=(True,) * hf.num_hidden_layers,
        moe_intermediate_size=hf.intermediate_size,
        softmax_after_topk=True,
        shared_expert_intermediate_size=getattr(hf, "shared_intermediate_size", 0),
    )


def _mamba2(hf: Any) -> dict[str, Any]:
    """The Mamba 2 mixers' fields (Bamba's and Granite 4's configs spell them alike)."""
    return dict(
        ssm_layers=tuple(kind in ("linear_attention", "mamba") for kind in hf.layers_block_type),
        ssm_heads=hf.mamba_n_heads,
        ssm_head_dim=hf.mamba_d_head,
        ssm_groups=hf.mamba_n_groups,
        ssm_state_size=hf.mamba_d_state,
        ssm_conv_kernel=hf.mamba_d_conv,
        ssm_conv_bias=bool(hf.mamba_conv_bias),
        ssm_proj_bias=bool(hf.mamba_proj_bias),
        ssm_dt_limit=tuple(hf.time_step_limit or (0.0, float("inf"))),
    )


def _mamba(hf: Any) -> dict[str, Any]:
    """Mamba (state-spaces/mamba-*): every layer a Mamba mixer alone, no attention and no MLP: its selective scan
    keeps a state per channel and state dimension, the time step made by a low-rank projection. No position limit
    but the 2,048 tokens it was trained on (max_model_len raises it)."""
    n = hf.num_hidden_layers
    return _mixer_only(hf) | dict(
        hidden_states_after_layers=True,
        ssm_inner=hf.intermediate_size,
        ssm_dt_rank=int(hf.time_step_rank),
        ssm_state_size=hf.state_size,
        ssm_conv_kernel=hf.conv_kernel,
        ssm_conv_bias=bool(hf.use_conv_bias),
        ssm_proj_bias=bool(hf.use_bias),
        ssm_layers=(True,) * n,
    )


def _falcon_mamba(hf: Any) -> dict[str, Any]:
    """Falcon Mamba: Mamba's layers, the time step's low-rank input, B and C RMS-normalised without weights."""
    return _mamba(hf) | dict(ssm_bcdt_norm_eps=hf.mixer_rms_eps)


def _jamba(hf: Any) -> dict[str, Any]:
    """Jamba (AI21): Bamba's layer with Mamba's selective scan (its time step's input, B and C RMS-normed with weights)
    on most layers, attention without positions on every `attn_layer_period`-th, and routed experts (the top k of the
    router's softmax, not renormalised, rounded to the model's dtype) in place of the MLP on every
    `expert_layer_period`-th."""
    n = hf.num_hidden_layers
    return dict(
        ssm_layers=tuple(kind == "mamba" for kind in hf.layers_block_type),
        ssm_inner=hf.mamba_expand * hf.hidden_size,
        ssm_dt_rank=int(hf.mamba_dt_rank),
        ssm_state_size=hf.mamba_d_state,
        ssm_conv_kernel=hf.mamba_d_conv,
        ssm_conv_bias=bool(hf.mamba_conv_bias),
        ssm_proj_bias=bool(hf.mamba_proj_bias),
        ssm_bcdt_norm_eps=hf.rms_norm_eps,
        ssm_bcdt_norm_weights=True,
        rotary_dim=0,
        num_experts=hf.num_experts,
        experts_per_token=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        norm_topk_prob=False,
        round_routing_weights=True,
        moe_layers=tuple(hf.layers_num_experts[i] > 1 for i in range(n)),
    )


def _falcon_h1(hf: Any) -> dict[str, Any]:
    """Falcon-H1 (TII): Bamba's layer with attention and a Mamba 2 mixer side by side on every layer (their outputs
    summed), and µP multipliers throughout (see ModelConfig: mixer_multipliers and the rest); rotary attention."""
    return dict(
        parallel_mixers=True,
        ssm_heads=hf.mamba_n_heads,
        ssm_head_dim=hf.mamba_d_head,
        ssm_groups=hf.mamba_n_groups,
        ssm_state_size=hf.mamba_d_state,
        ssm_conv_kernel=hf.mamba_d_conv,
        ssm_conv_bias=bool(hf.mamba_conv_bias),
        ssm_proj_bias=bool(hf.mamba_proj_bias),
        ssm_out_bias=bool(hf.projectors_bias),
        ssm_dt_limit=tuple(hf.time_step_limit or (0.0, float("inf"))),
        ssm_norm=("norm_then_gate" if hf.mamba_norm_before_gate else "gate_then_norm_float") if hf.mamba_rms_norm
        else "gate",
        mixer_multipliers=(float(hf.attention_in_multiplier), float(hf.attention_out_multiplier),
                           float(hf.ssm_in_multiplier), float(hf.ssm_out_multiplier)),
        key_multiplier=float(hf.key_multiplier),
        ssm_multipliers=tuple(map(float, hf.ssm_multipliers)),
        mlp_multipliers=tuple(map(float, hf.mlp_multipliers)),
        embedding_multiplier=float(hf.embedding_multiplier),
        logit_scale=float(hf.lm_head_multiplier),
        mlp_bias=bool(hf.mlp_bias),
    )  # fmt: skip


def _mamba2_only(hf: Any) -> dict[str, Any]:
    """Mamba 2 (Mamba-Codestral, mamba2-*): every layer a Mamba 2 mixer alone (Bamba's), no attention and no MLP."""
    return _mixer_only(hf) | dict(
        ssm_layers=(True,) * hf.num_hidden_layers,
        ssm_heads=hf.num_heads,
        ssm_head_dim=hf.head_dim,
        ssm_groups=hf.n_groups,
        ssm_state_size=hf.state_size,
        ssm_conv_kernel=hf.conv_kernel,
        ssm_conv_bias=bool(hf.use_conv_bias),
        ssm_proj_bias=bool(hf.use_bias),
        ssm_dt_limit=tuple(hf.time_step_limit or (0.0, float("inf"))),
    )


def _nemotron_h(hf: Any) -> dict[str, Any]:
    """Nemotron-H (NVIDIA: Nemotron-H 8B-56B, Nemotron Nano 2): each layer one part alone after its norm (`layer_types`
    or the checkpoint's `hybrid_override_pattern`): a Mamba 2 mixer (M), attention without positions (*) or an MLP of
    squared ReLUs, not gated (-), or (E, Nemotron 3) routed experts of the same kind beside a shared one, chosen by
    the sigmoids of a float32 router plus a correction bias per expert; norms that scale in float32."""
    kinds = hf.layers_block_type
    fields: dict[str, Any] = {}
    if "moe" in kinds:
        if hf.moe_latent_size is not None:  # (latent projections around the experts)
            raise UnsupportedModelError(f"moe_latent_size={hf.moe_latent_size!r} is not supported for "
                                        "NemotronHForCausalLM (no Nemotron 3 that vlens was checked against has it)")
        fields = _sigmoid_experts(hf, hf.moe_shared_expert_intermediate_size * hf.n_shared_experts)
        fields["moe_layers"] = tuple(kind == "moe" for kind in kinds)
    return fields | dict(
        layer_parts=tuple("mlp" if kind in ("mlp", "moe") else "mixer" for kind in kinds),
        ssm_layers=tuple(kind == "linear_attention" for kind in kinds),
        ssm_heads=hf.mamba_num_heads,
        ssm_head_dim=hf.mamba_head_dim,
        ssm_groups=hf.n_groups,
        ssm_state_size=hf.ssm_state_size,
        ssm_conv_kernel=hf.conv_kernel,
        ssm_conv_bias=bool(hf.use_conv_bias),
        ssm_proj_bias=bool(hf.use_bias),
        ssm_dt_limit=tuple(hf.time_step_limit or (0.0, float("inf"))),
        ssm_hidden_act=hf.mamba_hidden_act,
        hidden_act=hf.mlp_hidden_act,
        mlp_bias=bool(hf.mlp_bias),
        norm_eps=hf.layer_norm_epsilon,
        rotary_dim=0,
    )


def _glm4_moe(hf: Any) -> dict[str, Any]:
    """GLM-4.5, 4.6, 4.7 (Glm4Moe): GLM's attention (q/k/v biases, rotary over half of each head, by halves here, not
    pairs), q/k norms head by head where `use_qk_norm`, a dense MLP on the first `first_k_dense_replace` layers and on
    the rest DeepSeek-V3's routed experts beside a shared expert."""
    # (GLM-4.5V's text config has no use_qk_norm: none)
    return _dense_then_experts(hf) | dict(qk_norm="head" if getattr(hf, "use_qk_norm", False) else "")


def _dense_then_experts(hf: Any) -> dict[str, Any]:
    """A dense MLP on the first `first_k_dense_replace` layers (or those `mlp_layer_types` calls "dense":
    GLM-4.7-Flash), DeepSeek-V3's routed experts beside shared ones (of `n_shared_experts` times an expert's width) on
    the rest (GLM-4.5, DeepSeek-V3, dots.llm1)."""
    types = getattr(hf, "mlp_layer_types", None)
    moe_layers = tuple(t == "sparse" for t in types) if types else tuple(
        i >= hf.first_k_dense_replace for i in range(hf.num_hidden_layers))  # fmt: skip
    # (K-EXAONE's config names the shared experts and the routed ones num_shared_experts and num_experts)
    shared = hf.n_shared_experts if hasattr(hf, "n_shared_experts") else hf.num_shared_experts
    return _sigmoid_experts(hf, hf.moe_intermediate_size * shared) | dict(moe_layers=moe_layers)


def _sigmoid_experts(hf: Any, shared_size: int) -> dict[str, Any]:
    """DeepSeek-V3's routed experts (GLM-4.5's, Nemotron 3's, K-EXAONE's and AFMoE's, whose configs call them
    num_experts, AFMoE's scale route_scale, renormalising always; vlens.layers.moe.DeepseekMoE): each token's top k by
    the sigmoid of a float32 router's logits plus a correction bias per expert, within its best groups of experts, their
    sigmoids renormalised and scaled, beside a shared expert of `shared_size`."""
    return dict(
        num_experts=hf.n_routed_experts if hasattr(hf, "n_routed_experts") else hf.num_experts,
        experts_per_token=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)),
        shared_expert_intermediate_size=shared_size,
        sigmoid_routing=True,
        expert_bias=True,
        routed_scaling=float(hf.route_scale if hasattr(hf, "route_scale") else hf.routed_scaling_factor),
        sigmoid_norm_eps=1e-20,
        deepseek_moe=True,
        expert_groups=_expert_groups(hf),
        group_scores_top2=True,
    )


def _expert_groups(hf: Any) -> tuple[int, int]:
    """(groups, the best of them a token's experts come from); (1, 1) where routing is not limited to some."""
    groups, kept = getattr(hf, "n_group", None) or 1, getattr(hf, "topk_group", None) or 1
    return (groups, kept) if kept < groups else (1, 1)


def _deepseek(hf: Any) -> dict[str, Any]:
    """DeepSeek-V2 and V3 (V3.1, R1, Kimi K2, Moonlight): Llama's layer with multi-head latent attention (queries and
    keys of their no-position dims, then the rotating ones; values of their own size; the softmax scale YaRN's
    mscale_all_dim squared times 1/sqrt(q's head size)) and, past the first `first_k_dense_replace` layers,
    DeepSeek's routed experts beside shared ones: V3's by sigmoids (_sigmoid_experts),
    V2's by a float32 softmax, neither renormalised (HF's V2 never renormalises), scaled by routed_scaling_factor;
    V2 rotates by pairs in float32 (HF's complex product), V3 by pairs laid out by halves (rope_interleave) or by
    halves."""
    v3 = hf.model_type != "deepseek_v2"
    head_dim = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    if hf.v_head_dim > head_dim:  # (the values are padded to the keys' size, vlens.layers.attention)
        raise UnsupportedModelError(f"v_head_dim={hf.v_head_dim} larger than qk_nope_head_dim + qk_rope_head_dim="
                                    f"{head_dim} is not supported for {hf.architectures[0]}")
    scale, rope = head_dim**-0.5, dict(hf.rope_parameters or {})
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1 if rope["factor"] > 1 else 1.0
        scale *= mscale * mscale
    fields = dict(head_dim=head_dim, rotary_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
                  kv_lora_rank=hf.kv_lora_rank, q_lora_rank=hf.q_lora_rank or 0, num_kv_heads=hf.num_attention_heads,
                  attn_scale=scale)  # fmt: skip
    if v3:  # (MiniCPM3's config has no rope_interleave: by halves)
        fields |= dict(rotary_interleaved=bool(getattr(hf, "rope_interleave", False)))
    else:
        fields |= dict(rotary_pairs=True, rope_float32=True)
    if not getattr(hf, "n_routed_experts", 0):  # (Youtu-LLM: a dense MLP on every layer)
        return fields
    experts = _dense_then_experts(hf)
    if not v3:  # (V2's "greedy" or "group_limited_greedy": the groups' scores their best softmax)
        experts |= dict(sigmoid_routing=False, expert_bias=False, norm_topk_prob=False, group_scores_top2=False,
                        expert_groups=_expert_groups(hf) if hf.topk_method == "group_limited_greedy" else (1, 1))
    return fields | experts


def _minicpm3(hf: Any) -> dict[str, Any]:
    """MiniCPM3 (OpenBMB): DeepSeek-V2's latent attention (its rotary by halves) in Llama's layer with µP's scales:
    the embedding times scale_emb, each sublayer's output times scale_depth / sqrt(layers), the logits divided by
    hidden_size / dim_model_base."""
    return _deepseek(hf) | dict(embedding_multiplier=float(hf.scale_emb),
                                residual_multiplier=hf.scale_depth / math.sqrt(hf.num_hidden_layers),
                                logits_scaling=hf.hidden_size / hf.dim_model_base)  # fmt: skip


def _mistral4(hf: Any) -> dict[str, Any]:
    """Mistral 4: DeepSeek-V3's latent attention with Llama 4's attention temperature on q (Ministral 3's), and
    DeepSeek's experts chosen by the softmax of the router's logits (no correction bias; both in the model's dtype),
    within each token's best groups of experts, a group scored by its best two."""
    rope = hf.rope_parameters or {}
    beta = rope.get("llama_4_scaling_beta")
    return _deepseek(hf) | dict(sigmoid_routing=False, expert_bias=False, router_model_dtype=True,
                                attn_temperature=(beta, rope["original_max_position_embeddings"]) if beta else None)


def _minimax_m2(hf: Any) -> dict[str, Any]:
    """MiniMax-M2 (M2, M2.1, M2.5): Llama's layer with q/k norms over each whole projection, partial rotary, and on
    every layer routed experts alone (no shared one) chosen by the float32 sigmoids of the router's logits plus a
    correction bias per expert, those sigmoids renormalised."""
    return dict(num_experts=hf.num_local_experts, experts_per_token=hf.num_experts_per_tok,
                moe_intermediate_size=hf.intermediate_size, norm_topk_prob=True, sigmoid_routing=True,
                sigmoid_float32=True, expert_bias=True, sigmoid_norm_eps=0.0,
                moe_layers=(True,) * hf.num_hidden_layers)  # fmt: skip


def _mixer_only(hf: Any) -> dict[str, Any]:
    """What the Mamba models share: a layer is its mixer alone, no attention heads, no rotary, RMS norms."""
    return dict(
        layer_parts=("mixer",) * hf.num_hidden_layers,
        residual_float32=bool(hf.residual_in_fp32),
        intermediate_size=0,
        num_heads=0,
        num_kv_heads=0,
        head_dim=0,
        rotary_dim=0,
        norm_eps=hf.layer_norm_epsilon,
        max_position_embeddings=2048,
    )


def _granite(hf: Any) -> dict[str, Any]:
    """Granite (IBM, 3.x): Llama's layer with four multipliers (on the embeddings, the attention scores in place of
    1/sqrt(d), each sublayer's output, and the logits, which are divided by theirs)."""
    return _granite_multipliers(hf) | dict(mlp_bias=bool(hf.mlp_bias))


def _hyperclovax(hf: Any) -> dict[str, Any]:
    """HyperCLOVA X (Naver): Granite's multipliers, its logits times logits_scaling (not divided by it), its sublayers'
    outputs normed before the add where use_post_norm."""
    return _granite(hf) | dict(logits_scaling=1.0, logit_scale=float(hf.logits_scaling),
                               post_norms=bool(hf.use_post_norm))  # fmt: skip


def _granite_swa(hf: Any) -> dict[str, Any]:
    """GraniteSWA: Granite's layer with windows on the layers layer_types marks, a sink per head, a rope base per
    layer."""
    return _granite(hf) | _layer_rope_bases(hf)


def _granite_moe_swa(hf: Any) -> dict[str, Any]:
    return _granite_moe(hf) | _layer_rope_bases(hf)


def _layer_rope_bases(hf: Any) -> dict[str, Any]:
    """GraniteSWA's rope base per layer (`layer_rope_theta`; 0: no positions), as vlens's two ropes hold them: one
    base, or one for the windowed layers and one for the rest (Gemma 3's pair); any other mix is refused by name."""
    bases = {kind: {theta for theta, k in zip(hf.layer_rope_theta, hf.layer_types) if theta and k == kind}
             for kind in ("sliding_attention", "full_attention")}  # fmt: skip
    if any(len(b) > 1 for b in bases.values()):
        raise UnsupportedModelError(f"layer_rope_theta={list(hf.layer_rope_theta)!r} is not supported for "
                                    f"{hf.architectures[0]}: vlens takes one rope base for the windowed layers and one "
                                    "for the rest")  # fmt: skip
    windowed, full = (next(iter(bases[kind]), None) for kind in ("sliding_attention", "full_attention"))
    theta, scaling = _rope(dict(hf.rope_parameters), hf)
    fields = dict(nope_layers=tuple(not theta for theta in hf.layer_rope_theta), rope_theta=full or windowed or theta)
    if windowed and full and windowed != full:
        fields |= dict(sliding_rope_theta=float(windowed), sliding_rope_scaling=scaling)
    return fields


def _granite_multipliers(hf: Any) -> dict[str, Any]:
    return dict(
        attn_scale=float(hf.attention_multiplier),
        embedding_multiplier=float(hf.embedding_multiplier),
        residual_multiplier=float(hf.residual_multiplier),
        logits_scaling=float(hf.logits_scaling),
    )


def _gemma2(hf: Any) -> dict[str, Any]:
    return _gemma(hf) | dict(attn_softcap=hf.attn_logit_softcapping)


def _gpt2_spelling(hf: Any) -> dict[str, Any]:
    """The fields GPT-2's config (and GPT-J's) names its own way."""
    return dict(
        intermediate_size=hf.n_inner or 4 * hf.hidden_size,
        hidden_act=hf.activation_function,
        norm_eps=hf.layer_norm_epsilon,
    )


def _gpt2(hf: Any) -> dict[str, Any]:
    head_dim = hf.hidden_size // hf.num_attention_heads
    return _gpt2_spelling(hf) | dict(
        attn_scale=head_dim**-0.5 if hf.scale_attn_weights else 1.0,
        # (GPTBigCode's config has no such flag)
        attn_scale_inverse_layer=bool(getattr(hf, "scale_attn_by_inverse_layer_idx", False)),
    )


def _gpt_neo(hf: Any) -> dict[str, Any]:
    """GPT-Neo: unscaled scores; a window on the layers `attention_types` marks local."""
    return dict(
        intermediate_size=hf.intermediate_size or 4 * hf.hidden_size,
        hidden_act=hf.activation_function,
        norm_eps=hf.layer_norm_epsilon,
        attn_scale=1.0,
        sliding_windows=tuple(hf.window_size if kind == "local" else None for kind in hf.attention_layers),
    )


def _opt(hf: Any) -> dict[str, Any]:
    """OPT: queries scaled after their projection (the scores then unscaled); OPT-350M's norms after each sublayer
    and its projected embeddings are refused by name, as are LayerNorms without weights."""
    for flag, value in (("do_layer_norm_before", hf.do_layer_norm_before is False),
                        ("word_embed_proj_dim", (hf.word_embed_proj_dim or hf.hidden_size) != hf.hidden_size),
                        ("layer_norm_elementwise_affine", hf.layer_norm_elementwise_affine is False),
                        ("_remove_final_layer_norm", hf._remove_final_layer_norm)):  # fmt: skip
        if value:
            raise UnsupportedModelError(f"{flag}={getattr(hf, flag)!r} is not supported for OPTForCausalLM (OPT-350M's "
                                        "layout; vlens runs the pre-norm OPT models)")  # fmt: skip
    bias = bool(hf.enable_bias)
    return dict(
        intermediate_size=hf.ffn_dim,
        hidden_act=hf.activation_function,
        norm_eps=1e-5,  # (torch's LayerNorm default, which HF's OPT keeps)
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        attn_scale=1.0,
        query_scale=(hf.hidden_size // hf.num_attention_heads) ** -0.5,
    )


def _xglm(hf: Any) -> dict[str, Any]:
    """XGLM: OPT's layer (queries scaled after their projection), the embedding times sqrt(d) where scale_embedding."""
    return dict(
        intermediate_size=hf.ffn_dim,
        hidden_act=hf.activation_function,
        norm_eps=1e-5,  # (torch's LayerNorm default, which HF's XGLM keeps)
        attn_scale=1.0,
        query_scale=(hf.d_model // hf.attention_heads) ** -0.5,
        embedding_multiplier=math.sqrt(hf.d_model) if hf.scale_embedding else 1.0,
    )


def _biogpt(hf: Any) -> dict[str, Any]:
    """BioGPT: OPT's layer with the scores scaled, the embedding times sqrt(d) where scale_embedding."""
    return dict(
        intermediate_size=hf.intermediate_size,
        hidden_act=hf.hidden_act,
        norm_eps=1e-5,  # (torch's LayerNorm default: HF's BioGPT does not read layer_norm_eps)
        embedding_multiplier=math.sqrt(hf.hidden_size) if hf.scale_embedding else 1.0,
    )


def _bloom(hf: Any) -> dict[str, Any]:
    """BLOOM: ALiBi for positions (no limit but the 2,048 tokens it was trained on, which vlens takes for its
    max_position_embeddings), a GELU of its own; its Megatron-era options are refused by name."""
    for flag in ("apply_residual_connection_post_layernorm", "slow_but_exact"):
        if getattr(hf, flag):
            raise UnsupportedModelError(f"{flag}=True is not supported for BloomForCausalLM (no released BLOOM has it)")
    return dict(
        intermediate_size=4 * hf.hidden_size,
        hidden_act="bloom_gelu",
        rotary_dim=0,
        norm_eps=hf.layer_norm_epsilon,
        max_position_embeddings=2048,
    )


def _gpt_neox(hf: Any) -> dict[str, Any]:
    return dict(
        norm_eps=hf.layer_norm_eps,
        parallel_residual=bool(hf.use_parallel_residual),
        qkv_bias=bool(hf.attention_bias),
        o_bias=bool(hf.attention_bias),
    )


def _gptj(hf: Any) -> dict[str, Any]:
    return _gpt2_spelling(hf) | dict(rotary_dim=hf.rotary_dim or hf.hidden_size // hf.num_attention_heads)


def _falcon(hf: Any) -> dict[str, Any]:
    """Falcon: a parallel residual (the new decoder architecture's always) with one norm or two, or a sequential layer;
    rotary positions or (Falcon-RW) ALiBi; layouts HF cannot run are refused by name."""
    norms = hf.num_ln_in_parallel_attn or (2 if hf.new_decoder_architecture else 1)
    for flag, refused in (("parallel_attn", not hf.parallel_attn and hf.new_decoder_architecture),
                          ("num_ln_in_parallel_attn", norms != 1 and not hf.new_decoder_architecture)):  # fmt: skip
        if refused:
            raise UnsupportedModelError(f"{flag}={getattr(hf, flag)!r} is not supported for FalconForCausalLM (vlens "
                                        "runs Falcon 7B's, 40B's, 180B's, Falcon 2's and Falcon-RW's layouts)")
    bias, parallel = bool(hf.bias), bool(hf.parallel_attn or hf.new_decoder_architecture)
    return dict(
        intermediate_size=hf.ffn_hidden_size,
        hidden_act=hf.activation,
        norm_eps=hf.layer_norm_epsilon,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        parallel_residual=parallel,
        shared_norm=parallel and norms == 1,
        alibi="falcon" if hf.alibi else "",
        rotary_dim=0 if hf.alibi else hf.hidden_size // hf.num_attention_heads,
    )


def _dbrx(hf: Any) -> dict[str, Any]:
    """DBRX: its nested attention and MLP configs read; routed experts on every layer, by the softmax (in the model's
    dtype) of the router's logits, their top k over their p-norm (`moe_normalize_expert_weights`; None: as they are)."""
    attn, ffn = hf.attn_config, hf.ffn_config
    return dict(
        num_kv_heads=attn.kv_n_heads,
        clip_qkv=attn.clip_qkv,
        hidden_act=(ffn.ffn_act_fn or {}).get("name", "silu"),
        intermediate_size=ffn.ffn_hidden_size,
        num_experts=ffn.moe_num_experts,
        experts_per_token=ffn.moe_top_k,
        moe_intermediate_size=ffn.ffn_hidden_size,
        moe_layers=(True,) * hf.num_hidden_layers,
        router_model_dtype=True,
        norm_topk_prob=False,
        norm_topk_pnorm=ffn.moe_normalize_expert_weights,
    )


def _mpt(hf: Any) -> dict[str, Any]:
    """MPT: its attention options HF's MPT does not apply are refused by name (it ignores them, running multi-head
    attention without q/k norms, ALiBi always, at MPT's default slopes)."""
    attn = hf.attn_config
    for flag, refused in (("qk_ln", attn.qk_ln), ("attn_type", attn.attn_type != "multihead_attention"),
                          ("alibi", not attn.alibi), ("expansion_ratio", hf.expansion_ratio != 4)):  # fmt: skip
        if refused:
            value = getattr(attn, flag, None) if flag != "expansion_ratio" else hf.expansion_ratio
            raise UnsupportedModelError(f"{flag}={value!r} is not supported for MptForCausalLM (HF's MPT runs "
                                        "multi-head attention with ALiBi, no q/k norms, an MLP 4x wide)")  # fmt: skip
    return dict(
        intermediate_size=4 * hf.d_model,
        norm_eps=hf.layer_norm_epsilon,
        max_position_embeddings=hf.max_seq_len,
        clip_qkv=attn.clip_qkv,
        attn_scale=attn.softmax_scale,
    )


def _phi(hf: Any) -> dict[str, Any]:
    if hf.qk_layernorm:
        raise UnsupportedModelError("qk_layernorm=True is not supported for PhiForCausalLM (no Phi-1, 1.5 or 2 has it)")
    return dict(norm_eps=hf.layer_norm_eps)


def _llama(hf: Any) -> dict[str, Any]:
    return dict(mlp_bias=bool(hf.mlp_bias))  # the one family whose HF MLP reads it


def _nemotron(hf: Any) -> dict[str, Any]:
    return dict(norm_eps=hf.norm_eps, mlp_bias=bool(hf.mlp_bias))


def _jais2(hf: Any) -> dict[str, Any]:
    return dict(norm_eps=hf.layer_norm_eps, mlp_bias=bool(hf.mlp_bias))


def _afmoe(hf: Any) -> dict[str, Any]:
    """AFMoE: rotary on the sliding-window layers alone; µP's embedding scale where mup_enabled; DeepSeek's experts
    after `num_dense_layers` dense ones, chosen by the float32 sigmoids of the router's logits (the router in the
    model's dtype) plus a bias per expert (the block's expert_bias), renormalised, times route_scale."""
    shared = hf.moe_intermediate_size * hf.num_shared_experts
    return _sigmoid_experts(hf, shared) | dict(
        attn_gate_width=hf.head_dim,
        nope_layers=tuple(kind != "sliding_attention" for kind in hf.layer_types),
        embedding_multiplier=hf.hidden_size**0.5 if hf.mup_enabled else 1.0,
        moe_layers=tuple(i >= hf.num_dense_layers for i in range(hf.num_hidden_layers)),
        sigmoid_float32=True,
        router_model_dtype=True,
    )


def _nanochat(hf: Any) -> dict[str, Any]:
    return dict(final_softcap=hf.final_logit_softcapping)


def _solar_open(hf: Any) -> dict[str, Any]:
    """Solar Open: DeepSeek-V3's routed experts beside a shared one on every layer (no dense MLP)."""
    shared = hf.moe_intermediate_size * hf.n_shared_experts
    return _sigmoid_experts(hf, shared) | dict(intermediate_size=hf.moe_intermediate_size,
                                               moe_layers=(True,) * hf.num_hidden_layers)  # fmt: skip


def _smollm3(hf: Any) -> dict[str, Any]:
    """SmolLM3: rotary only on the layers `no_rope_layers` marks 1 (every fourth has none, by default); windows only
    with use_sliding_window."""
    windows = _sliding_windows(hf) if hf.use_sliding_window else (None,) * hf.num_hidden_layers
    return dict(mlp_bias=bool(hf.mlp_bias), nope_layers=tuple(not rope for rope in hf.no_rope_layers),
                sliding_windows=windows)  # fmt: skip


def _ministral3(hf: Any) -> dict[str, Any]:
    """Ministral 3: Llama 4's attention temperature, q scaled by 1 + beta * log(1 + floor(position / original))."""
    rope = hf.rope_parameters or {}
    beta = rope.get("llama_4_scaling_beta")
    return dict(attn_temperature=(beta, rope["original_max_position_embeddings"]) if beta else None)


def _llama4(hf: Any) -> dict[str, Any]:
    """Llama 4 (Scout, Maverick): Llama's layer, rotary by pairs in float32 (HF's complex product) with q/k normed
    after it (no weight) on the layers that rotate, and on every fourth layer no rotary but a temperature on q; routed
    experts (the top k logits' sigmoids scaling what each chosen expert reads) beside a shared expert on the
    `moe_layers`, a wider dense MLP on the rest. Its layers that rotate (`layer_types` "chunked_attention") attend
    within chunks of `attention_chunk_size` positions (8,192 in the released configs): a query sees the keys of its own
    chunk alone."""
    rotating = [bool(r) for r in hf.no_rope_layers]
    chunk = getattr(hf, "attention_chunk_size", None)
    kinds = getattr(hf, "layer_types", None) or ["chunked_attention" if r else "full_attention" for r in rotating]
    return dict(
        nope_layers=tuple(not r for r in rotating),
        qk_norm="l2_after_rotary" if hf.use_qk_norm else "",
        nope_temperature=(float(hf.attn_scale), int(hf.floor_scale)) if hf.attn_temperature_tuning else None,
        intermediate_size=hf.intermediate_size_mlp,
        num_experts=hf.num_local_experts,
        experts_per_token=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        shared_expert_intermediate_size=hf.intermediate_size,
        norm_topk_prob=False,
        moe_layers=tuple(i in hf.moe_layers for i in range(hf.num_hidden_layers)),
        attention_chunks=tuple(chunk if kind == "chunked_attention" else None for kind in kinds) if chunk else (),
    )


def _cohere(hf: Any) -> dict[str, Any]:
    if getattr(hf, "use_qk_norm", False):  # (a LayerNorm of its own for every head: Command R+)
        raise UnsupportedModelError("use_qk_norm=True is not supported for CohereForCausalLM (per-head q/k LayerNorms)")
    return dict(norm_eps=hf.layer_norm_eps, logit_scale=hf.logit_scale)


def _cohere2(hf: Any) -> dict[str, Any]:
    """Cohere 2 (Command R7B, Command A): rotary only on the sliding-window layers; the others have none (NoPE)."""
    return _cohere(hf) | dict(nope_layers=tuple(kind != "sliding_attention" for kind in hf.layer_types))


def _cohere2_moe(hf: Any) -> dict[str, Any]:
    """Cohere 2's MoE models (Cohere2MoeForCausalLM): Cohere 2's parallel layer, its one norm an RMSNorm where the
    config gives rms_norm_eps (Cohere's LayerNorm otherwise); routed experts where `mlp_layer_types` says "sparse" —
    the top k of the router's logits, then their softmax or their sigmoids (renormalised where norm_topk_prob), each
    chosen expert's output weighed — beside shared experts (one MLP `num_shared_experts` experts wide) summed or
    averaged in (`shared_expert_combination_strategy`); the other layers a dense MLP of
    `prefix_dense_intermediate_size`, which rotates where `prefix_dense_sliding_window_pattern` is 1 (HF's
    force_rope), as the sliding-window layers do."""
    dense = [kind == "dense" for kind in hf.mlp_layer_types]
    rotates = [kind == "sliding_attention" or (d and hf.prefix_dense_sliding_window_pattern == 1)
               for kind, d in zip(hf.layer_types, dense)]  # fmt: skip
    rms = hf.rms_norm_eps is not None
    sigmoid = hf.expert_selection_fn == "sigmoid"
    if hf.expert_selection_fn not in ("softmax", "sigmoid"):
        raise UnsupportedModelError(f"expert_selection_fn={hf.expert_selection_fn!r} is not supported for "
                                    "Cohere2MoeForCausalLM; supported: softmax, sigmoid")  # fmt: skip
    return dict(
        norm="rms" if rms else "layer_cohere",
        norm_eps=hf.rms_norm_eps if rms else hf.layer_norm_eps,
        logit_scale=hf.logit_scale,
        nope_layers=tuple(not r for r in rotates),
        intermediate_size=hf.prefix_dense_intermediate_size or hf.intermediate_size,
        num_experts=hf.num_experts,
        experts_per_token=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        moe_layers=tuple(not d for d in dense),
        softmax_after_topk=not sigmoid,
        sigmoid_after_topk=sigmoid,
        norm_topk_prob=sigmoid and bool(hf.norm_topk_prob),
        shared_expert_intermediate_size=hf.intermediate_size * hf.num_shared_experts,
        shared_expert_mix=hf.shared_expert_combination_strategy,
    )


def _exaone4(hf: Any) -> dict[str, Any]:
    """EXAONE 4: with sliding windows, rotary only on the windowed layers (the others NoPE)."""
    if hf.sliding_window is None:
        return {}
    return dict(nope_layers=tuple(kind != "sliding_attention" for kind in hf.layer_types))


def _exaone_moe(hf: Any) -> dict[str, Any]:
    """K-EXAONE (ExaoneMoe): EXAONE 4's attention in a pre-norm layer, DeepSeek-V3's experts where mlp_layer_types
    says "sparse"."""
    return _exaone4(hf) | _dense_then_experts(hf)


def _seed_oss(hf: Any) -> dict[str, Any]:
    """Seed-OSS (ByteDance): Llama's layer, the output projection's bias its own flag."""
    return dict(o_bias=bool(hf.attention_out_bias), mlp_bias=bool(hf.mlp_bias))


def _ernie4_5(hf: Any) -> dict[str, Any]:
    """ERNIE 4.5 (Baidu, dense): one flag for every projection's bias."""
    bias = bool(hf.use_bias)
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bias)


def _ernie4_5_moe(hf: Any) -> dict[str, Any]:
    """ERNIE 4.5's MoE models (21B-A3B, 300B-A47B): the dense model's layer with, on every `moe_layer_interval`-th layer
    from `moe_layer_start_index` to `moe_layer_end_index`, routed experts beside shared ones, chosen by a float32
    router's softmax plus a correction bias per expert, that softmax's top k renormalised (by at least
    `moe_norm_min`) and rounded to the model's dtype; `use_bias` gives the unembedding a bias too (not the dense
    model's)."""
    start, end, every = hf.moe_layer_start_index, hf.moe_layer_end_index, hf.moe_layer_interval
    return _ernie4_5(hf) | dict(
        num_experts=hf.moe_num_experts, experts_per_token=hf.moe_k, moe_intermediate_size=hf.moe_intermediate_size,
        shared_expert_intermediate_size=hf.moe_intermediate_size * hf.moe_num_shared_experts, deepseek_moe=True,
        expert_bias=True, routing_norm_min=float(hf.moe_norm_min), round_routing_weights=True,
        lm_head_bias=bool(hf.use_bias),
        moe_layers=tuple((i + 1) % every == 0 and start <= i <= end for i in range(hf.num_hidden_layers)),
    )  # fmt: skip


def _hunyuan(hf: Any) -> dict[str, Any]:
    """Hunyuan (Tencent, dense): q/k RMS-normed head by head after rotary; its "dynamic" rope with a fixed `alpha` is a
    larger base (NTK alpha), not HF's length-dependent dynamic rope (which stays refused by name)."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    fields: dict[str, Any] = {}
    if rope.get("rope_type") == "dynamic" and rope.get("alpha"):
        fields["rope_scaling"] = {"rope_type": "ntk_alpha", "alpha": float(rope["alpha"])}
    return fields


def _hunyuan_moe(hf: Any) -> dict[str, Any]:
    """Hunyuan's MoE models (Hunyuan-A13B): the dense model's layer with, on every layer, routed experts chosen by a
    float32 router's softmax (`gate.wg`), their top k renormalised, beside a shared MLP (`shared_mlp`), all as wide."""
    if not isinstance(hf.num_experts, int) or not isinstance(hf.moe_topk, int):
        raise UnsupportedModelError(f"num_experts={hf.num_experts!r}, moe_topk={hf.moe_topk!r}: a number per layer is "
                                    "not supported for HunYuanMoEV1ForCausalLM (one for every layer is)")  # fmt: skip
    return _hunyuan(hf) | dict(
        num_experts=hf.num_experts, experts_per_token=hf.moe_topk, moe_intermediate_size=hf.intermediate_size,
        shared_expert_intermediate_size=hf.intermediate_size, deepseek_moe=True,
        moe_layers=(True,) * hf.num_hidden_layers,
    )


def _starcoder2(hf: Any) -> dict[str, Any]:
    bias = bool(hf.use_bias)
    return dict(norm_eps=hf.norm_epsilon, qkv_bias=bias, o_bias=bias, mlp_bias=bias)


def _stablelm(hf: Any) -> dict[str, Any]:
    for flag in ("use_parallel_residual", "qk_layernorm"):  # (StableLM 2 12B: a parallel block, a LayerNorm per head)
        if getattr(hf, flag, False):
            raise UnsupportedModelError(f"{flag}=True is not supported for StableLmForCausalLM")
    return dict(norm_eps=hf.layer_norm_eps, qkv_bias=bool(hf.use_qkv_bias))


def _persimmon(hf: Any) -> dict[str, Any]:
    return dict(norm_eps=hf.layer_norm_eps, qk_norm="head" if hf.qk_layernorm else "")


def _mixtral(hf: Any) -> dict[str, Any]:
    n = hf.num_hidden_layers
    return dict(
        num_experts=hf.num_local_experts,
        experts_per_token=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        moe_layers=(True,) * n,
    )


def _phimoe(hf: Any) -> dict[str, Any]:
    """Phi-3.5-MoE: Mixtral's experts chosen by SparseMixer (two, each by its own masked softmax), LayerNorms, the
    unembedding's bias; LongRoPE as HF's Phimoe runs it: the short factors at every length (it computes them without
    the length), cos and sin times short_mscale (long_mscale past the original context: where they differ, refused
    by name, as a scale that depends on the batch's longest sequence)."""
    if hf.num_experts_per_tok != 2:
        raise UnsupportedModelError(f"num_experts_per_tok={hf.num_experts_per_tok} is not supported for "
                                    "PhimoeForCausalLM (SparseMixer chooses two experts)")  # fmt: skip
    theta, scaling = _rope(dict(hf.rope_parameters), hf)
    if scaling is not None and scaling["rope_type"] == "longrope":
        short, long = scaling.get("short_mscale"), scaling.get("long_mscale")
        if short != long:
            raise UnsupportedModelError(f"long_mscale={long!r} is not supported for PhimoeForCausalLM where it is "
                                        f"not short_mscale ({short!r}): HF scales by the batch's longest sequence")
        scaling |= {"long_factor": scaling["short_factor"]} | ({} if short is None else {"attention_factor": short})
    return _mixtral(hf) | dict(norm_eps=hf.rms_norm_eps, lm_head_bias=bool(hf.lm_head_bias), rope_scaling=scaling,
                               norm_topk_prob=False, sparsemixer_eps=hf.router_jitter_noise)  # fmt: skip


def _qwen_moe(hf: Any) -> dict[str, Any]:
    """Qwen2-MoE, Qwen3-MoE and Qwen3-VL-MoE's text model: experts on every `decoder_sparse_step`-th layer but the
    `mlp_only_layers` (Qwen3-VL-MoE's router renormalises its top k always, and has no flag for it)."""
    n, step, dense = hf.num_hidden_layers, hf.decoder_sparse_step, set(hf.mlp_only_layers or ())
    return dict(
        num_experts=hf.num_experts,
        experts_per_token=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)),
        shared_expert_intermediate_size=getattr(hf, "shared_expert_intermediate_size", 0),
        moe_layers=tuple(i not in dense and hf.num_experts > 0 and (i + 1) % step == 0 for i in range(n)),
    )


def _qwen2_moe(hf: Any) -> dict[str, Any]:
    return _qwen_moe(hf) | dict(qkv_bias=bool(hf.qkv_bias))


def _olmo(hf: Any) -> dict[str, Any]:
    return dict(clip_qkv=hf.clip_qkv)


def _olmoe(hf: Any) -> dict[str, Any]:
    return _olmo(hf) | dict(
        num_experts=hf.num_experts,
        experts_per_token=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        norm_topk_prob=bool(hf.norm_topk_prob),
        moe_layers=(True,) * hf.num_hidden_layers,
    )


def _flex_olmo(hf: Any) -> dict[str, Any]:
    """FlexOlmo (AI2): OLMo 2's layer with OLMoE's experts on every layer (no clamp)."""
    return dict(num_experts=hf.num_experts, experts_per_token=hf.num_experts_per_tok,
                moe_intermediate_size=hf.intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                moe_layers=(True,) * hf.num_hidden_layers)  # fmt: skip


def _gpt_oss(hf: Any) -> dict[str, Any]:
    return dict(
        num_experts=hf.num_local_experts,
        experts_per_token=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        moe_layers=(True,) * hf.num_hidden_layers,
        # (older transformers (5.17) have no such fields: their experts use these numbers)
        swiglu_clamp=(getattr(hf, "swiglu_alpha", 1.702), getattr(hf, "swiglu_limit", 7.0)),
    )


@dataclass(frozen=True)
class Architecture:
    """How one HF architecture maps onto vlens: fixed flags, and a reader for flags its config holds."""

    flags: dict[str, Any]
    read: Callable[[Any], dict[str, Any]] | None = None
    # HF's model reads config.sliding_window; Llama, GPT-2 and NeoX ignore a stray one, so vlens must too
    windowed: bool = True


GEMMA = {"family": "gemma", "norm": "rms_offset", "embed_scale": True, "post_norms": True}
LAYER_NORM = {"norm": "layer", "mlp_bias": True}
FAIRSEQ = {"learned_positions": True, "qkv_bias": True, "o_bias": True} | LAYER_NORM  # (positions added, not rotary)
GEMMA4 = GEMMA | {"family": "gemma4", "norm": "rms_float", "qk_norm": "head", "v_norm": True}
# OLMo 2 and 3: no norm before attention or the MLP, one after each (float32-scaled), q/k norms over the whole
# projection, rotary in float32.
OLMO = {"family": "olmo", "norm": "rms_float", "pre_norms": False, "post_norms": True, "qk_norm": "projection",
        "rope_float32": True}  # fmt: skip
LFM2 = {"family": "lfm2", "qk_norm": "head", "qkv_bias": False, "o_bias": False, "hidden_act": "silu"}
QWEN3_5 = {"family": "qwen3_5", "norm": "rms_offset", "qk_norm": "head", "attn_output_gate": True}
NO_BIAS = {"qkv_bias": False, "o_bias": False}  # HF's attention has none, whatever config.attention_bias says
GLM = {"o_bias": False, "rotary_pairs": True, "gate_up_stored_fused": True}
COHERE = {"family": "cohere", "norm": "layer_cohere", "parallel_residual": True, "rotary_pairs": True,
          "rotate_float32": True}  # fmt: skip

# HF architecture name -> what sets it apart from plain Llama.
ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture({}, _llama, windowed=False),
    "MistralForCausalLM": Architecture(NO_BIAS),
    "MinistralForCausalLM": Architecture(NO_BIAS),  # (Ministral 8B: Mistral's layer, windows on some layers)
    "Ministral3ForCausalLM": Architecture(NO_BIAS, _ministral3),
    "Qwen2ForCausalLM": Architecture({"qkv_bias": True, "o_bias": False}),
    "Qwen3ForCausalLM": Architecture({"qk_norm": "head"}),
    "GraniteForCausalLM": Architecture({"family": "granite"}, _granite, windowed=False),
    # Apertus: Qwen3's attention (q/k norms head by head), norms of its own names, an MLP not gated, with xIELU
    "ApertusForCausalLM": Architecture({"family": "apertus", "qk_norm": "head"}, windowed=False),
    # StarCoder2: Mistral's attention (biases, windows) with LayerNorms and an MLP not gated
    "Starcoder2ForCausalLM": Architecture({"family": "starcoder2", "norm": "layer"}, _starcoder2),
    "SmolLM3ForCausalLM": Architecture({}, _smollm3),
    # StableLM (2 1.6B, 3B-4E1T): Llama's layer with LayerNorms (biased) and partial rotary
    "StableLmForCausalLM": Architecture({"norm": "layer", "o_bias": False}, _stablelm, windowed=False),
    # Persimmon: GPT-NeoX's attention with a LayerNorm a head over q and over k, in Llama's sequential layer
    "PersimmonForCausalLM": Architecture(
        {"family": "persimmon", "qkv_bias": True, "o_bias": True} | LAYER_NORM, _persimmon, windowed=False
    ),
    # Phi-1/1.5/2: GPT-NeoX's parallel residual with one LayerNorm, biases everywhere (the unembedding's too)
    "PhiForCausalLM": Architecture(
        {"family": "phi", "parallel_residual": True, "qkv_bias": True, "o_bias": True} | LAYER_NORM, _phi,
        windowed=False,
    ),
    "Phi3ForCausalLM": Architecture(NO_BIAS | {"stored_fused": True}),
    # GLM (GLM-4-9B-0614, GLM-Edge): Llama's layer with q/k/v biases (none on o), rotary by pairs over half of each
    # head, gate and up stored as one gate_up_proj; GLM-4 (0414, Z1) the same in Gemma 2's sandwich of norms
    "GlmForCausalLM": Architecture(GLM),
    # Helium (Kyutai): Llama's layer, rotary by pairs, norms scaled in float32; Seed-OSS: its own o bias; ERNIE 4.5:
    # rotary by pairs in float32; Arcee (AFM): an MLP not gated, of squared ReLUs
    "HeliumForCausalLM": Architecture({"rotary_pairs": True, "norm": "rms_float", "o_bias": False}, _llama),
    "SeedOssForCausalLM": Architecture({}, _seed_oss),
    "Ernie4_5ForCausalLM": Architecture({"rotary_pairs": True, "rope_float32": True}, _ernie4_5, windowed=False),
    # ERNIE 4.5's MoE models: its dense layer, experts by a float32 router's softmax plus a correction bias
    "Ernie4_5_MoeForCausalLM": Architecture({"rotary_pairs": True, "rope_float32": True}, _ernie4_5_moe,
                                            windowed=False),  # fmt: skip
    "ArceeForCausalLM": Architecture({"family": "arcee"}, _llama),
    # Nemotron (Minitron 4B and 8B, Nemotron-Mini): Arcee's layer with LayerNorms that scale by 1 + w, partial rotary
    "NemotronForCausalLM": Architecture({"family": "arcee", "norm": "layer_offset"}, _nemotron, windowed=False),
    # Jais 2 (Inception): Arcee's layer with LayerNorms and biases everywhere
    "Jais2ForCausalLM": Architecture({"family": "arcee", "norm": "layer"}, _jais2, windowed=False),
    # nanochat (Karpathy's): Arcee's layer with RMS norms without weights (one more after the embedding), rotary by
    # minus the angle, weightless q/k norms after it (Llama 4's), soft-capped logits
    "NanoChatForCausalLM": Architecture({"family": "nanochat", "norm": "rms_unweighted", "qk_norm": "l2_after_rotary",
                                         "rotary_reversed": True} | NO_BIAS, _nanochat, windowed=False),  # fmt: skip
    # CWM (Meta's Code World Model): Mistral's layer, windows on the layers layer_types marks
    "CwmForCausalLM": Architecture(NO_BIAS),
    # Hunyuan (dense): q/k norms head by head after rotary (query_layernorm, key_layernorm), NTK-alpha rope
    "HunYuanDenseV1ForCausalLM": Architecture({"family": "hunyuan", "qk_norm": "head_after_rotary"}, _hunyuan,
                                              windowed=False),  # fmt: skip
    "HunYuanMoEV1ForCausalLM": Architecture({"family": "hunyuan", "qk_norm": "head_after_rotary"}, _hunyuan_moe,
                                            windowed=False),  # fmt: skip
    "Glm4ForCausalLM": Architecture(GLM | {"family": "glm4", "post_norms": True}),
    # GLM-4.1V's text model: GLM-4's, its q/k/v biased whatever (its config has no attention_bias)
    "Glm4vTextModel": Architecture(GLM | {"family": "glm4", "post_norms": True, "qkv_bias": True}),
    # GLM-4.5 to 4.7: Llama's layer with GLM's attention (rotary by halves), DeepSeek-V3's experts after dense layers
    "Glm4MoeForCausalLM": Architecture({"o_bias": False}, _glm4_moe),
    # MiniMax-M2: OLMoE's q/k norms over the whole projections, partial rotary, experts by float32 sigmoids
    "MiniMaxM2ForCausalLM": Architecture({"qk_norm": "projection"}, _minimax_m2),
    # Llama 4: rotary by pairs in float32, weightless q/k norms after it, NoPE layers with a temperature, experts that
    # read their input scaled beside a shared one
    "Llama4ForCausalLM": Architecture({"family": "llama4", "rotary_pairs": True, "rope_float32": True,
                                       "sigmoid_after_topk": True, "expert_weights_on_inputs": True}, _llama4,
                                      windowed=False),  # fmt: skip
    # AFMoE (Arcee's Trinity): Gemma's sandwich of OLMo 2's norms, q/k norms, an output gate of its own projection,
    # rotary on the sliding-window layers alone, DeepSeek's experts by sigmoids plus a bias
    "AfmoeForCausalLM": Architecture({"family": "afmoe", "norm": "rms_float", "qk_norm": "head", "post_norms": True}
                                     | NO_BIAS, _afmoe),  # fmt: skip
    # Solar Open (Upstage): Llama's attention (no o bias), DeepSeek-V3's experts on every layer
    "SolarOpenForCausalLM": Architecture({"o_bias": False}, _solar_open, windowed=False),
    # dots.llm1 (rednote): Qwen3's attention, DeepSeek-V3's experts after dense layers
    "Dots1ForCausalLM": Architecture({"qk_norm": "head"}, _dense_then_experts),
    # DeepSeek-V2, V3 (R1, V3.1, Kimi K2, Moonlight): multi-head latent attention, DeepSeek's experts after dense layers
    "DeepseekV2ForCausalLM": Architecture({"family": "deepseek"}, _deepseek, windowed=False),
    "DeepseekV3ForCausalLM": Architecture({"family": "deepseek"}, _deepseek, windowed=False),
    # GLM-4.7-Flash (Glm4MoeLite): DeepSeek-V3's layer, its dense and expert layers by mlp_layer_types; Youtu-LLM: V3's
    # latent attention with a dense MLP on every layer
    "Glm4MoeLiteForCausalLM": Architecture({"family": "deepseek"}, _deepseek, windowed=False),
    "YoutuForCausalLM": Architecture({"family": "deepseek"}, _deepseek, windowed=False),
    # MiniCPM3: DeepSeek-V2's latent attention (rotary by halves) with µP's scales
    "MiniCPM3ForCausalLM": Architecture({"family": "deepseek"}, _minicpm3, windowed=False),
    # Mistral 4: DeepSeek-V3's layer, Llama 4's attention temperature, experts by a softmax in groups
    "Mistral4ForCausalLM": Architecture({"family": "deepseek"}, _mistral4, windowed=False),
    "MixtralForCausalLM": Architecture(NO_BIAS, _mixtral),
    # Phi-3.5-MoE (Phi-mini-MoE): Mixtral's layer with LayerNorms, attention biases and experts chosen by SparseMixer
    "PhimoeForCausalLM": Architecture({"norm": "layer"}, _phimoe),
    "Qwen2MoeForCausalLM": Architecture({"o_bias": False, "round_routing_weights": True}, _qwen2_moe),
    "Qwen3MoeForCausalLM": Architecture({"qk_norm": "head", "round_routing_weights": True}, _qwen_moe),
    # Qwen3-VL-MoE's text model (30B-A3B, 235B-A22B): Qwen3-MoE's layer, all experts in one tensor per projection
    "Qwen3VLMoeTextModel": Architecture({"qk_norm": "head", "round_routing_weights": True}, _qwen_moe),
    "OlmoeForCausalLM": Architecture({"qk_norm": "projection", "round_routing_weights": True}, _olmoe),
    "Olmo2ForCausalLM": Architecture(OLMO),
    "Olmo3ForCausalLM": Architecture(OLMO),
    # OLMo Hybrid: OLMo 3's attention layers (no windows) among gated delta nets in Llama's pre-norm layer
    "OlmoHybridForCausalLM": Architecture(OLMO | {"family": "olmo_hybrid", "pre_norms": True, "post_norms": False},
                                          _olmo_hybrid, windowed=False),  # fmt: skip
    # FlexOlmo: OLMo 2's layer with OLMoE's routed experts
    "FlexOlmoForCausalLM": Architecture(OLMO | {"round_routing_weights": True}, _flex_olmo),
    # K-EXAONE: EXAONE 4's attention in Llama's pre-norm layer, DeepSeek-V3's experts
    "ExaoneMoeForCausalLM": Architecture({"qk_norm": "head"} | NO_BIAS, _exaone_moe),
    # EXAONE 4: OLMo 2's post-norms only, Llama's norm and rotary, q/k norms head by head, NoPE global layers
    "Exaone4ForCausalLM": Architecture(
        {"family": "olmo", "pre_norms": False, "post_norms": True, "qk_norm": "head"}, _exaone4
    ),
    # OLMo 1: Llama's layer with LayerNorms of no weight or bias (eps fixed at 1e-5), float32 rotary, clip_qkv
    "OlmoForCausalLM": Architecture(
        {"norm": "layer_plain", "norm_eps": 1e-5, "rope_float32": True}, _olmo, windowed=False
    ),
    # Gemma 1: Llama's layer with Gemma's norms and embedding scale (no sandwich norms, windows or soft-caps)
    "GemmaForCausalLM": Architecture({"norm": "rms_offset", "embed_scale": True}, windowed=False),
    "Gemma2ForCausalLM": Architecture(GEMMA, _gemma2),
    # VaultGemma (Google's differentially private Gemma): Gemma 2 without its post-norms
    "VaultGemmaForCausalLM": Architecture(GEMMA | {"family": "vaultgemma", "post_norms": False}, _gemma2),
    # Gemma 3's HF attention never passes attn_logit_softcapping on, whatever the config says.
    "Gemma3ForCausalLM": Architecture(GEMMA | {"qk_norm": "head"}, _gemma),
    # Gemma 4: Gemma 3's layer with norms that scale by w (not 1 + w), values normalised too, a learned scalar
    # on each layer's output, and full-attention layers with heads of their own size
    "Gemma4ForCausalLM": Architecture(GEMMA4, _gemma4),
    "Gemma4UnifiedForCausalLM": Architecture(GEMMA4, _gemma4),  # (the 12B's text model: Gemma 4's layers)
    # gpt-oss: a sink logit per head in every softmax; routed experts with biases, a router with a bias that
    # weighs the top k by their softmax, and a clamped SwiGLU; norms scaled in float32; YaRN rotary
    "GptOssForCausalLM": Architecture(
        {"norm": "rms_float", "attn_sinks": True, "router_bias": True, "softmax_after_topk": True,
         "norm_topk_prob": False},
        _gpt_oss,
    ),
    # Qwen 3.5: Gemma's (1 + w) norms, Qwen3's q/k norms, an output gate on each attention head, and gated delta
    # nets for most layers' attention
    "Qwen3_5ForCausalLM": Architecture(QWEN3_5, _qwen3_5),
    "Qwen3_5MoeForCausalLM": Architecture(QWEN3_5 | {"round_routing_weights": True}, _qwen3_5_moe),
    "Qwen3NextForCausalLM": Architecture(QWEN3_5 | {"round_routing_weights": True}, _qwen3_next),
    # LFM2: Llama's attention (q/k norms head by head, out_proj) on a few layers, gated short convolutions on the rest
    "Lfm2ForCausalLM": Architecture(LFM2, _lfm2),
    "Lfm2MoeForCausalLM": Architecture(LFM2, _lfm2_moe),
    # LFM3: LFM2's layers with Qwen3's attention names and a gate a head, windows, two ropes, sandwich norms
    "Lfm3ForCausalLM": Architecture({"family": "lfm3", "qk_norm": "head", "hidden_act": "silu", "rope_float32": True},
                                    _lfm3),  # fmt: skip
    # Bamba: Llama's layer under its own norm names (pre_ff_layernorm, final_layernorm), Mamba 2 mixers on most layers
    "BambaForCausalLM": Architecture({"family": "bamba"}, _bamba, windowed=False),
    # Granite 4.0: Granite's multipliers, Bamba's Mamba 2 mixers, a shared MLP beside routed experts
    "GraniteMoeHybridForCausalLM": Architecture({"family": "granite_hybrid"}, _granite_hybrid, windowed=False),
    # HyperCLOVA X (Naver's SEED models): Granite's layer with post-norms, its logits multiplied
    "HyperCLOVAXForCausalLM": Architecture({"family": "hyperclovax"}, _hyperclovax, windowed=False),
    # GraniteSWA (and its MoE): Granite's layers with windows by layer_types, a sink per head, a rope base per layer
    "GraniteSWAForCausalLM": Architecture({"family": "granite", "attn_sinks": True}, _granite_swa),
    "GraniteMoeSWAForCausalLM": Architecture({"family": "granite_hybrid", "attn_sinks": True}, _granite_moe_swa),
    # Granite 3.x's MoE models: Granite 4.0's layer with attention alone and rotary positions
    "GraniteMoeForCausalLM": Architecture({"family": "granite_hybrid"}, _granite_moe, windowed=False),
    "GraniteMoeSharedForCausalLM": Architecture({"family": "granite_hybrid"}, _granite_moe, windowed=False),
    # Falcon-H1: Bamba's layer with attention and a Mamba 2 mixer side by side on every layer, µP multipliers
    "FalconH1ForCausalLM": Architecture({"family": "falcon_h1"}, _falcon_h1, windowed=False),
    # Jamba: Bamba's layer with Mamba's mixers (their time steps, B and C normed) and routed experts every other layer
    "JambaForCausalLM": Architecture({"family": "bamba"} | NO_BIAS, _jamba, windowed=False),
    # Nemotron-H: a layer is a norm and one part alone (a Mamba 2 mixer, attention without positions or an MLP)
    "NemotronHForCausalLM": Architecture({"family": "nemotron_h", "norm": "rms_float"} | NO_BIAS, _nemotron_h,
                                         windowed=False),  # fmt: skip
    # Mamba, Falcon Mamba and Mamba 2: a layer is a norm and a Mamba mixer, nothing else (no attention, no MLP)
    "MambaForCausalLM": Architecture({"family": "mamba"}, _mamba, windowed=False),
    "FalconMambaForCausalLM": Architecture({"family": "mamba"}, _falcon_mamba, windowed=False),
    "Mamba2ForCausalLM": Architecture({"family": "mamba"}, _mamba2_only, windowed=False),
    # Cohere (Command R, Aya Expanse) and Cohere 2 (Command R7B, Command A): a parallel residual with one LayerNorm
    # without a bias, rotary by pairs, scaled logits
    "CohereForCausalLM": Architecture(COHERE, _cohere, windowed=False),
    "Cohere2ForCausalLM": Architecture(COHERE, _cohere2),
    "Cohere2MoeForCausalLM": Architecture(COHERE, _cohere2_moe),
    "GPT2LMHeadModel": Architecture(
        {"family": "gpt2", "learned_positions": True, "qkv_bias": True, "o_bias": True} | LAYER_NORM,
        _gpt2,
        windowed=False,
    ),
    # GPTBigCode (SantaCoder, StarCoder 1): GPT-2's model in nn.Linear's layout, one key-value head (multi_query)
    "GPTBigCodeForCausalLM": Architecture(
        {"family": "gpt_bigcode", "learned_positions": True, "qkv_bias": True, "o_bias": True} | LAYER_NORM, _gpt2,
        windowed=False,
    ),
    # GPT-Neo (and TinyStories): GPT-2's model; q, k, v apart without biases, unscaled scores, local layers
    "GPTNeoForCausalLM": Architecture(
        {"family": "gpt_neo", "learned_positions": True, "qkv_bias": False, "o_bias": True} | LAYER_NORM, _gpt_neo,
        windowed=False,
    ),
    "GPTNeoXForCausalLM": Architecture({"family": "gpt_neox"} | LAYER_NORM, _gpt_neox, windowed=False),
    # BLOOM: GPT-NeoX's fused per-head q/k/v in a sequential layer, a LayerNorm after the embedding, ALiBi
    "BloomForCausalLM": Architecture(
        {"family": "bloom", "alibi": "bloom", "qkv_bias": True, "o_bias": True} | LAYER_NORM, _bloom, windowed=False
    ),
    # MPT (MosaicML): GPT-2's layer with ALiBi (MPT's slopes), LayerNorms without biases, no biases anywhere, an exact
    # GELU MLP, q/k/v clipped where clip_qkv says
    # DBRX: Llama's layer under DBRX's names (MPT's family), experts on every layer
    "DbrxForCausalLM": Architecture({"family": "dbrx", "norm": "layer_nobias", "norm_eps": 1e-5} | NO_BIAS, _dbrx,
                                    windowed=False),  # fmt: skip
    "MptForCausalLM": Architecture({"family": "mpt", "alibi": "mpt", "norm": "layer_nobias", "hidden_act": "gelu",
                                    "rotary_dim": 0} | NO_BIAS, _mpt, windowed=False),  # fmt: skip
    # OPT: GPT-2's layer under its own names, positions two rows down their table, queries scaled as projected
    "OPTForCausalLM": Architecture({"family": "opt", "learned_positions": True, "norm": "layer"}, _opt, windowed=False),
    # XGLM and BioGPT: OPT's layer from the same fairseq decoder, the embedding scaled; XGLM's positions computed
    "XGLMForCausalLM": Architecture(FAIRSEQ | {"family": "xglm"}, _xglm, windowed=False),
    "BioGptForCausalLM": Architecture(FAIRSEQ | {"family": "biogpt"}, _biogpt, windowed=False),
    # Falcon: GPT-NeoX's parallel residual (one norm or two) with one key-value head or grouped ones, no biases
    "FalconForCausalLM": Architecture({"family": "falcon"} | LAYER_NORM, _falcon, windowed=False),
    # GPT-J: Phi's parallel residual with one LayerNorm, rotary by pairs over the leading rotary_dim dims, no
    # attention biases, a biased unembedding
    "GPTJForCausalLM": Architecture(
        {"family": "gptj", "parallel_residual": True, "qkv_bias": False, "o_bias": False, "rotary_pairs": True}
        | LAYER_NORM, _gptj, windowed=False,
    ),  # fmt: skip
    # CodeGen: GPT-J's layer with q, k and v in one projection, in its model-parallel layout, rotary in float32
    "CodeGenForCausalLM": Architecture(
        {"family": "codegen", "parallel_residual": True, "qkv_bias": False, "o_bias": False, "rotary_pairs": True,
         "rope_float32": True} | LAYER_NORM, _gptj, windowed=False,
    ),  # fmt: skip
}

# Multimodal checkpoints whose text model vlens runs (token ids in, no images; its config is their text_config, one
# of ARCHITECTURES) -> where they keep what a causal LM names model.* and lm_head.* (their vision tower is left
# unread): under language_model. in most (as transformers 4 saved them), Qwen2-VL's and Qwen2.5-VL's as a causal LM's,
# Idefics3's and SmolVLM's under model.text_model., Qwen3-VL's decoder under model.language_model. (as transformers 5
# saves them).
LEGACY = ("language_model.model.", "language_model.lm_head.")
TEXT_MODELS = {
    "Gemma3ForConditionalGeneration": LEGACY,
    "Mistral3ForConditionalGeneration": LEGACY,  # Mistral Small 3.1 and 3.2, Ministral 3
    "LlavaForConditionalGeneration": LEGACY,
    "LlavaNextForConditionalGeneration": LEGACY,  # (LLaVA-NeXT, LLaVA 1.6)
    "LlavaOnevisionForConditionalGeneration": LEGACY,
    "InternVLForConditionalGeneration": LEGACY,  # (InternVL 3 and 3.5, as the "-hf" releases hold them)
    "AyaVisionForConditionalGeneration": LEGACY,
    "FuyuForCausalLM": LEGACY,  # (Fuyu-8B: Persimmon's text model)
    "Idefics3ForConditionalGeneration": ("model.text_model.", "lm_head."),
    "SmolVLMForConditionalGeneration": ("model.text_model.", "lm_head."),  # (SmolVLM, SmolVLM2)
    "Qwen2VLForConditionalGeneration": ("model.", "lm_head."),
    "Glm4vForConditionalGeneration": ("model.language_model.", "lm_head."),  # (GLM-4.1V, GLM-4.6V-Flash)
    "Exaone4_5_ForConditionalGeneration": ("model.language_model.", "lm_head."),  # (EXAONE 4.5: EXAONE 4's text model)
    "Glm4vMoeForConditionalGeneration": ("model.language_model.", "lm_head."),  # (GLM-4.5V, GLM-4.6V)
    "Qwen2_5_VLForConditionalGeneration": ("model.", "lm_head."),
    "Qwen3VLForConditionalGeneration": ("model.language_model.", "lm_head."),
    "Qwen3VLMoeForConditionalGeneration": ("model.language_model.", "lm_head."),
    "Gemma4ForConditionalGeneration": ("model.language_model.", "lm_head."),
    "Gemma4UnifiedForConditionalGeneration": ("model.language_model.", "lm_head."),  # (Gemma 4 12B)
    "Qwen3_5ForConditionalGeneration": ("model.language_model.", "lm_head."),
    "Qwen3_5MoeForConditionalGeneration": ("model.language_model.", "lm_head."),
    "Lfm2VlForConditionalGeneration": ("model.language_model.", "lm_head."),
    "Lfm3VlForConditionalGeneration": ("model.language_model.", "lm_head."),
    "Llama4ForConditionalGeneration": ("language_model.model.", "language_model.lm_head."),  # (Scout, Maverick)
}

# model_type -> architecture, for configs that carry no `architectures` list.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral": "MinistralForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "apertus": "ApertusForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "persimmon": "PersimmonForCausalLM",
    "phi": "PhiForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "glm": "GlmForCausalLM",
    "helium": "HeliumForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "arcee": "ArceeForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "jais2": "Jais2ForCausalLM",
    "nanochat": "NanoChatForCausalLM",
    "cwm": "CwmForCausalLM",
    "solar_open": "SolarOpenForCausalLM",
    "afmoe": "AfmoeForCausalLM",
    "vaultgemma": "VaultGemmaForCausalLM",
    "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
    "hunyuan_v1_moe": "HunYuanMoEV1ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "dots1": "Dots1ForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "youtu": "YoutuForCausalLM",
    "mistral4": "Mistral4ForCausalLM",
    "minicpm3": "MiniCPM3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phimoe": "PhimoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmo": "OlmoForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM",
    "flex_olmo": "FlexOlmoForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "exaone_moe": "ExaoneMoeForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
    "gemma4_unified_text": "Gemma4UnifiedForCausalLM",
    "gemma4_unified": "Gemma4UnifiedForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
    "aya_vision": "AyaVisionForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "glm4v": "Glm4vForConditionalGeneration",
    "exaone4_5": "Exaone4_5_ForConditionalGeneration",
    "glm4v_moe": "Glm4vMoeForConditionalGeneration",
    # (their text models: GLM-4's layer and GLM-4.5's, their multimodal rotary given text alone the plain one)
    "glm4v_text": "Glm4vTextModel",
    "glm4v_moe_text": "Glm4MoeForCausalLM",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "lfm3": "Lfm3ForCausalLM",
    "bamba": "BambaForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "granite_swa": "GraniteSWAForCausalLM",
    "hyperclovax": "HyperCLOVAXForCausalLM",
    "granitemoe_swa": "GraniteMoeSWAForCausalLM",
    "mamba": "MambaForCausalLM",
    "falcon_mamba": "FalconMambaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "jamba": "JambaForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "lfm2_vl": "Lfm2VlForConditionalGeneration",
    "lfm3_vl": "Lfm3VlForConditionalGeneration",
    "llama4": "Llama4ForConditionalGeneration",
    # their text models: Qwen2's and Qwen3's layers (their multimodal rotary, given text alone, is the plain one)
    "qwen2_vl_text": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
    "qwen3_vl_text": "Qwen3ForCausalLM",
    "qwen3_vl_moe_text": "Qwen3VLMoeTextModel",
    "gpt_oss": "GptOssForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gpt_neo": "GPTNeoForCausalLM",
    "gpt_bigcode": "GPTBigCodeForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "gptj": "GPTJForCausalLM",
    "codegen": "CodeGenForCausalLM",
    "opt": "OPTForCausalLM",
    "xglm": "XGLMForCausalLM",
    "biogpt": "BioGptForCausalLM",
    "falcon": "FalconForCausalLM",
    "mpt": "MptForCausalLM",
    "dbrx": "DbrxForCausalLM",
    "bloom": "BloomForCausalLM",
    "cohere": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "cohere2_moe": "Cohere2MoeForCausalLM",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None for plain RoPE, else HF's rope_parameters with a rope_type
    max_position_embeddings: int
    tie_word_embeddings: bool
    family: str = "llama"  # which model code runs it (vlens.models.MODEL_CLASSES)
    hidden_act: str = "silu"
    # "rms" (scaled after the cast back), "rms_float" (OLMo 2/3: scaled in float32), "rms_offset" (Gemma: scale
    # 1 + w, in float32), "layer" (LayerNorm with bias), "layer_plain" (OLMo 1: no weight or bias, in float32) or
    # "layer_nobias" (MPT: a weight and no bias, in float32), "layer_cohere" (the same in HF Cohere's ops one by one),
    # "layer_offset" (Nemotron: LayerNorm scaling by 1 + w) or "rms_unweighted" (nanochat: RMSNorm without a weight)
    norm: str = "rms"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # q and k normalised: "head" head by head (Qwen3, Gemma 3), "head_after_rotary" the same after rotary (Hunyuan),
    # "l2_after_rotary" head by head with no weight after rotary, on the layers that rotate (Llama 4), "projection" all
    # heads together (OLMo), "" not
    qk_norm: str = ""
    clip_qkv: float | None = None  # OLMo 1, OLMoE: q, k and v clamped to [-clip, clip] (after the q/k norm)
    stored_fused: bool = False  # the checkpoint keeps qkv_proj and gate_up_proj fused (Phi-3)
    gate_up_stored_fused: bool = False  # GLM: gate_up_proj alone fused (q, k and v apart)
    rotary_dim: int = 0  # leading dims of each head that rotate (NeoX, Phi, GPT-J: a fraction); 0 = no rotary
    rotary_pairs: bool = False  # GPT-J: dims 2i and 2i + 1 rotate together (else i and i + rotary_dim / 2)
    rotary_reversed: bool = False  # nanochat: each pair turns by minus its angle (its rotate_half is HF's negated)
    nope_layers: tuple[bool, ...] = ()  # SmolLM3: per layer, True where no rotary is applied (NoPE); () = none
    # Qwen2-VL, Qwen2.5-VL, GLM-4.1V, GLM-4.5V (M-RoPE): a row's angles from three positions (time, height, width),
    # these many of the frequencies from each in turn; a text row's three are its position (plain RoPE), an image row's
    # its place in the image (vlens.images: AttentionMetadata.rope_positions). () = one position.
    mrope_section: tuple[int, ...] = ()
    # Qwen3-VL: frequency j turns by position j % 3 (within 3 times each section's size), not by runs of sections
    mrope_interleaved: bool = False
    sliding_rope_theta: float | None = None  # Gemma 3: the sliding-window layers' own rope base
    sliding_rope_scaling: dict | None = None
    learned_positions: bool = False  # GPT-2: a position-embedding table added to the token embedding
    # "bloom", "falcon" (Falcon-RW) or "mpt": no position embedding, each head's scores plus its slope times the key's
    # position, as that family's HF code builds them (vlens.layers.attention.Alibi); "": none
    alibi: str = ""
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size), rounded to the model dtype
    pre_norms: bool = True  # a norm before attention and before the MLP (ln1, ln2); OLMo 2/3 have none
    post_norms: bool = False  # each sublayer's output normalised before the residual add (Gemma: ln1_post, ln2_post;
    # OLMo 2/3, without pre-norms: TransformerLens names them ln1, ln2)
    # OLMo Hybrid, per layer: True where the layer is OLMo 2's (post-norms alone), False where it is Llama's (pre-norms
    # alone); () = every layer as pre_norms and post_norms say (pre_norms_at, post_norms_at)
    post_norm_layers: tuple[bool, ...] = ()
    rope_float32: bool = False  # OLMo: cos and sin stay float32, so q and k rotate in float32 and round back
    rotate_float32: bool = False  # Cohere: cos and sin in the model's dtype, q and k rotated in float32, rounded back
    attn_scale: float | None = None  # softmax scale; None = head_dim ** -0.5
    # DeepSeek-V2/V3 (multi-head latent attention): the queries through a low-rank projection and its norm
    # (`q_lora_rank`; 0: one projection), each head's keys (their no-position part) and values from one normed latent
    # of `kv_lora_rank` dims a token, the keys' rotating part (their last rotary_dim of head_dim) one for every head;
    # values of their own size, `v_head_dim` (0: head_dim); V3's `rotary_interleaved`: dims 2i and 2i + 1 rotate
    # together and come out by halves (evens, then odds), as HF's rope_interleave
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    v_head_dim: int = 0
    # the KV cache holds each token's normed latent and rotating key part, not every head's keys and values (an
    # engine setting, EngineConfig.latent_kv_cache; vlens.models.deepseek)
    latent_kv_cache: bool = False
    rotary_interleaved: bool = False
    query_scale: float | None = None  # OPT: q times this after hook_q (its scores then unscaled), as HF scales them
    attn_scale_inverse_layer: bool = False  # GPT-2 scale_attn_by_inverse_layer_idx: scale / (layer + 1)
    attn_softcap: float | None = None  # Gemma 2: cap * tanh(scores / cap) before the mask
    attn_sinks: bool = False  # gpt-oss: each head's softmax has one more logit, learned, that weighs no value
    # Qwen 3.5: q_proj also gives a gate for each head (its rows per head: q, then gate), the attention output times
    # its sigmoid before o_proj
    attn_output_gate: bool = False
    # AFMoE (head_dim: a gate per channel) and LFM3 (1: one per head): that gate from a projection of its own
    # (gate_proj) of the layer's input, this wide a head; 0: none
    attn_gate_width: int = 0
    # Ministral 3 (Llama 4's attention temperature): (beta, original context); q times 1 + beta * log(1 + floor(
    # position / original)) after rotary
    attn_temperature: tuple[float, int] | None = None
    # Llama 4 (attn_temperature_tuning): (attn_scale, floor_scale); on its layers without rotary, q times 1 +
    # attn_scale * log(1 + floor((position + 1) / floor_scale)) after hook_q, in float32
    nope_temperature: tuple[float, int] | None = None
    final_softcap: float | None = None  # Gemma 2/3: the same on the logits
    logit_scale: float = 1.0  # Cohere: the logits times this
    lm_head_bias: bool = False  # ERNIE 4.5's MoE models (use_bias): the unembedding has a bias
    # Granite: the embeddings times `embedding_multiplier`, each sublayer's output times `residual_multiplier` before
    # the residual add (hook_attn_out and hook_mlp_out are after it: what the stream gets), the logits divided by
    # `logits_scaling`
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    parallel_residual: bool = False  # NeoX: x + attn(ln1(x)) + mlp(ln2(x)); no resid_mid
    # one norm for both sublayers of that residual (ln2 is ln1): Falcon 7B's and Falcon 2's, as their configs say
    # (Phi's, GPT-J's and Cohere's layers always have one)
    shared_norm: bool = False
    num_experts: int = 0  # MoE (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss): routed experts per MoE layer
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to one
    norm_topk_pnorm: float | None = None  # DBRX: the chosen experts' weights over their p-norm (torch.norm), p this
    softmax_after_topk: bool = False  # gpt-oss: the weights are the softmax of the chosen k logits alone
    # Llama 4: the weights are the sigmoids of the chosen k logits (in float32, rounded back), and they scale what each
    # chosen expert reads, not what it gives
    sigmoid_after_topk: bool = False
    expert_weights_on_inputs: bool = False
    router_bias: bool = False  # gpt-oss: the router's linear has a bias
    swiglu_clamp: tuple[float, float] | None = None  # gpt-oss: (alpha, limit) of its experts' clamped SwiGLU (and
    # their biases)
    round_routing_weights: bool = False  # Qwen-MoE, OLMoE: those weights rounded to the model dtype before use
    # Phi-3.5-MoE: SparseMixer's two experts, the best logit's and the best of the rest, each weighed by its softmax
    # over the logits within this (relative) jitter of its own; None: the top k of one softmax
    sparsemixer_eps: float | None = None
    routing_norm_min: float = 0.0  # ERNIE 4.5: the weights renormalised by their sum clamped to at least this
    # LFM2-MoE: each expert's score is the sigmoid of its logit (not a softmax), the top k chosen by score plus a
    # learned bias per expert (`expert_bias`), their scores renormalised (plus `sigmoid_norm_eps`) and times
    # `routed_scaling`; Nemotron 3's the same, its router in float32
    sigmoid_routing: bool = False
    sigmoid_float32: bool = False  # MiniMax-M2: those sigmoids of the logits (of the model's dtype) in float32
    expert_bias: bool = False
    routed_scaling: float = 1.0
    sigmoid_norm_eps: float = 1e-6
    # DeepSeek-V2/V3, Nemotron 3, GLM-4.5: DeepSeek's routed experts, the router (and V3's correction bias,
    # expert_bias's place) in float32, beside a shared expert without a gate (vlens.layers.moe.DeepseekMoE); routing
    # limited to each token's best `expert_groups[1]` of `expert_groups[0]` groups of experts
    deepseek_moe: bool = False
    expert_groups: tuple[int, int] = (1, 1)
    group_scores_top2: bool = False  # DeepSeek-V3, Mistral 4: a group scored by its best two experts (V2: its best one)
    router_model_dtype: bool = False  # Mistral 4: that router and its softmax in the model's dtype (else float32)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert with a sigmoid gate
    # how the routed experts' output and the shared expert's combine: "gate" (Qwen2-MoE: the shared one's times a
    # sigmoid gate of the token, added), "sum" or "average" (Cohere 2's MoE models)
    shared_expert_mix: str = "gate"
    moe_layers: tuple[bool, ...] = ()  # per layer: routed experts (True) or a dense MLP; () = none
    # Gemma 4 26B-A4B: the routed experts run beside a dense MLP (both read the stream, each output normed, their
    # sum normed again), their router reading the stream normed, scaled and with a scale per expert
    experts_beside_mlp: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full causal attention
    # Llama 4, per layer: the chunk of positions a query's keys are confined to (its own), or None; () = none
    attention_chunks: tuple[int | None, ...] = ()
    # Gemma 4, per layer: head size and key-value heads (its full-attention layers' differ; () = head_dim and
    # num_kv_heads everywhere), and where the keys are the values (one projection, before the key norm)
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    keys_are_values: tuple[bool, ...] = ()
    v_norm: bool = False  # Gemma 4: values RMS-normalised head by head (no weight)
    # Gemma 4 E2B/E4B, per layer: the layer whose keys and values it attends to (its own, but in the last
    # num_kv_shared_layers); () = each its own
    kv_layers: tuple[int, ...] = ()
    layer_intermediate_sizes: tuple[int, ...] = ()  # per layer, where they differ (Gemma 4's double-wide MLPs)
    # Gemma 4 E2B/E4B: each layer's own input of this size, from a second embedding of the tokens and a projection of
    # the first, added through a gated branch after the MLP (per-layer embeddings); 0 = none
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # Qwen 3.5, per layer: True where a gated delta net (linear attention over a recurrent state per sequence, after
    # a causal convolution) stands in for attention; () = none. Its heads: query/key heads and size, value heads and
    # size, and the convolution's width
    linear_layers: tuple[bool, ...] = ()
    linear_key_heads: int = 0
    linear_key_dim: int = 0
    linear_value_heads: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    # Qwen3-Next: the checkpoint keeps q, k, v and the gate's input in one in_proj_qkvz, beta's and the decay's inputs
    # in one in_proj_ba, each grouped by key head (each key head's rows, then its value heads')
    linear_stored_grouped: bool = False
    linear_beta_scale: float = 1.0  # OLMo Hybrid (linear_allow_neg_eigval): the delta rule's beta times 2, in [0, 2]
    # LFM2, per layer: True where a gated short convolution (its input's last `conv_kernel` - 1 rows kept per sequence)
    # stands in for attention; () = none
    conv_layers: tuple[bool, ...] = ()
    conv_kernel: int = 0
    conv_bias: bool = False
    # Bamba, per layer: True where a Mamba 2 mixer (an SSM state per head, after a causal convolution) stands in for
    # attention; () = none. Its heads, their size, the groups B and C are shared by, the state size, the convolution's
    # width and biases, and the time step's clamp
    ssm_layers: tuple[bool, ...] = ()
    ssm_heads: int = 0
    ssm_head_dim: int = 0
    ssm_groups: int = 0
    ssm_state_size: int = 0
    ssm_conv_kernel: int = 0
    ssm_conv_bias: bool = False
    ssm_proj_bias: bool = False
    ssm_dt_limit: tuple[float, float] = (0.0, float("inf"))
    ssm_hidden_act: str | None = None  # Nemotron-H: the Mamba mixers' activation, where it is not hidden_act
    # The Mamba 2 mixer's gated norm: "gate_then_norm" (Bamba's, Mamba 2's: y·silu(z), normed by groups, cast, times
    # w), "norm_then_gate" or "gate_then_norm_float" (Falcon-H1's: times w in float32, before the cast), "gate" (none:
    # y·silu(z)); its output projection's bias where it is not ssm_proj_bias (Falcon-H1's projectors_bias)
    ssm_norm: str = "gate_then_norm"
    ssm_out_bias: bool | None = None
    # Falcon-H1: every layer's attention and Mamba 2 mixer side by side on the same normed input, their outputs summed
    # (hook_attn_out; each its own as attn.hook_out and mamba.hook_out); the µP multipliers of attention's input and
    # output, the mixer's input and output (`mixer_multipliers`), the keys, the mixer's projections z, x, B, C and dt
    # (`ssm_multipliers`) and the MLP's gate (inside its activation) and output (`mlp_multipliers`)
    parallel_mixers: bool = False
    mixer_multipliers: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)
    key_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = ()
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)
    # Mamba (1): its mixer's channels and the time step's low rank (> 0: Mamba's selective scan, a state per channel
    # and state dimension, in place of Mamba 2's heads); Falcon Mamba: the eps of the weightless RMS norms of its time
    # step's input, B and C (None: not normed)
    ssm_inner: int = 0
    ssm_dt_rank: int = 0
    ssm_bcdt_norm_eps: float | None = None
    ssm_bcdt_norm_weights: bool = False  # Jamba: those norms have weights (the model's RMS norm)
    # Mamba, Mamba 2, Nemotron-H, per layer: "mixer" where the layer is x + mixer(norm(x)) alone (its token mixer:
    # attention or a Mamba mixer; no MLP, no ln2, no hook_resid_mid), "mlp" where it is x + mlp(norm(x)) alone (no
    # ln1, no token mixer); () = every layer both
    layer_parts: tuple[str, ...] = ()
    # Mamba (1) and Falcon Mamba in HF: output_hidden_states[i] is layer i's output (no embedding; the last is the
    # final norm's), so vlens's hidden_states.{i} alias is blocks.{i}.hook_resid_post there
    hidden_states_after_layers: bool = False
    # Qwen3-VL: its first layers whose output gets image rows of the tower's inner layers added (deepstack, with
    # images), so that HF's hidden_states.{i} there is blocks.{i - 1}.hook_resid_post, not blocks.{i}.hook_resid_pre
    deepstack_layers: int = 0
    # Mamba's residual_in_fp32: the stream between layers kept in float32 (each layer's norm reads it rounded to the
    # model's dtype; its taps' rows are of the model's dtype, as every tap's)
    residual_float32: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # a multimodal checkpoint's names for the text model's model.* and lm_head.* (TEXT_MODELS); None: those names
    stored_as: tuple[str, str] | None = None
    # a sequence classifier's classes, in order (HF's *ForSequenceClassification: the causal LM's decoder, and a head,
    # `score`, over its final norm's last row, in place of the unembedding; vlens.classify); () for a causal LM
    classifier_labels: tuple[str, ...] = ()
    classifier_name: str = ""  # its architecture, as the checkpoint names it (the decoder's is `architecture`)
    classifier_per_token: bool = False  # a token classifier's (*ForTokenClassification): its head reads every row
    # a base model's checkpoint (HF's *Model, an embedding model's: the decoder alone, stored without its prefix) names
    # its architecture; "" for any other
    base_model: str = ""
    # what turns its logits into `probs` (vLLM's, after the config's problem_type): "softmax" over two or more
    # classes, "sigmoid" for one (a reward model's) or for multi-label ones, "identity" for a regression
    classifier_activation: str = "softmax"
    # a causal LM read as a classifier (vLLM's classifier_from_token, set by hf_overrides: Qwen3-Reranker's, bge-
    # reranker-v2-gemma's): its head is the unembedding's rows of these tokens, one class each, or with
    # `classifier_two_way`, the second's row less the first's, one class whose sigmoid is the two tokens' softmax
    # (vLLM's "from_2_way_softmax": P(yes) of a yes/no reranker)
    classifier_tokens: tuple[str, ...] = ()
    classifier_two_way: bool = False
    # a cross-encoder that reads a pair as one text, the two joined (vLLM's use_pad_token false, the default of a
    # classifier made of tokens: an LLM as a reranker), not as the tokenizer's pair of texts
    pairs_joined: bool = False
    # an embedding model trained so that its vectors' first dims embed too (matryoshka; vLLM's is_matryoshka): an
    # embedding may be cut to any width (PoolingParams.dimensions), or only to one of `matryoshka_dimensions`
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    parallel: Parallel = SINGLE  # this process's share of a tensor-parallel model (vlens.distributed)

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def is_linear_layer(self, layer: int) -> bool:
        return bool(self.linear_layers) and self.linear_layers[layer]

    def is_conv_layer(self, layer: int) -> bool:
        return bool(self.conv_layers) and self.conv_layers[layer]

    def is_ssm_layer(self, layer: int) -> bool:
        return bool(self.ssm_layers) and self.ssm_layers[layer]

    def part_at(self, layer: int) -> str:
        """"both" (a token mixer, then an MLP), "mixer" (the token mixer alone) or "mlp" (the MLP alone)."""
        return self.layer_parts[layer] if self.layer_parts else "both"

    def has_mlp(self, layer: int) -> bool:
        return self.part_at(layer) != "mixer"

    def attends(self, layer: int) -> bool:
        """Whether the layer mixes its tokens by attention (else a linear-attention layer, a short convolution or a
        Mamba mixer, which keep a state per sequence, or no mixer at all: Nemotron-H's MLP layers)."""
        mixer = not (self.is_linear_layer(layer) or self.is_conv_layer(layer) or self.is_ssm_layer(layer))
        return mixer and self.part_at(layer) != "mlp"

    @property
    def keeps_states(self) -> bool:
        """Whether some layer keeps a state per sequence between forwards (vlens.layers.slot_states)."""
        return any(self.linear_layers) or any(self.conv_layers) or any(self.ssm_layers) or self.parallel_mixers

    def pre_norms_at(self, layer: int) -> bool:
        return not self.post_norm_layers[layer] if self.post_norm_layers else self.pre_norms

    def post_norms_at(self, layer: int) -> bool:
        return self.post_norm_layers[layer] if self.post_norm_layers else self.post_norms

    @property
    def any_post_norms(self) -> bool:
        """Whether some layer normalises a sublayer's output before the residual add."""
        return any(map(self.post_norms_at, range(self.num_layers)))

    def head_dim_at(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_heads_at(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def kv_layer_at(self, layer: int) -> int:
        return self.kv_layers[layer] if self.kv_layers else layer

    def intermediate_size_at(self, layer: int) -> int:
        return self.layer_intermediate_sizes[layer] if self.layer_intermediate_sizes else self.intermediate_size

    def rotary_dim_at(self, layer: int) -> int:
        """The leading dims of each of the layer's heads that rotate: the same fraction of every layer's heads."""
        return self.rotary_dim * self.head_dim_at(layer) // self.head_dim

    @property
    def headless_kind(self) -> str:
        """What a refusal of a head this checkpoint lacks calls it: a base model, or a causal LM."""
        return f"{self.base_model} is a base model" if self.base_model else f"{self.architecture} is a causal LM"

    @property
    def no_token_logits(self) -> str | None:
        """Why this checkpoint has no token logits, to refuse what reads them with (a classifier's head or a base
        model's last hidden states stand where the unembedding would); None where it has them."""
        if self.classifier_labels:
            return f"{self.classifier_name}: {NO_TOKEN_LOGITS}"
        return f"{self.base_model}: {NO_LM_HEAD}" if self.base_model else None

    # TransformerLens's names for the same numbers: ported notebooks read `model.cfg.n_layers` (HookedLM.cfg)
    n_layers = property(lambda self: self.num_layers)
    d_model = property(lambda self: self.hidden_size)
    n_heads = property(lambda self: self.num_heads)
    n_key_value_heads = property(lambda self: self.num_kv_heads)
    d_head = property(lambda self: self.head_dim)
    d_mlp = property(lambda self: self.intermediate_size)
    d_vocab = property(lambda self: self.vocab_size)
    n_ctx = property(lambda self: self.max_position_embeddings)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a transformers config object (parsed by AutoConfig, never run)."""
        arch = supported_architecture(getattr(hf, "architectures", None), getattr(hf, "model_type", None))
        if arch in TEXT_MODELS:  # (the text model of a multimodal checkpoint; its eos where it gives one, and its
            # tying, which is what HF follows)
            text = cls.from_hf(hf.text_config)
            eos = _token_ids(getattr(hf, "eos_token_id", None)) or text.eos_token_ids
            tied = bool(getattr(hf, "tie_word_embeddings", text.tie_word_embeddings))
            deep = len(getattr(getattr(hf, "vision_config", None), "deepstack_visual_indexes", None) or ())
            return dataclasses.replace(text, stored_as=TEXT_MODELS[arch], eos_token_ids=eos, deepstack_layers=deep,
                                       **{"tie_word_embeddings": tied} | _headless(hf))  # fmt: skip
        spec = ARCHITECTURES[arch]
        flags = dict(spec.flags)
        if "qkv_bias" not in flags:
            bias = bool(getattr(hf, "attention_bias", False))
            flags.update(qkv_bias=bias, o_bias=flags.get("o_bias", bias))
        heads = getattr(hf, "num_attention_heads", 0)  # (none in a Mamba: its reader says so)
        head_dim = (_global(hf, "head_dim") or hf.hidden_size // heads) if heads else 0
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        if "full_attention" in rope:  # Gemma 3: one rope per layer type
            sliding_theta, sliding_scaling = _rope(rope.get("sliding_attention") or {}, hf)
            flags.update(sliding_rope_theta=sliding_theta, sliding_rope_scaling=sliding_scaling)
            rope = dict(rope["full_attention"] or {})
        theta, scaling = _rope(rope, hf)
        partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None) or 1.0)
        if getattr(hf, "model_type", None) in M_ROPE:
            flags["mrope_section"] = tuple(rope.get("mrope_section", M_ROPE[hf.model_type]))
            flags["mrope_interleaved"] = hf.model_type in INTERLEAVED_M_ROPE
        eos = _token_ids(getattr(hf, "eos_token_id", None))  # (a multimodal text config may have none)
        fields = dict(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=getattr(hf, "intermediate_size", None),
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=_global(hf, "num_key_value_heads") or heads,
            head_dim=head_dim,
            norm_eps=getattr(hf, "rms_norm_eps", None),
            rope_theta=theta,
            rope_scaling=scaling,
            rotary_dim=0 if flags.get("learned_positions") else int(head_dim * partial),
            max_position_embeddings=getattr(hf, "max_position_embeddings", None),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            hidden_act=getattr(hf, "hidden_act", None),
            sliding_windows=_sliding_windows(hf) if spec.windowed else (None,) * hf.num_hidden_layers,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos,
        )
        fields |= flags
        if spec.read is not None:
            fields |= spec.read(hf)
        return cls(**fields | _headless(hf))


# HF's sequence and token classifiers, and Qwen's outcome and process reward models (Qwen2.5-Math-RM and -PRM: remote
# code that vLLM runs): a causal LM's decoder under a head (`score`, or some families' token classifiers'
# `classifier`; a reward model's a Linear, ReLU, Linear) that reads the final norm's last row, or every row
CLASSIFIERS = ("ForSequenceClassification", "ForTokenClassification", "ForRewardModel", "ForProcessRewardModel")
PER_TOKEN = CLASSIFIERS[1:]
# a reward model's classes, whatever its config says (vLLM's): an outcome model's score; a process model's step wrong
# or right
REWARD_CLASSES = {"ForRewardModel": 1, "ForProcessRewardModel": 2}
# what a classifier's requests for token logits are told (its unembedding is a placeholder: vlens.classify)
NO_TOKEN_LOGITS = ("a classifier has no token logits; its classes come from LLM.classify (or the server's "
                   "/classify; a token classifier's from LLM.encode and /pooling), and its taps from prefill-only "
                   "requests (max_tokens=0)")
BASE = "Model"  # HF's base models (LlamaModel, Qwen2Model, ...: embedding models' checkpoints), the decoder alone
NO_LM_HEAD = ("a base model's checkpoint has no LM head, so no token logits; its last hidden states come from "
              "LLM.embed and LLM.encode (the server's /v1/embeddings and /pooling), and its taps from prefill-only "
              "requests (max_tokens=0)")


def _base_of(arch: str, model_type: str | None) -> str | None:
    """The causal LM whose decoder a base model's architecture is (LlamaModel: LlamaForCausalLM; by its model type, as
    a classifier's), if vlens runs it."""
    if not arch.endswith(BASE) or arch.endswith(CLASSIFIERS) or arch in ARCHITECTURES or arch in TEXT_MODELS:
        return None  # (Qwen's ...ForRewardModel is a classifier)
    causal = MODEL_TYPES.get(model_type)
    return causal if causal in ARCHITECTURES else None


def _headless(hf: Any) -> dict[str, Any]:
    """A classifier's or a base model's fields (a causal LM has none), and the widths its embeddings may be cut to
    (ModelConfig.matryoshka). A headless model's unembedding is the embedding, tied: a placeholder taking no memory,
    which nothing reads (it has no token logits: ModelConfig.no_token_logits)."""
    arch = (getattr(hf, "architectures", None) or [""])[0]
    dims = tuple(getattr(hf, "matryoshka_dimensions", None) or ())
    matryoshka = dict(matryoshka=bool(dims) or bool(getattr(hf, "is_matryoshka", False)), matryoshka_dimensions=dims)
    if _base_of(arch, getattr(hf, "model_type", None)) is not None:
        return dict(base_model=arch, tie_word_embeddings=True) | matryoshka
    if not arch.endswith(CLASSIFIERS):
        return matryoshka
    tokens, two_way = _classifier_tokens(hf)
    classes = next((n for suffix, n in REWARD_CLASSES.items() if arch.endswith(suffix)), hf.num_labels)
    labels = tokens[1:] if two_way else tokens or tuple(str(hf.id2label.get(i, f"LABEL_{i}")) for i in range(classes))
    problem = getattr(hf, "problem_type", None)
    activation = "identity" if problem == "regression" else \
        "sigmoid" if problem == "multi_label_classification" or len(labels) < 2 else "softmax"  # fmt: skip
    return dict(classifier_labels=labels, classifier_name=arch, classifier_activation=activation,
                classifier_per_token=arch.endswith(PER_TOKEN), tie_word_embeddings=True,
                classifier_tokens=tokens, classifier_two_way=two_way,
                pairs_joined=not getattr(hf, "use_pad_token", not tokens))  # fmt: skip


CLASSIFIER_METHODS = ("from_2_way_softmax", "no_post_processing")  # vLLM's, for a head made of tokens' rows


def _classifier_tokens(hf: Any) -> tuple[tuple[str, ...], bool]:
    """(the tokens whose unembedding rows make a classifier's head, whether by two-way softmax): vLLM's
    classifier_from_token and method (Qwen3-Reranker's is_original_qwen3_reranker: from_2_way_softmax); ((), False)
    for a head of its own."""
    tokens = getattr(hf, "classifier_from_token", None)
    method = getattr(hf, "method", None)
    if method is None and getattr(hf, "is_original_qwen3_reranker", False):
        method = CLASSIFIER_METHODS[0]
    if method is None:
        return (), False
    if method not in CLASSIFIER_METHODS:
        raise UnsupportedModelError(f"method: {method!r} is not allowed; expected one of "
                                    f"{', '.join(CLASSIFIER_METHODS)} (vLLM's heads of classifier_from_token's rows)")
    wanted = 2 if method == CLASSIFIER_METHODS[0] else None
    if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, str) for t in tokens) \
            or (wanted is not None and len(tokens) != wanted):  # fmt: skip
        raise UnsupportedModelError(f"classifier_from_token: {tokens!r} is not allowed; {method} reads "
                                    f"{'two tokens (the no and the yes)' if wanted else 'a list of tokens'}")
    return tuple(tokens), method == CLASSIFIER_METHODS[0]


def supported_architecture(architectures: list[str] | None, model_type: str | None) -> str:
    """The architecture a config names (configs saved without a model, or by hand, may give only a
    model_type), if vlens runs it; else an UnsupportedModelError listing those it does."""
    arch = (architectures or [None])[0]
    if arch is None:
        arch = MODEL_TYPES.get(model_type)
    elif arch.endswith(CLASSIFIERS) and model_type in MODEL_TYPES:  # (its decoder, its model type's: vlens.classify)
        arch = MODEL_TYPES[model_type]
    elif _base_of(arch, model_type) is not None:
        arch = _base_of(arch, model_type)
    if arch not in ARCHITECTURES and arch not in TEXT_MODELS:
        supported = ", ".join(sorted([*ARCHITECTURES, *TEXT_MODELS]))
        raise UnsupportedModelError(
            f"architecture {arch!r} (model_type {model_type!r}) is not supported by vlens; "
            f"supported architectures: {supported}; and the {' and '.join(CLASSIFIERS)} and the base {BASE} of each "
            "...ForCausalLM"
        )
    return arch


def _global(hf: Any, name: str) -> Any:
    """`hf.<name>` or None; where the config's layers differ in it (Gemma 4's head_dim), the value of the layers no
    override changes, which transformers refuses to read as the model's (vlens reads each layer's from
    `hf.per_layer_config`)."""
    if name in (getattr(hf, "per_layer_attributes", None) or ()):
        return vars(hf).get(name)
    return getattr(hf, name, None)


def _token_ids(ids: int | list[int] | None) -> tuple[int, ...]:
    return () if ids is None else tuple(ids) if isinstance(ids, (list, tuple)) else (ids,)


# text models whose rotary reads three positions (mrope_section), with HF's sections where a checkpoint names none
M_ROPE = {"qwen2_vl_text": (16, 24, 24), "qwen2_5_vl_text": (16, 24, 24), "glm4v_text": (8, 12, 12),
          "glm4v_moe_text": (8, 12, 12), "qwen3_vl_text": (24, 20, 20), "qwen3_vl_moe_text": (24, 20, 20)}  # fmt: skip
INTERLEAVED_M_ROPE = ("qwen3_vl_text", "qwen3_vl_moe_text")  # (their frequencies take t, h, w in turn)


def _rope(params: dict, hf: Any) -> tuple[float, dict | None]:
    """(base, scaling) from one HF rope_parameters dict; scaling is None for plain RoPE. LongRoPE gets the
    lengths it needs filled in from the config, as HF does."""
    theta = float(params.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0))
    if params.get("rope_type", "default") == "default":
        return theta, None
    scaling = dict(params)
    if scaling["rope_type"] in ("longrope", "yarn"):
        original = scaling.get("original_max_position_embeddings") or hf.original_max_position_embeddings
        scaling["original_max_position_embeddings"] = original
        if scaling.get("factor") is None:
            scaling["factor"] = hf.max_position_embeddings / original
    return theta, scaling


def _sliding_windows(hf: Any) -> tuple[int | None, ...]:
    """Per-layer window, following HF: Mistral windows every layer, Qwen and Gemma mark layers in `layer_types`."""
    window = getattr(hf, "sliding_window", None)
    n = hf.num_hidden_layers
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (window,) * n
