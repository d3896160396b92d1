"""StarCoder2 (BigCode's code models) against HF on tiny random checkpoints: Mistral's attention with biases and
sliding windows the test sequences outrun, LayerNorms, an MLP that is not gated (c_fc, tanh GELU, c_proj); every
tap, packed against alone, greedy generation through the paged cache, bfloat16 bit for bit."""

from __future__ import annotations

from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    check_bfloat16_taps,
    check_feature_matters,
    family_fixture,
)
from transformers import Starcoder2Config

CONFIGS = {
    "starcoder2": lambda: Starcoder2Config(**COMMON, num_key_value_heads=2, sliding_window=8),
    "starcoder2_no_bias_untied": lambda: Starcoder2Config(**COMMON, num_key_value_heads=1, use_bias=False,
                                                          tie_word_embeddings=False),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    pass


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "starcoder2" and cfg.norm == "layer" and cfg.hidden_act == "gelu_pytorch_tanh"
    biased = name == "starcoder2"
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (biased,) * 3
    assert cfg.sliding_windows == ((8,) * 3 if biased else (None,) * 3)
    assert (llm.model.lm_head.weight is llm.model.embed_tokens.weight) == hf.config.tie_word_embeddings


def test_window_is_reached(tmp_path):
    check_feature_matters(CONFIGS["starcoder2"](), tmp_path, sliding_window=64)


def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path):
    check_bfloat16_taps(CONFIGS["starcoder2"](), tmp_path)