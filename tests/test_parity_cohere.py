"""Cohere (Command R, Aya Expanse) and Cohere 2 (Command R7B, Command A) against HF on tiny random checkpoints: one
LayerNorm without a bias for both sublayers under the parallel residual, rotary by pairs (Cohere 2: on its
sliding-window layers alone, the others without positions), the scaled logits; every tap, packed against alone,
greedy generation; per-head q/k LayerNorms (Command R+) refused by name."""

from __future__ import annotations

import pytest
from family_parity import COMMON, GenerationParity, TapParity, build, check_feature_matters, family_fixture
from transformers import Cohere2Config, CohereConfig

from vlens import LLM
from vlens.config import UnsupportedModelError

CONFIGS = {
    "cohere_gqa": lambda: CohereConfig(**COMMON, num_key_value_heads=2, logit_scale=0.5),
    "cohere2_windows_bias": lambda: Cohere2Config(
        **COMMON, num_key_value_heads=2, sliding_window=7, attention_bias=True, logit_scale=0.25,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """Every tap against HF, packed against alone, greedy generation through the paged cache."""


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert cfg.family == "cohere" and cfg.norm == "layer_nobias" and cfg.parallel_residual and cfg.rotary_pairs
    assert cfg.tie_word_embeddings and llm.model.model.norm.weight is not None
    if name == "cohere_gqa":
        assert cfg.logit_scale == 0.5 and cfg.nope_layers == () and cfg.sliding_windows == (None,) * 3
    else:
        assert cfg.logit_scale == 0.25 and cfg.nope_layers == (False, False, True) and cfg.qkv_bias
        assert cfg.sliding_windows == (7, 7, None)


def test_the_logit_scale_and_the_windows_are_reached(tmp_path):
    check_feature_matters(CONFIGS["cohere_gqa"](), tmp_path / "scale", logit_scale=1.0)
    check_feature_matters(CONFIGS["cohere2_windows_bias"](), tmp_path / "windows", sliding_window=1000)


def test_per_head_qk_layernorms_are_refused(tmp_path):
    path = build(CohereConfig(**COMMON, use_qk_norm=True), tmp_path, "qk_norm")
    with pytest.raises(UnsupportedModelError, match="use_qk_norm=True is not supported"):
        LLM(model=path, dtype="float32", device="cpu")
