"""The other models built on DeepSeek-V3's multi-head latent attention, against HF on tiny random checkpoints:
GLM-4.7-Flash (Glm4MoeLite: DeepSeek-V3's layer, its dense and expert layers as mlp_layer_types lists them) and
Youtu-LLM (Tencent's: the latent attention with a dense MLP on every layer, tied), MiniCPM3 (OpenBMB's: V2's latent
attention by halves with µP's scales) and Mistral 4 (the latent attention
with Llama 4's attention temperature on q, DeepSeek's experts by a softmax within the best groups, a group scored by
its best two); every tap, packed against alone,
greedy generation through the paged cache, bfloat16 bit for bit."""

from __future__ import annotations

import pytest
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    check_bfloat16_taps,
    check_feature_matters,
    family_fixture,
)
from test_parity_deepseek import LATENT
from transformers import Glm4MoeLiteConfig, MiniCPM3Config, Mistral4Config, YoutuConfig

EXPERTS = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
               routed_scaling_factor=1.8, n_group=4, topk_group=2)  # fmt: skip
MISTRAL4_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                     beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.5,
                     partial_rotary_factor=0.5)  # fmt: skip
CONFIGS = {
    "glm4_moe_lite": lambda: Glm4MoeLiteConfig(**(COMMON | LATENT | EXPERTS),
                                               mlp_layer_types=["sparse", "dense", "sparse"]),  # fmt: skip
    "youtu": lambda: YoutuConfig(**(COMMON | LATENT), rope_interleave=False),
    # MiniCPM3: V2's latent attention by halves, µP's scales on the embedding, each sublayer's output and the logits
    "minicpm3": lambda: MiniCPM3Config(**(COMMON | LATENT), scale_emb=6.0, scale_depth=1.4, dim_model_base=16),
    # (HF's rotary is head_dim (16) times partial_rotary_factor wide: the rotating part's 8; YaRN, the temperature's
    # original context 16: the sequences reach past it twice)
    "mistral4": lambda: Mistral4Config(**(COMMON | LATENT | EXPERTS | dict(qk_nope_head_dim=8)),
                                       first_k_dense_replace=1, rope_parameters=MISTRAL4_ROPE),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.1.attn.hook_kv_latent", "blocks.2.attn.hook_v")


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "deepseek" and (cfg.head_dim, cfg.rotary_dim, cfg.v_head_dim) == (
        16 if name == "mistral4" else 20, 8, 10)  # fmt: skip
    if name == "mistral4":
        assert cfg.moe_layers == (False, True, True) and not cfg.sigmoid_routing and not cfg.expert_bias
        assert cfg.expert_groups == (4, 2) and cfg.group_scores_top2 and cfg.attn_temperature == (0.5, 16)
    elif name == "minicpm3":
        assert not cfg.moe_layers and not cfg.rotary_interleaved and not cfg.rotary_pairs
        assert (cfg.embedding_multiplier, cfg.logits_scaling) == (6.0, 4.0)
        assert abs(cfg.residual_multiplier - 1.4 / 3**0.5) < 1e-12
    elif name == "glm4_moe_lite":
        assert cfg.moe_layers == (True, False, True) and cfg.deepseek_moe and cfg.sigmoid_routing
        assert cfg.expert_groups == (4, 2) and cfg.rotary_interleaved
    else:
        assert not cfg.moe_layers and not cfg.num_experts and not cfg.rotary_interleaved and cfg.tie_word_embeddings


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bfloat16_taps(tmp_path, name):
    check_bfloat16_taps(CONFIGS[name](), tmp_path)


def test_mistral4_temperature_is_reached(tmp_path):
    """HF's Mistral 4 without its attention temperature differs: the sequences reach past its original context."""
    without = MISTRAL4_ROPE | {"llama_4_scaling_beta": 0.0}
    check_feature_matters(CONFIGS["mistral4"](), tmp_path, rope_parameters=without)
