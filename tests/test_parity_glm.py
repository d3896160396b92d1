"""GLM (GLM-4-9B-0614, GLM-Edge) and GLM-4 (0414, GLM-Z1) against HF on tiny random checkpoints: q/k/v biases (none on
o), rotary by pairs over the leading half of each head (or all of it), gate and up stored as one gate_up_proj; GLM-4's
sandwich of norms under its own names (its post_attention_layernorm is the pre-MLP norm: ln2; the post-norms
TransformerLens's ln1_post and ln2_post); every tap, packed against alone, greedy generation; bfloat16 bit for bit."""

from __future__ import annotations

import pytest
from family_parity import COMMON, GenerationParity, TapParity, check_bfloat16_taps, family_fixture
from transformers import Glm4Config, GlmConfig

SIZES = COMMON | dict(num_key_value_heads=2, head_dim=16, pad_token_id=0)
CONFIGS = {
    "glm": lambda: GlmConfig(**SIZES),
    # (no q/k/v biases, every dim of a head rotating, one KV head, tied)
    "glm_full_rotary": lambda: GlmConfig(**(SIZES | dict(attention_bias=False, num_key_value_heads=1,
                                                          tie_word_embeddings=True, partial_rotary_factor=1.0))),
    "glm4": lambda: Glm4Config(**SIZES),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    def required_hooks(self, llm):
        post = ["ln1_post.hook_normalized", "attn.hook_out", "ln2_post.hook_scale", "mlp.hook_out"]
        return [f"blocks.1.{hook}" for hook in post] if llm.config.post_norms else ["blocks.1.hook_resid_mid"]


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert cfg.rotary_pairs and cfg.gate_up_stored_fused and not cfg.stored_fused and not cfg.o_bias
    assert cfg.rotary_dim == (16 if name == "glm_full_rotary" else 8) and cfg.qkv_bias == (name != "glm_full_rotary")
    assert cfg.family == ("glm4" if name == "glm4" else "llama") and cfg.post_norms == (name == "glm4")


@pytest.mark.parametrize("name", ["glm", "glm4"])
def test_bfloat16_taps(tmp_path, name):
    check_bfloat16_taps(CONFIGS[name](), tmp_path)
