"""MiniMax-M2 against HF on tiny random checkpoints: q/k norms over each whole projection, rotary over part of each
head, routed experts alone on every layer, chosen by the float32 sigmoids of the router's logits plus a correction
bias per expert (the MoE block's e_score_correction_bias) and renormalised; every tap, packed against alone, greedy
generation; bfloat16 bit for bit; one compiled graph of a capturing step."""

from __future__ import annotations

import pytest
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_capturing_step_compiles,
    family_fixture,
)
from transformers import MiniMaxM2Config

SIZES = COMMON | dict(num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2,
                      intermediate_size=32, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
CONFIGS = {
    "minimax_m2": lambda: MiniMaxM2Config(**SIZES, rotary_dim=8),
    # (every dim of a head rotating, one KV head, three experts a token)
    "minimax_m2_full_rotary": lambda: MiniMaxM2Config(**(SIZES | dict(num_key_value_heads=1, num_experts_per_tok=3))),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.1.mlp.hook_expert_ids", "blocks.1.mlp.hook_expert_weights")


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert cfg.qk_norm == "projection" and cfg.sigmoid_routing and cfg.sigmoid_float32 and cfg.expert_bias
    assert cfg.rotary_dim == (8 if name == "minimax_m2" else 16) and cfg.moe_layers == (True,) * 3
    assert cfg.shared_expert_intermediate_size == 0 and cfg.moe_intermediate_size == 32 and cfg.norm_topk_prob


@pytest.mark.parametrize("name", ["minimax_m2"])
def test_bfloat16_taps(tmp_path, name):
    check_bfloat16_taps(CONFIGS[name](), tmp_path)


def test_a_capturing_step_compiles_whole(tmp_path):
    """The float32 sigmoids plus the block's bias, the projections' norms: one graph, captures and steering."""
    check_capturing_step_compiles(build(CONFIGS["minimax_m2"](), tmp_path, "compiled"), "blocks.1.hook_mlp_out")
