"""Phi (1, 1.5, 2) against HF on tiny random checkpoints: every tap (one LayerNorm for both sublayers, whose ln2
taps read it again as TransformerLens's tied ln2 does; biases everywhere, the unembedding's too; partial rotary),
packed against alone, greedy generation through the paged cache; and the values TransformerLens gives the same
weights."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, VOCAB, GenerationParity, TapParity, build, family_fixture, sequences
from hf_reference import same
from transformers import AutoModelForCausalLM, PhiConfig

from vlens import LLM, HookedLM
from vlens.config import UnsupportedModelError

PHI = dict(COMMON, hidden_act="gelu_new", pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "phi2_partial_rotary": lambda: PhiConfig(**PHI),  # half of each head rotates, as in Phi-2
    "phi_gqa_quarter_rotary": lambda: PhiConfig(
        **PHI, num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.25}
    ),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """Every hook (ln2's the norm's second reading), packed against alone, generation."""


def test_config_and_hook_names(family):
    _, _, llm, hf = family
    cfg = llm.config
    assert (cfg.family, cfg.norm, cfg.parallel_residual, cfg.mlp_bias) == ("phi", "layer", True, True)
    assert cfg.rotary_dim == int(cfg.head_dim * hf.config.rope_parameters["partial_rotary_factor"])
    names = llm.hook_names()
    assert "blocks.1.hook_resid_mid" not in names and "blocks.1.ln2.hook_normalized" in names
    assert torch.equal(llm.model.lm_head.bias, hf.lm_head.bias.detach())  # the unembedding's bias, loaded


def test_transformer_lens_gives_the_same_values(tmp_path):
    """TransformerLens's Phi (its ln2 a copy of ln1, its unembedding with b_U) on the same weights: HookedLM's
    cache holds the same values under every name both have, and b_U is the head's bias."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_phi_weights

    path = build(PhiConfig(**PHI), tmp_path, "phi")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = HookedTransformerConfig(n_layers=3, d_model=64, d_head=16, n_heads=4, d_mlp=96, d_vocab=VOCAB, n_ctx=128,
                                  act_fn="gelu_new", normalization_type="LN", eps=hf.config.layer_norm_eps,
                                  positional_embedding_type="rotary", rotary_dim=8, rotary_base=10000,
                                  parallel_attn_mlp=True, original_architecture="PhiForCausalLM")  # fmt: skip
    reference = HookedTransformer(cfg)
    reference.load_state_dict(convert_phi_weights(hf, cfg), strict=False)
    tokens = torch.tensor([sequences()[-1]])
    hooked = HookedLM(path, dtype="float32", device="cpu")
    logits, cache = hooked.run_with_cache(tokens)
    with torch.no_grad():
        ref_logits, ref_cache = reference.run_with_cache(tokens)
    assert rel_err(logits, ref_logits) <= 1e-5
    assert torch.equal(hooked.b_U, reference.b_U.detach())
    renamed = {name.replace("hook_rot_", "hook_"): name for name in ref_cache if not name.endswith(("hook_q", "hook_k"))}
    common = sorted(set(renamed) & set(cache))
    assert {"blocks.1.ln2.hook_normalized", "blocks.1.attn.hook_q", "blocks.1.mlp.hook_post"} <= set(common)
    for name in common:
        assert same(cache[name], ref_cache[renamed[name]], 1e-5), name


def test_qk_layernorm_is_refused_by_name(tmp_path):
    path = build(PhiConfig(**PHI, qk_layernorm=True), tmp_path, "phi_qk")
    with pytest.raises(UnsupportedModelError, match=r"^qk_layernorm=True is not supported for PhiForCausalLM"):
        LLM(path, dtype="float32", device="cpu")
