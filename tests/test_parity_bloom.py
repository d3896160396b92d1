"""BLOOM (560M to 176B, BLOOMZ; multilingual, with no position embedding) against HF on tiny random checkpoints:
ALiBi's per-head biases on every score (in the written-out attention, the captured scores and patterns, generation
through the paged cache), q, k and v fused per head, a LayerNorm after the embedding, BLOOM's GELU; every tap,
packed against alone, greedy generation; and TransformerLens's own BLOOM on the same weights."""

from __future__ import annotations

import pytest
import torch
from family_parity import (
    VOCAB,
    GenerationParity,
    TapParity,
    build,
    check_transformer_lens_names,
    family_fixture,
    sequences,
)
from transformers import AutoModelForCausalLM, BloomConfig

from vlens import LLM
from vlens.config import UnsupportedModelError

BLOOM = dict(vocab_size=VOCAB, hidden_size=64, n_layer=3, n_head=4, initializer_range=0.1)
CONFIGS = {
    "bloom": lambda: BloomConfig(**BLOOM),
    # six heads: slopes for the largest power of two (4), then two more of the next scheme
    "bloom_six_heads": lambda: BloomConfig(**(BLOOM | {"hidden_size": 96, "n_head": 6}), tie_word_embeddings=False),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    pass


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "bloom" and cfg.alibi and cfg.rotary_dim == 0 and not cfg.learned_positions
    assert cfg.hidden_act == "bloom_gelu" and cfg.intermediate_size == 4 * cfg.hidden_size
    assert all(attn.kind.alibi for attn in llm.model.attention_layers())
    assert llm.engine.runner.decode_backend.paged is None  # (the paged kernels add no ALiBi: decode gathers)


def test_alibi_is_reached(tmp_path):
    """HF's BLOOM with its biases off (every slope 0) differs: the sequences reach the biases the parity checks."""
    import transformers.models.bloom.modeling_bloom as bloom

    path = build(CONFIGS["bloom"](), tmp_path, "bloom")
    llm = LLM(model=path, dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = sequences()[-1]
    got = llm.trace([ids], hooks="unembed.hook_out")[0]["unembed.hook_out"]
    original = bloom._get_alibi_slopes
    bloom._get_alibi_slopes = lambda heads, device: torch.zeros(heads, device=device)
    try:
        with torch.no_grad():
            without = hf(torch.tensor([ids])).logits[0]
    finally:
        bloom._get_alibi_slopes = original
    assert (got - without).norm() / without.norm() > 1e-3


def test_transformer_lens_names_the_same_values(tmp_path):
    """TransformerLens's own BLOOM on the same weights: the same values under every name both have, but the scores:
    TransformerLens's ALiBi is relative to the query (slope * (key - query)), HF's to the sequence's start (slope *
    key), a constant apart in each row, which the softmax (hook_pattern, the same) does not see."""
    from transformer_lens.pretrained.weight_conversions import convert_bloom_weights

    path = build(CONFIGS["bloom"](), tmp_path, "bloom")
    check_transformer_lens_names(path, convert_bloom_weights, {
        "ln1.hook_scale", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_pattern",
        "attn.hook_z", "hook_attn_out", "hook_resid_mid", "mlp.hook_post", "hook_mlp_out", "hook_resid_post"},
        differ=frozenset({"attn.hook_attn_scores"}))  # fmt: skip


def test_other_backends_refuse_alibi_by_name(tmp_path):
    path = build(CONFIGS["bloom"](), tmp_path, "bloom")
    with pytest.raises(ValueError, match="'flex' .*adds no ALiBi biases.*use sdpa"):
        LLM(model=path, dtype="float32", device="cpu", attention_backend="flex")
    config = BloomConfig(**BLOOM, apply_residual_connection_post_layernorm=True)
    with pytest.raises(UnsupportedModelError, match="apply_residual_connection_post_layernorm=True"):
        LLM(model=build(config, tmp_path / "post", "bloom"), dtype="float32", device="cpu")
