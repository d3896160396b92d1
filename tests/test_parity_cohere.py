"""Cohere (Command R, Aya Expanse), Cohere 2 (Command R7B, Command A) and Cohere 2's MoE models against HF on tiny
random checkpoints: one LayerNorm without a bias for both sublayers under the parallel residual (or, MoE, an RMSNorm),
rotary by pairs (Cohere 2: on its sliding-window layers alone, the others without positions; MoE: on its dense layers
too where HF forces it), the scaled logits; MoE: routed experts by the softmax or the sigmoids (renormalised or not) of
the top k logits, shared experts averaged or summed in, dense layers first; every tap, packed against alone, greedy
generation, bfloat16; per-head q/k LayerNorms (Command R+) refused by name."""

from __future__ import annotations

import pytest
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_feature_matters,
    family_fixture,
)
from transformers import Cohere2Config, Cohere2MoeConfig, CohereConfig

from vlens import LLM
from vlens.config import UnsupportedModelError

MOE = COMMON | dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, intermediate_size=32, num_experts=4,
                   num_experts_per_tok=2, num_shared_experts=2, prefix_dense_intermediate_size=80, sliding_window=7,
                   sliding_window_pattern=2, logit_scale=0.5, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2)  # fmt: skip
CONFIGS = {
    "cohere_gqa": lambda: CohereConfig(**COMMON, num_key_value_heads=2, logit_scale=0.5),
    "cohere2_windows_bias": lambda: Cohere2Config(
        **COMMON, num_key_value_heads=2, sliding_window=7, attention_bias=True, logit_scale=0.25,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),  # fmt: skip
    # MoE: one dense layer first (full attention, rotating: HF's force_rope), then windows on every other layer;
    # experts by the softmax of the top 2 logits, beside two shared experts' width, averaged in; Cohere's LayerNorm
    "cohere2_moe": lambda: Cohere2MoeConfig(**MOE, first_k_dense_replace=1),
    # ... an RMSNorm, the renormalised sigmoids of the top 2, one shared expert summed in, two dense layers in their
    # own window pattern (every other one), the full-attention one without rotary
    "cohere2_moe_sigmoid": lambda: Cohere2MoeConfig(**(MOE | dict(
        rms_norm_eps=1e-5, expert_selection_fn="sigmoid", shared_expert_combination_strategy="sum",
        num_shared_experts=1, prefix_dense_sliding_window_pattern=2, first_k_dense_replace=2))),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """Every tap against HF, packed against alone, greedy generation through the paged cache."""

    def required_hooks(self, llm):
        if not llm.config.num_experts:
            return []
        moe = llm.config.moe_layers.index(True)
        return [f"blocks.{moe}.mlp.hook_expert_weights", f"blocks.{moe}.mlp.shared_expert.hook_post",
                "blocks.0.mlp.hook_post"]  # fmt: skip


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert cfg.family == "cohere" and cfg.parallel_residual and cfg.rotary_pairs
    assert cfg.norm == ("rms" if name == "cohere2_moe_sigmoid" else "layer_cohere")
    assert cfg.tie_word_embeddings and llm.model.model.norm.weight is not None
    if name.startswith("cohere2_moe"):
        sigmoid = name.endswith("sigmoid")
        assert cfg.logit_scale == 0.5
        assert cfg.moe_layers == ((False, False, True, True) if sigmoid else (False, True, True, True))
        # (the windowed layers rotate, and the dense one where HF forces it: full attention, yet rotated)
        assert cfg.sliding_windows == ((7, None, 7, None) if sigmoid else (None, 7, None, 7))
        assert cfg.nope_layers == ((False, True, False, True) if sigmoid else (False, False, True, False))
        assert (cfg.sigmoid_after_topk, cfg.softmax_after_topk, cfg.norm_topk_prob) == (sigmoid, not sigmoid, sigmoid)
        assert cfg.shared_expert_mix == ("sum" if sigmoid else "average")
        assert cfg.shared_expert_intermediate_size == (32 if sigmoid else 64) and cfg.intermediate_size == 80
    elif name == "cohere_gqa":
        assert cfg.logit_scale == 0.5 and cfg.nope_layers == () and cfg.sliding_windows == (None,) * 3
    else:
        assert cfg.logit_scale == 0.25 and cfg.nope_layers == (False, False, True) and cfg.qkv_bias
        assert cfg.sliding_windows == (7, 7, None)


def test_the_logit_scale_and_the_windows_are_reached(tmp_path):
    check_feature_matters(CONFIGS["cohere_gqa"](), tmp_path / "scale", logit_scale=1.0)
    check_feature_matters(CONFIGS["cohere2_windows_bias"](), tmp_path / "windows", sliding_window=1000)


def test_the_moe_options_are_reached(tmp_path):
    """HF's model with the shared experts summed (not averaged), with the sigmoids not renormalised, or with the dense
    layer not rotated gives other logits: the parity above holds because vlens reads each option as HF does."""
    check_feature_matters(CONFIGS["cohere2_moe"](), tmp_path / "mix", shared_expert_combination_strategy="sum")
    check_feature_matters(CONFIGS["cohere2_moe_sigmoid"](), tmp_path / "norm", norm_topk_prob=False)
    check_feature_matters(CONFIGS["cohere2_moe"](), tmp_path / "rope", prefix_dense_sliding_window_pattern=2)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bfloat16_taps(name, tmp_path):
    """(rotated in float32 by tables rounded to bfloat16, as HF's Cohere rotates)"""
    check_bfloat16_taps(CONFIGS[name](), tmp_path)


def test_per_head_qk_layernorms_are_refused(tmp_path):
    path = build(CohereConfig(**COMMON, use_qk_norm=True), tmp_path, "qk_norm")
    with pytest.raises(UnsupportedModelError, match="use_qk_norm=True is not supported"):
        LLM(model=path, dtype="float32", device="cpu")
