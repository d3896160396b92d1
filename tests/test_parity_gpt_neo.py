"""GPT-Neo (gpt-neo-125M to 2.7B, and the TinyStories models much interpretability work trains SAEs and finds
circuits on) against HF on tiny random checkpoints: GPT-2's model with q, k and v projected apart without biases,
unscaled attention scores, and local layers whose window the test sequences outrun; every tap, packed against
alone, greedy generation through the paged cache; and TransformerLens's own GPT-Neo on the same weights."""

from __future__ import annotations

from family_parity import (
    VOCAB,
    GenerationParity,
    TapParity,
    build,
    check_feature_matters,
    check_transformer_lens_names,
    family_fixture,
)
from transformers import GPTNeoConfig

NEO = dict(vocab_size=VOCAB, hidden_size=64, num_layers=3, num_heads=4, max_position_embeddings=128,
           initializer_range=0.1, window_size=8)  # fmt: skip
CONFIGS = {
    # global, local, global (the released models alternate, global first)
    "gpt_neo": lambda: GPTNeoConfig(**NEO, attention_types=[[["global", "local"], 1], [["global"], 1]]),
    "gpt_neo_local_first_gelu": lambda: GPTNeoConfig(
        **NEO, attention_types=[[["local", "global"], 1], [["local"], 1]], activation_function="gelu",
        intermediate_size=80, tie_word_embeddings=False,
    ),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("hook_pos_embed",)


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "gpt_neo" and cfg.norm == "layer" and cfg.learned_positions and cfg.rotary_dim == 0
    assert cfg.attn_scale == 1.0 and not cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias
    assert (llm.model.lm_head.weight is llm.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    if name == "gpt_neo":
        assert cfg.sliding_windows == (None, 8, None)
        assert (cfg.hidden_act, cfg.intermediate_size) == ("gelu_new", 256)
    else:
        assert cfg.sliding_windows == (8, None, 8)
        assert (cfg.hidden_act, cfg.intermediate_size) == ("gelu", 80)


def test_local_window_is_reached(tmp_path):
    """HF's GPT-Neo with a wider window differs: the sequences reach the local layers' window the parity checks."""
    check_feature_matters(CONFIGS["gpt_neo"](), tmp_path, window_size=64)


def test_transformer_lens_names_the_same_values(tmp_path):
    """TransformerLens's own GPT-Neo on the same weights: the same values under every name both have, and the same
    weight matrices (its W_Q, W_K, W_V from the projections apart, zero b_Q, b_K, b_V, b_U)."""
    from transformer_lens.pretrained.weight_conversions import convert_neo_weights

    path = build(CONFIGS["gpt_neo"](), tmp_path, "gpt_neo")
    check_transformer_lens_names(path, convert_neo_weights, {
        "ln1.hook_scale", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_pattern",
        "attn.hook_z", "hook_attn_out", "hook_resid_mid", "mlp.hook_post", "hook_mlp_out", "hook_resid_post"},
        weights=("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "b_in", "W_out", "b_out", "W_E",
                 "W_pos", "W_U", "b_U"))  # fmt: skip
