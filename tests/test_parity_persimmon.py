"""Persimmon (Adept's Persimmon-8B; Fuyu-8B's language model) against HF on tiny random checkpoints: GPT-NeoX's
fused attention with a LayerNorm a head over q and over k (or none), Llama's sequential layer of LayerNorms, rotary
by halves over part of each head, squared ReLUs; every tap, packed against alone, greedy generation through the
paged cache, bfloat16 bit for bit."""

from __future__ import annotations

from family_parity import VOCAB, GenerationParity, TapParity, check_bfloat16_taps, check_feature_matters, family_fixture
from transformers import PersimmonConfig

PERSIMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 max_position_embeddings=128, initializer_range=0.1)  # fmt: skip
CONFIGS = {
    # (Persimmon-8B's rope base)
    "persimmon": lambda: PersimmonConfig(**PERSIMMON, rope_parameters={"rope_type": "default", "rope_theta": 25000.0,
                                                                       "partial_rotary_factor": 0.5}),  # fmt: skip
    "persimmon_no_qk_norm": lambda: PersimmonConfig(**PERSIMMON, qk_layernorm=False, hidden_act="gelu",
                                                    tie_word_embeddings=True),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """Every tap against HF, packed against alone, greedy generation through the paged cache."""


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "persimmon" and cfg.norm == "layer" and not cfg.parallel_residual and not cfg.rotary_pairs
    assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias and llm.model.lm_head.bias is None
    assert cfg.qk_norm == ("head" if name == "persimmon" else "")
    assert cfg.rotary_dim == 8 and cfg.hidden_act == hf.config.hidden_act  # (half of each head: HF's default too)
    if cfg.qk_norm:
        assert llm.model.layers[0].self_attn.q_layernorm.bias is not None  # (HF's names, biases included)


def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path):
    check_bfloat16_taps(CONFIGS["persimmon"](), tmp_path)


def test_the_head_norms_are_reached(tmp_path):
    """HF's Persimmon without its q and k LayerNorms differs: the parity reaches them."""
    check_feature_matters(CONFIGS["persimmon"](), tmp_path, qk_layernorm=False)
