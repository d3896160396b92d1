"""LFM3 (Liquid) against HF on tiny random checkpoints: LFM2's layers (gated short convolutions on most, attention on
the others) with Qwen3's attention names and a gate a head (g_proj), windows on its sliding-attention layers, each layer
kind its rope (the full layers' proportional: half of each head's pairs turning), and each sublayer's output normed
before the add (use_sandwich_norm) or not; every tap, packed against alone, greedy generation through the paged cache
and the state slots, bfloat16 bit for bit."""

from __future__ import annotations

from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_every_tap,
    check_feature_matters,
    family_fixture,
    load_pair,
    sequences,
)
from transformers import Lfm3Config

LAYERS = ["conv", "full_attention", "sliding_attention"]
LFM3 = dict(num_key_value_heads=2, head_dim=16, sliding_window=8, layer_types=LAYERS, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)  # fmt: skip
CONFIGS = {
    "lfm3": lambda: Lfm3Config(**COMMON, **LFM3),
    "lfm3_plain": lambda: Lfm3Config(**COMMON, **LFM3, use_sandwich_norm=False, use_attention_gate=False),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.0.conv.hook_conv_out", "blocks.1.attn.hook_z")


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    sandwich = name == "lfm3"
    assert cfg.family == "lfm3" and cfg.conv_layers == (True, False, False) and cfg.sliding_windows == (None, None, 8)
    assert cfg.post_norms == sandwich and cfg.attn_gate_width == (1 if sandwich else 0) and cfg.rotary_dim == 16
    assert cfg.sliding_rope_theta == 10000.0 and cfg.rope_scaling["rope_type"] == "proportional"


def test_window_is_reached(tmp_path):
    check_feature_matters(CONFIGS["lfm3"](), tmp_path, sliding_window=64)


def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path):
    check_bfloat16_taps(CONFIGS["lfm3"](), tmp_path)


def test_multimodal_text_model(tmp_path):
    """Lfm3VlForConditionalGeneration's text model (LFM3-VL), under model.language_model., against HF's model given
    text."""
    from transformers.models.lfm3_vl.configuration_lfm3_vl import Lfm3VlConfig

    path = build(Lfm3VlConfig(text_config=CONFIGS["lfm3"]().to_dict(), image_token_id=299), tmp_path, "lfm3_vl")
    llm, hf = load_pair(path)
    assert llm.config.architecture == "Lfm3ForCausalLM" and llm.config.stored_as[0] == "model.language_model."
    check_every_tap(llm, hf, sequences())
