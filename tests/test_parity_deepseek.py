"""DeepSeek-V2 and V3 (V3.1, R1, Kimi K2, Moonlight) against HF on tiny random checkpoints: multi-head latent
attention (queries through a low-rank projection and its norm, or one projection as V2-Lite's; keys and values from
one normed latent a token, the keys' rotating part one for all heads; values of their own size; V3's rotary by pairs
laid out by halves, or by halves; V2's by pairs in float32; YaRN's mscale_all_dim in the softmax scale) and DeepSeek's
experts after a dense layer (V3: sigmoids plus a correction bias; V2: a float32 softmax; routing limited to the best
groups of experts or not); every tap, packed against alone, greedy generation (under memory pressure too); bfloat16
bit for bit; one compiled graph of a capturing step."""

from __future__ import annotations

import math

import pytest
import torch
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_capturing_step_compiles,
    check_generation_under_pressure,
    family_fixture,
    same,
    sequences,
)
from transformers import DeepseekV2Config, DeepseekV3Config

from vlens import HookedLM

LATENT = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, pad_token_id=0,
              num_key_value_heads=4)
EXPERTS = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
               routed_scaling_factor=2.5, first_k_dense_replace=1, n_group=4, topk_group=2)  # fmt: skip
YARN = dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                                 mscale=1.0, mscale_all_dim=0.8))  # fmt: skip
CONFIGS = {
    "deepseek_v3": lambda: DeepseekV3Config(**(COMMON | LATENT | EXPERTS | YARN)),
    # (rotary by halves, one query projection, routing over every expert, the weights not renormalised)
    "deepseek_v3_plain": lambda: DeepseekV3Config(**(COMMON | LATENT | EXPERTS | dict(
        rope_interleave=False, q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False))),
    # (V2-Lite's one query projection, greedy routing)
    "deepseek_v2": lambda: DeepseekV2Config(**(COMMON | LATENT | EXPERTS | dict(q_lora_rank=None))),
    "deepseek_v2_grouped": lambda: DeepseekV2Config(**(COMMON | LATENT | EXPERTS | YARN | dict(
        topk_method="group_limited_greedy"))),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.1.mlp.hook_expert_ids", "blocks.2.attn.hook_v")

    def required_hooks(self, llm):  # (the latents where the model has them: V2-Lite's queries have none)
        latents = ("attn.hook_q_latent",) * bool(llm.config.q_lora_rank) + ("attn.hook_kv_latent",)
        return [f"blocks.1.{hook}" for hook in (*latents, "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z",
                                                "mlp.hook_expert_weights", "mlp.shared_expert.hook_post")]  # fmt: skip


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert (cfg.head_dim, cfg.rotary_dim, cfg.v_head_dim, cfg.kv_lora_rank) == (20, 8, 10, 16)
    assert cfg.q_lora_rank == (0 if name in ("deepseek_v3_plain", "deepseek_v2") else 24)
    assert cfg.moe_layers == (False, True, True) and cfg.deepseek_moe and cfg.shared_expert_intermediate_size == 32
    assert cfg.expert_groups == ((4, 2) if name in ("deepseek_v3", "deepseek_v2_grouped") else (1, 1))
    assert cfg.rotary_interleaved == (name == "deepseek_v3") and cfg.rotary_pairs == name.startswith("deepseek_v2")
    assert cfg.sigmoid_routing == name.startswith("deepseek_v3") and llm.model.layers[1].mlp.gate.weight.dtype == \
        torch.float32  # fmt: skip
    mscale = 0.1 * 0.8 * math.log(4.0) + 1 if name in ("deepseek_v3", "deepseek_v2_grouped") else 1.0
    assert cfg.attn_scale == pytest.approx(20**-0.5 * mscale**2)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_grouped"])
def test_bfloat16_taps(tmp_path, name):
    check_bfloat16_taps(CONFIGS[name](), tmp_path)


def test_generation_under_pressure(tmp_path):
    """Keys and values of 192 tokens (the values padded to the keys' size) for three sequences of 90: preempted."""
    path = build(CONFIGS["deepseek_v2_grouped"](), tmp_path, "pressure")
    check_generation_under_pressure(path, 192 * 3 * 2 * 4 * 20 * 4, "blocks.2.attn.hook_v")


def test_a_capturing_step_compiles_whole(tmp_path):
    """The latents, the rotating parts and the grouped routing in fixed shapes: one graph, captures and steering."""
    check_capturing_step_compiles(build(CONFIGS["deepseek_v3"](), tmp_path, "compiled"), "blocks.1.attn.hook_z")


def test_transformer_lens_style_calls(tmp_path):
    """HookedLM: the heads' results (hook_z through each head's W_O, of the values' size) sum to each layer's attention
    output less b_O; W_O is TransformerLens's; what latent attention has no one matrix for is refused by name."""
    model = HookedLM(build(CONFIGS["deepseek_v3"](), tmp_path, "deepseek_v3"), dtype="float32", device="cpu")
    _, cache = model.run_with_cache(torch.tensor([sequences()[-1]]))
    heads = cache.stack_head_results(layer=2)
    assert heads.shape[0] == 8
    attn_out = cache["blocks.0.hook_attn_out"] + cache["blocks.1.hook_attn_out"]
    assert same(heads.sum(0), attn_out - model.blocks[0].attn.b_O - model.blocks[1].attn.b_O, 1e-5)
    assert model.W_O.shape == (3, 4, 10, 64) and model.blocks[1].attn.hook_z is not None
    refused = ((lambda: model.blocks[1].attn.W_Q, "no one matrix is W_Q"), (lambda: model.OV, "W_V"),
               (lambda: model.set_use_split_qkv_input(True), "no input is one head's"))  # fmt: skip
    for call, message in refused:
        with pytest.raises(ValueError, match=message):
            call()
