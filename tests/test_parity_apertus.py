"""Apertus (Swiss AI's open model) against HF on tiny random checkpoints: Qwen3's attention (q/k norms head by head)
under norms of Apertus's names, an MLP that is not gated, with the xIELU activation whose weights each layer learns;
every tap, packed against alone, greedy generation through the paged cache, bfloat16 bit for bit; and
TransformerLens's own Apertus on the same weights."""

from __future__ import annotations

import torch
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_feature_matters,
    check_transformer_lens_names,
    family_fixture,
    sequences,
)
from transformers import ApertusConfig, AutoModelForCausalLM

from vlens import LLM

LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
CONFIGS = {
    "apertus": lambda: ApertusConfig(**COMMON, num_key_value_heads=2, rope_parameters=LLAMA3),
    "apertus_tied_mha": lambda: ApertusConfig(**COMMON, tie_word_embeddings=True),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    pass


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "apertus" and cfg.qk_norm == "head" and cfg.hidden_act == "xielu" and not cfg.mlp_bias
    assert (llm.model.lm_head.weight is llm.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    assert llm.hook_names()["blocks.0.mlp.hook_post"] == (COMMON["intermediate_size"],)


def test_xielu_weights_are_reached(tmp_path):
    """HF's Apertus with the activation as it was initialised differs: the parity reads each layer's xIELU weights
    (build() moves them off their init)."""
    path = build(CONFIGS["apertus"](), tmp_path, "apertus")
    llm = LLM(model=path, dtype="float32", device="cpu")
    fresh = AutoModelForCausalLM.from_config(ApertusConfig(**COMMON, num_key_value_heads=2, rope_parameters=LLAMA3))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for layer, init in zip(hf.model.layers, fresh.model.layers):
        layer.mlp.act_fn.load_state_dict(init.mlp.act_fn.state_dict())
    ids = sequences()[-1]
    got = llm.trace([ids], hooks="unembed.hook_out")[0]["unembed.hook_out"]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (got - ref).norm() / ref.norm() > 1e-3


def test_llama3_rope_is_reached(tmp_path):
    check_feature_matters(CONFIGS["apertus"](), tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path):
    check_bfloat16_taps(CONFIGS["apertus"](), tmp_path)


def test_transformer_lens_names_the_same_values(tmp_path):
    """TransformerLens's own Apertus on the same weights: the same values under every name both have."""
    from transformer_lens.pretrained.weight_conversions.apertus import convert_apertus_weights

    path = build(CONFIGS["apertus"](), tmp_path, "apertus")
    check_transformer_lens_names(path, convert_apertus_weights, {
        "ln1.hook_scale", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_pattern",
        "attn.hook_z", "hook_attn_out", "hook_resid_mid", "mlp.hook_post", "hook_mlp_out", "hook_resid_post"},
        weights=("W_Q", "W_O", "W_in", "W_out", "W_E", "W_U"))  # fmt: skip
