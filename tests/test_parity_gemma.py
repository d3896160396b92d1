"""Gemma 2 and Gemma 3 against HF on tiny random checkpoints: every tap, packed against alone, greedy
generation through the paged cache, and that each quirk (soft-capping, the two rope bases, sliding
windows) is reached by these sequences, so the parity proves something about it."""

from __future__ import annotations

import pytest
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    check_feature_matters,
    check_generation,
    family_fixture,
    sequences,
)
from transformers import Gemma2Config, Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

from vlens import LLM

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
GEMMA = dict(COMMON, num_key_value_heads=2, head_dim=24, sliding_window=7, layer_types=LAYER_TYPES)

CONFIGS = {
    "gemma2": lambda: Gemma2Config(
        **GEMMA, query_pre_attn_scalar=20, attn_logit_softcapping=2.0, final_logit_softcapping=3.0
    ),
    # attn_logit_softcapping is in Gemma 3's config but HF's Gemma 3 never applies it; neither may vlens.
    "gemma3": lambda: Gemma3TextConfig(
        **GEMMA,
        query_pre_attn_scalar=32,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=4.0,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    ),
    "gemma3_mqa_tied_bias": lambda: Gemma3TextConfig(
        **(GEMMA | {"num_key_value_heads": 1, "head_dim": 16}), attention_bias=True, tie_word_embeddings=True
    ),
    # Gemma 3 4B, 12B and 27B are multimodal checkpoints: their text model (under language_model.), text in
    "gemma3_multimodal": lambda: Gemma3Config(
        text_config=Gemma3TextConfig(**GEMMA, query_pre_attn_scalar=32).to_dict(),
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14).to_dict(),
        mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298, eos_token_id=[1, 106],
    ),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """Generation: prompts longer than the 7-token window, 4-token cache blocks, so the window is applied
    over the paged cache, across block boundaries, in prefill and decode."""


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "gemma" and cfg.norm == "rms_offset" and cfg.embed_scale
    assert cfg.sliding_windows == (7, None, 7)
    text = getattr(hf.config, "text_config", hf.config)  # (a multimodal checkpoint's: its text model's)
    assert cfg.attn_scale == text.query_pre_attn_scalar**-0.5
    assert cfg.final_softcap == text.final_logit_softcapping
    assert cfg.attn_softcap == (2.0 if name == "gemma2" else None)
    assert cfg.qk_norm == ("head" if name.startswith("gemma3") else "")
    if name == "gemma3":
        assert (cfg.rope_theta, cfg.sliding_rope_theta) == (1000000.0, 100.0)
    if name == "gemma3_multimodal":  # (the tensors under language_model., the checkpoint's own eos)
        assert cfg.architecture == "Gemma3ForCausalLM" and cfg.stored_as == ("language_model.model.", "language_model.lm_head.")
        assert cfg.eos_token_ids == (1, 106)


def test_chunked_prefill_past_the_window_matches_hf(family):
    """Steps of at most 5 tokens: each prefill chunk attends over earlier chunks' keys in the cache."""
    _, path, _, hf = family
    chunked = LLM(model=path, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=5)
    check_generation(chunked, hf, sequences((20, 9)))


FEATURE_OFF = {
    "gemma2": [{"attn_logit_softcapping": None}, {"final_logit_softcapping": None}, {"sliding_window": 1000}],
    "gemma3": [
        {"final_logit_softcapping": None},
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            }
        },
    ],
}


@pytest.mark.parametrize("name, off", [(n, o) for n, offs in FEATURE_OFF.items() for o in offs])
def test_the_feature_matters_for_these_sequences(name, off, tmp_path):
    check_feature_matters(CONFIGS[name](), tmp_path, **off)
