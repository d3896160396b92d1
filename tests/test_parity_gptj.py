"""GPT-J (the model of ROME, MEMIT and much knowledge-editing work) and CodeGen (GPT-J's layer, q, k and v in one
projection in a model-parallel layout) against HF on tiny random checkpoints: rotary by pairs over the leading
rotary_dim dims of each head (or all of them), one LayerNorm for both sublayers under the parallel residual, the
biased unembedding; every tap, packed against alone, greedy generation; and TransformerLens's own GPT-J on the same
weights."""

from __future__ import annotations

from family_parity import (
    VOCAB,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_feature_matters,
    check_transformer_lens_names,
    family_fixture,
)
from transformers import CodeGenConfig, GPTJConfig

GPTJ = dict(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=128, initializer_range=0.1)
CONFIGS = {
    "gptj_partial": lambda: GPTJConfig(**GPTJ, rotary_dim=8),  # (GPT-J 6B rotates 64 of its 256)
    "gptj_full_rotary": lambda: GPTJConfig(**GPTJ, rotary_dim=16, activation_function="gelu"),
    # two heads in each of qkv_proj's four shards of rows (CodeGen-350M: four of 16), half of each head rotating
    "codegen": lambda: CodeGenConfig(**GPTJ | dict(n_embd=128, n_head=8), rotary_dim=8),
    # one head across two shards (HF reads the rows all the same)
    "codegen_two_heads": lambda: CodeGenConfig(**GPTJ | dict(n_embd=32, n_head=2), rotary_dim=16),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """Every tap against HF, packed against alone, greedy generation through the paged cache."""


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert cfg.family == name.partition("_")[0] and cfg.parallel_residual and cfg.rotary_pairs
    assert (cfg.rotary_dim, cfg.head_dim) == (16 if name.endswith(("full_rotary", "two_heads")) else 8, 16)
    assert cfg.intermediate_size == 4 * cfg.hidden_size and not cfg.tie_word_embeddings
    assert cfg.rope_float32 == (cfg.family == "codegen")  # (HF's CodeGen rotates in float32, GPT-J in the model's)
    assert not (cfg.qkv_bias or cfg.o_bias) and cfg.mlp_bias and llm.model.lm_head.bias is not None


def test_codegen_bfloat16_taps_are_hfs_bit_for_bit(tmp_path):
    check_bfloat16_taps(CONFIGS["codegen"](), tmp_path)


def test_rotation_by_pairs_is_reached(tmp_path):
    """HF's GPT-J rotating one pair of dims a head, not four, differs: the sequences reach the rotation the parity
    checks (which, by halves instead of pairs, would put every q and k elsewhere)."""
    check_feature_matters(CONFIGS["gptj_partial"](), tmp_path, rotary_dim=2)


def test_transformer_lens_names_the_same_values(tmp_path):
    """TransformerLens's own GPT-J on the same weights: the same values under every name both have."""
    from transformer_lens.pretrained.weight_conversions import convert_gptj_weights

    path = build(CONFIGS["gptj_partial"](), tmp_path, "gptj")
    check_transformer_lens_names(path, convert_gptj_weights, {
        "ln1.hook_scale", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_pattern",
        "attn.hook_z", "hook_attn_out", "mlp.hook_post", "hook_mlp_out", "hook_resid_post"})  # fmt: skip
