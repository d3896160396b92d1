"""Jais 2 (Inception: Arcee's layer with LayerNorms and biases everywhere), nanochat (Karpathy's: Arcee's layer with
norms without weights, one after the embedding too, rotary by minus the angle, weightless q/k norms after it,
soft-capped logits), K-EXAONE (LG's ExaoneMoe: EXAONE 4's attention in a
pre-norm layer, DeepSeek-V3's experts), CWM (Meta's Code World Model: Mistral's
layer, windows on three of every four layers), VaultGemma (Google's differentially private Gemma: Gemma 2 without its
post-norms) and Solar Open (Upstage: Llama's attention, DeepSeek-V3's experts on every layer) against HF on tiny random
checkpoints: every tap, packed against alone, greedy generation through the paged cache, bfloat16 bit for bit."""

from __future__ import annotations

import pytest
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    check_bfloat16_taps,
    check_feature_matters,
    family_fixture,
)
from transformers import CwmConfig, ExaoneMoeConfig, Jais2Config, NanoChatConfig, SolarOpenConfig, VaultGemmaConfig

MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1, n_group=2,
           topk_group=1, routed_scaling_factor=2.5)  # fmt: skip
CONFIGS = {
    "jais2": lambda: Jais2Config(**COMMON, num_key_value_heads=2),
    "nanochat": lambda: NanoChatConfig(**COMMON, num_key_value_heads=2, final_logit_softcapping=3.0),
    "cwm": lambda: CwmConfig(**COMMON, num_key_value_heads=2, sliding_window=8),
    "vaultgemma": lambda: VaultGemmaConfig(**COMMON, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                           sliding_window=8, attn_logit_softcapping=2.0,
                                           final_logit_softcapping=3.0),  # fmt: skip
    # K-EXAONE: EXAONE 4's attention (rotary on the windowed layers alone) in a pre-norm layer, V3's experts
    "exaone_moe": lambda: ExaoneMoeConfig(**COMMON, num_key_value_heads=2, head_dim=16, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=48, num_shared_experts=1,
                                          n_group=2, topk_group=1, sliding_window=8, sliding_window_pattern=2),
    "solar_open": lambda: SolarOpenConfig(**{k: v for k, v in COMMON.items() if k != "intermediate_size"}, **MOE,
                                          num_key_value_heads=2, head_dim=16, attention_bias=True),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """Every tap against HF, packed against alone, greedy generation through the paged cache."""


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    if name == "jais2":
        assert cfg.family == "arcee" and cfg.norm == "layer" and cfg.hidden_act == "relu2"
        assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias
    elif name == "nanochat":
        assert cfg.family == "nanochat" and cfg.norm == "rms_unweighted" and cfg.qk_norm == "l2_after_rotary"
        assert cfg.rotary_reversed and cfg.final_softcap == 3.0 and not cfg.tie_word_embeddings
        assert llm.model.final_norm.weight is None and llm.model.layers[0].ln1.weight is None
    elif name == "cwm":
        assert cfg.family == "llama" and not cfg.qkv_bias and cfg.sliding_windows == (None, 8, 8)
        assert cfg.rope_scaling["rope_type"] == "llama3"
    elif name == "vaultgemma":
        assert cfg.family == "vaultgemma" and cfg.norm == "rms_offset" and cfg.embed_scale and not cfg.post_norms
        assert (cfg.attn_softcap, cfg.final_softcap, cfg.attn_scale) == (2.0, 3.0, 0.25)
        assert cfg.sliding_windows == (8, None, 8)
    elif name == "exaone_moe":
        assert cfg.qk_norm == "head" and cfg.pre_norms and not cfg.post_norms and cfg.deepseek_moe
        assert cfg.moe_layers == (False, True, True) and cfg.nope_layers == (False, True, False)
        assert cfg.sliding_windows == (8, None, 8) and cfg.shared_expert_intermediate_size == 48
    else:
        assert cfg.deepseek_moe and cfg.moe_layers == (True,) * 3 and cfg.expert_groups == (2, 1)
        assert cfg.qkv_bias and not cfg.o_bias and cfg.routed_scaling == 2.5 and cfg.rotary_dim == 16


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path, name):
    check_bfloat16_taps(CONFIGS[name](), tmp_path)


def test_cwm_window_is_reached(tmp_path):
    check_feature_matters(CONFIGS["cwm"](), tmp_path, sliding_window=64)
