"""OPT (125M to 66B; the model of much work on outlier features and massive activations) against HF on tiny random
checkpoints: GPT-2's layer under OPT's names, learned positions two rows down their table, queries scaled after
their projection, a ReLU MLP on the layer itself; every tap, packed against alone, greedy generation through the
paged cache, bfloat16 bit for bit; and TransformerLens's own OPT on the same weights. XGLM and BioGPT, OPT's layer
from the same fairseq decoder with a scaled embedding (XGLM's positions sines and cosines), against HF the same way."""

from __future__ import annotations

import pytest
from family_parity import (
    VOCAB,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_capturing_step_compiles,
    check_feature_matters,
    check_transformer_lens_names,
    family_fixture,
)
from transformers import BioGptConfig, OPTConfig, XGLMConfig

from vlens import LLM
from vlens.config import UnsupportedModelError

OPT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, ffn_dim=96,
           max_position_embeddings=128, init_std=0.1, pad_token_id=1, bos_token_id=2, eos_token_id=2)  # fmt: skip
CONFIGS = {
    "opt": lambda: OPTConfig(**OPT),
    "opt_untied_gelu_no_bias": lambda: OPTConfig(**OPT, tie_word_embeddings=False, activation_function="gelu",
                                                 enable_bias=False),  # fmt: skip
}

FAIRSEQ = dict(vocab_size=VOCAB, max_position_embeddings=128, init_std=0.1, pad_token_id=1, bos_token_id=2,
               eos_token_id=2)  # fmt: skip
FAIRSEQ_CONFIGS = {
    # (XGLM's sines and cosines over an odd width: a zero column after them; the embedding scaled)
    "xglm": lambda: XGLMConfig(**FAIRSEQ, d_model=62, num_layers=3, attention_heads=2, ffn_dim=96),
    "xglm_unscaled_relu": lambda: XGLMConfig(**FAIRSEQ, d_model=64, num_layers=3, attention_heads=4, ffn_dim=96,
                                             scale_embedding=False, activation_function="relu"),  # fmt: skip
    "biogpt": lambda: BioGptConfig(**FAIRSEQ, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                   intermediate_size=96, initializer_range=0.1),  # fmt: skip
}
CONFIGS |= FAIRSEQ_CONFIGS

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("hook_pos_embed",)


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == name.partition("_")[0] and cfg.norm == "layer" and cfg.learned_positions
    assert cfg.rotary_dim == 0
    if name in FAIRSEQ_CONFIGS:
        scaled = getattr(hf.config, "scale_embedding")
        assert cfg.embedding_multiplier == (cfg.hidden_size**0.5 if scaled else 1.0) and cfg.qkv_bias and cfg.mlp_bias
        # (XGLM scales its queries, as OPT; BioGPT its scores, as the default None says)
        assert (cfg.attn_scale, cfg.query_scale) == ((1.0, cfg.head_dim**-0.5) if name.startswith("xglm") else
                                                     (None, None))  # fmt: skip
        return
    assert cfg.attn_scale == 1.0 and cfg.query_scale == 16**-0.5 and cfg.intermediate_size == 96
    assert (llm.model.lm_head.weight is llm.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    biased = name == "opt"
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.hidden_act) == (biased,) * 3 + ("relu" if biased else "gelu",)


@pytest.mark.parametrize("name", ["opt", "biogpt"])
def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path, name):
    """In bfloat16 every tap equals HF's (SDPA) bit for bit: the queries rounded after their scale, as HF's. (Not
    XGLM's: HF's attends with a bmm of its own, its probabilities rounded to bfloat16 before they weigh the values;
    its embedding, positions, q, k and v are HF's bit for bit, the attention's output 0.016 apart.)"""
    check_bfloat16_taps(CONFIGS[name](), tmp_path)


def test_xglm_positions_and_scale_are_reached(tmp_path):
    """HF's XGLM with its embedding unscaled differs: the parity reaches the scale (and the positions, which HF
    computes, are the ones the taps compare)."""
    check_feature_matters(CONFIGS["xglm"](), tmp_path, scale_embedding=False)


def test_transformer_lens_names_the_same_values(tmp_path):
    """TransformerLens's own OPT on the same weights: the same values under every name both have, and the same
    weight matrices (its W_pos from position 0 on)."""
    from transformer_lens.pretrained.weight_conversions import convert_opt_weights

    path = build(CONFIGS["opt"](), tmp_path, "opt")
    check_transformer_lens_names(path, convert_opt_weights, {
        "ln1.hook_scale", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_pattern",
        "attn.hook_z", "hook_attn_out", "hook_resid_mid", "mlp.hook_post", "hook_mlp_out", "hook_resid_post"},
        weights=("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "b_in", "W_out", "b_out", "W_E",
                 "W_pos", "W_U"))  # fmt: skip


def test_opt_350m_layout_is_refused_by_name(tmp_path):
    for flag, value in (("do_layer_norm_before", False), ("word_embed_proj_dim", 32)):
        path = build(OPTConfig(**OPT, **{flag: value}), tmp_path / flag, "opt")
        with pytest.raises(UnsupportedModelError, match=f"{flag}={value}.*OPT-350M"):
            LLM(model=path, dtype="float32", device="cpu")


def test_a_capturing_step_compiles_whole(tmp_path):
    """XGLM's positions, a table of the model's own (no module's weight), read by index inside the step: a
    capturing, steering step of it compiles whole."""
    check_capturing_step_compiles(build(CONFIGS["xglm"](), tmp_path, "compiled"), "hook_pos_embed")
