"""ERNIE 4.5's MoE models against HF on tiny random checkpoints: the dense model's layer (rotary by pairs in float32,
one bias flag) with routed experts beside shared ones on the MoE layers, chosen by a float32 router's softmax plus a
correction bias per expert (stored [1, E] in the block's moe_statics), renormalised and rounded to the model's dtype;
every tap, packed against alone, greedy generation; bfloat16 bit for bit."""

from __future__ import annotations

import torch
from family_parity import COMMON, GenerationParity, TapParity, check_bfloat16_taps, family_fixture
from transformers import Ernie4_5_MoeConfig

SIZES = COMMON | dict(num_key_value_heads=2, moe_intermediate_size=32, moe_num_experts=6, moe_k=2,
                      moe_num_shared_experts=1)  # fmt: skip
CONFIGS = {
    "ernie4_5_moe": lambda: Ernie4_5_MoeConfig(**SIZES),
    # (biases, experts on every other layer from the first, no shared expert, three a token)
    "ernie4_5_moe_biased": lambda: Ernie4_5_MoeConfig(**(SIZES | dict(use_bias=True, moe_layer_start_index=0,
                                                                      moe_layer_interval=2, moe_num_shared_experts=0,
                                                                      moe_k=3))),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.1.mlp.hook_router_logits", "blocks.1.hook_mlp_out")


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert cfg.deepseek_moe and cfg.expert_bias and not cfg.sigmoid_routing and cfg.rotary_pairs and cfg.rope_float32
    assert cfg.moe_layers == ((False, True, False) if name == "ernie4_5_moe_biased" else (False, True, True))
    assert cfg.shared_expert_intermediate_size == (0 if name == "ernie4_5_moe_biased" else 32)
    assert cfg.routing_norm_min == 1e-12 and cfg.round_routing_weights
    assert cfg.qkv_bias == cfg.lm_head_bias == (name != "ernie4_5_moe")
    assert llm.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_bfloat16_taps(tmp_path):
    check_bfloat16_taps(CONFIGS["ernie4_5_moe_biased"](), tmp_path)
