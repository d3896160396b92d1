"""Nemotron (NVIDIA's Minitron 4B and 8B, Nemotron-Mini 4B, Mistral-NeMo-Minitron 8B) against HF on tiny random
checkpoints: Llama's attention with partial rotary (half of each head by default), LayerNorms that scale by 1 + w
(LayerNorm1P), an MLP not gated of squared ReLUs; every tap, packed against alone, greedy generation through the
paged cache, bfloat16 bit for bit."""

from __future__ import annotations

from family_parity import COMMON, GenerationParity, TapParity, check_bfloat16_taps, family_fixture
from transformers import NemotronConfig

CONFIGS = {
    "nemotron": lambda: NemotronConfig(**COMMON, num_key_value_heads=2),
    "nemotron_biased_tied": lambda: NemotronConfig(**COMMON, num_key_value_heads=4, attention_bias=True, mlp_bias=True,
                                                   tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                   "rope_theta": 500.0, "partial_rotary_factor": 0.25}),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """Every tap against HF, packed against alone, greedy generation through the paged cache."""


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "arcee" and cfg.norm == "layer_offset" and cfg.hidden_act == "relu2"
    biased = name == "nemotron_biased_tied"
    assert cfg.num_kv_heads == (4 if biased else 2) and cfg.rotary_dim == (4 if biased else 8)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (biased,) * 3
    assert (llm.model.lm_head.weight is llm.model.embed_tokens.weight) == hf.config.tie_word_embeddings


def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path):
    check_bfloat16_taps(CONFIGS["nemotron"](), tmp_path)
