"""GPT-2 against HF on tiny random checkpoints: learned positions (hook_pos_embed), LayerNorm with
bias, Conv1D weights, and the attention-scale options; every tap, packed against alone, generation."""

from __future__ import annotations

from family_parity import VOCAB, GenerationParity, TapParity, family_fixture
from transformers import GPT2Config

GPT2 = {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 128, "initializer_range": 0.1}

CONFIGS = {
    "gpt2": lambda: GPT2Config(**GPT2),
    "gpt2_untied_gelu_inner_scaled": lambda: GPT2Config(
        **GPT2, tie_word_embeddings=False, activation_function="gelu", n_inner=80, scale_attn_by_inverse_layer_idx=True
    ),
    "gpt2_unscaled": lambda: GPT2Config(**(GPT2 | {"initializer_range": 0.05}), scale_attn_weights=False),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("hook_pos_embed",)


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "gpt2" and cfg.norm == "layer" and cfg.learned_positions and cfg.rotary_dim == 0
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (llm.model.lm_head.weight is llm.model.embed_tokens.weight) == cfg.tie_word_embeddings
    assert "hook_pos_embed" in llm.hook_names()
    if name == "gpt2_untied_gelu_inner_scaled":
        assert (cfg.hidden_act, cfg.intermediate_size, cfg.attn_scale_inverse_layer) == ("gelu", 80, True)
    else:
        assert cfg.hidden_act == "gelu_new" and cfg.intermediate_size == 256
