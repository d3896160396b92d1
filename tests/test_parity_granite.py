"""Granite (IBM, 3.x) against HF on tiny random checkpoints: Llama's layer with four multipliers (the embeddings, the
attention scores in place of 1/sqrt(d), each sublayer's output before the residual add, the logits divided); every
tap, packed against alone, greedy generation through the paged cache; TransformerLens's head results, scaled as the
stream gets them."""

from __future__ import annotations

import torch
from conftest import rel_err
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_feature_matters,
    family_fixture,
    sequences,
)
from transformers import GraniteConfig

MULTIPLIERS = dict(embedding_multiplier=12.0, attention_multiplier=0.05, residual_multiplier=0.22, logits_scaling=8.0)
CONFIGS = {
    "granite": lambda: GraniteConfig(**COMMON, num_key_value_heads=2, **MULTIPLIERS),
    "granite_biased_tied": lambda: GraniteConfig(**COMMON, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                                 **MULTIPLIERS),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    pass


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "granite" and (cfg.attn_scale, cfg.embedding_multiplier) == (0.05, 12.0)
    assert (cfg.residual_multiplier, cfg.logits_scaling) == (0.22, 8.0)
    assert cfg.mlp_bias == cfg.qkv_bias == (name == "granite_biased_tied")


def test_every_multiplier_is_reached(tmp_path):
    for name, value in MULTIPLIERS.items():
        check_feature_matters(CONFIGS["granite"](), tmp_path / name, **{name: 1.0 if value != 1.0 else 2.0})


def test_head_and_neuron_results_sum_to_what_the_stream_gets(tmp_path):
    from vlens import HookedLM

    hooked = HookedLM(build(CONFIGS["granite"](), tmp_path, "granite"), dtype="float32", device="cpu")
    _, cache = hooked.run_with_cache(torch.tensor([sequences((12,))[0]]))
    heads = cache.stack_head_results(layer=1)
    assert rel_err(heads.sum(0), cache["blocks.0.hook_attn_out"]) <= 1e-5
    neurons = cache.stack_neuron_results(layer=1)
    assert rel_err(neurons.sum(0), cache["blocks.0.hook_mlp_out"]) <= 1e-5


def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path):
    check_bfloat16_taps(CONFIGS["granite"](), tmp_path)
