"""GLM (GLM-4-9B-0614, GLM-Edge), GLM-4 (0414, GLM-Z1) and GLM-4.5 to 4.7 (MoE) against HF on tiny random
checkpoints: q/k/v biases (none on
o), rotary by pairs over the leading half of each head (or all of it), gate and up stored as one gate_up_proj; GLM-4's
sandwich of norms under its own names (its post_attention_layernorm is the pre-MLP norm: ln2; the post-norms
TransformerLens's ln1_post and ln2_post); GLM-4.5's experts chosen as DeepSeek-V3 chooses (a float32 router's
sigmoids plus a correction bias) beside a shared expert, after a dense layer, q/k norms or none; every tap, packed
against alone, greedy generation; bfloat16 bit for bit; routing limited to groups of experts."""

from __future__ import annotations

import pytest
import torch
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_every_tap,
    family_fixture,
    load_pair,
    sequences,
)
from transformers import Glm4Config, Glm4MoeConfig, GlmConfig

SIZES = COMMON | dict(num_key_value_heads=2, head_dim=16, pad_token_id=0)
EXPERTS = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
               routed_scaling_factor=2.5, first_k_dense_replace=1, attention_bias=True)  # fmt: skip
CONFIGS = {
    "glm": lambda: GlmConfig(**SIZES),
    # (no q/k/v biases, every dim of a head rotating, one KV head, tied)
    "glm_full_rotary": lambda: GlmConfig(**(SIZES | dict(attention_bias=False, num_key_value_heads=1,
                                                          tie_word_embeddings=True, partial_rotary_factor=1.0))),
    "glm4": lambda: Glm4Config(**SIZES),
    "glm4_moe": lambda: Glm4MoeConfig(**(SIZES | EXPERTS)),
    # (q/k norms head by head, no q/k/v biases)
    "glm4_moe_qk_norm": lambda: Glm4MoeConfig(**(SIZES | EXPERTS | dict(use_qk_norm=True, attention_bias=False))),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.1.hook_mlp_out",)

    def required_hooks(self, llm):
        post = ["ln1_post.hook_normalized", "attn.hook_out", "ln2_post.hook_scale", "mlp.hook_out"]
        return [f"blocks.1.{hook}" for hook in post] if llm.config.post_norms else ["blocks.1.hook_resid_mid"]


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    if name.startswith("glm4_moe"):  # (rotary by halves, q/k/v apart, gate and up apart)
        assert not (cfg.rotary_pairs or cfg.gate_up_stored_fused) and cfg.rotary_dim == 8 and cfg.deepseek_moe
        assert cfg.moe_layers == (False, True, True) and cfg.shared_expert_intermediate_size == 32
        assert cfg.qk_norm == ("head" if name == "glm4_moe_qk_norm" else "") and cfg.routed_scaling == 2.5
        assert llm.model.layers[1].mlp.gate.weight.dtype == torch.float32
        return
    assert cfg.rotary_pairs and cfg.gate_up_stored_fused and not cfg.stored_fused and not cfg.o_bias
    assert cfg.rotary_dim == (16 if name == "glm_full_rotary" else 8) and cfg.qkv_bias == (name != "glm_full_rotary")
    assert cfg.family == ("glm4" if name == "glm4" else "llama") and cfg.post_norms == (name == "glm4")


@pytest.mark.parametrize("name", ["glm", "glm4", "glm4_moe"])
def test_bfloat16_taps(tmp_path, name):
    check_bfloat16_taps(CONFIGS[name](), tmp_path)


def test_routing_limited_to_groups_of_experts(tmp_path):
    """Each token's experts from its best group of two (DeepSeek-V3's group-limited routing): every tap as HF's."""
    llm, hf = load_pair(build(Glm4MoeConfig(**(SIZES | EXPERTS | dict(n_group=2, topk_group=1))), tmp_path, "grouped"))
    assert llm.config.expert_groups == (2, 1)
    check_every_tap(llm, hf, sequences()[1:])
