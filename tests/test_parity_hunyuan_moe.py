"""Hunyuan's MoE models (Hunyuan-A13B) against HF on tiny random checkpoints: the dense model's layer (q/k norms after
rotary, its NTK-alpha rope) with, on every layer, routed experts chosen by a float32 router's softmax (`gate.wg`),
renormalised, beside a shared MLP (`shared_mlp`); every tap, packed against alone, greedy generation; bfloat16 bit for
bit."""

from __future__ import annotations

import pytest
import torch
from family_parity import COMMON, GenerationParity, TapParity, build, check_bfloat16_taps, family_fixture
from test_parity_llama_variants import NTK_ALPHA
from transformers import HunYuanMoEV1Config

from vlens import LLM
from vlens.config import UnsupportedModelError

SIZES = COMMON | dict(num_key_value_heads=2, head_dim=16, intermediate_size=32, num_experts=4, moe_topk=2)
CONFIGS = {
    "hunyuan_moe": lambda: HunYuanMoEV1Config(**(SIZES | dict(rope_parameters=NTK_ALPHA))),
    # (q/k/v and output biases, one expert a token)
    "hunyuan_moe_biased_top1": lambda: HunYuanMoEV1Config(**(SIZES | dict(attention_bias=True, moe_topk=1))),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.2.mlp.hook_expert_ids", "blocks.0.mlp.shared_expert.hook_post")


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert cfg.family == "hunyuan" and cfg.qk_norm == "head_after_rotary" and cfg.deepseek_moe
    assert cfg.moe_layers == (True,) * 3 and cfg.moe_intermediate_size == cfg.shared_expert_intermediate_size == 32
    assert cfg.experts_per_token == (1 if name == "hunyuan_moe_biased_top1" else 2) and cfg.norm_topk_prob
    assert llm.model.layers[0].mlp.gate.weight.dtype == torch.float32


def test_bfloat16_taps(tmp_path):
    check_bfloat16_taps(CONFIGS["hunyuan_moe"](), tmp_path)


def test_experts_per_layer_are_refused(tmp_path):
    path = build(HunYuanMoEV1Config(**(SIZES | dict(moe_topk=[2, 1, 2]))), tmp_path, "per_layer")
    with pytest.raises(UnsupportedModelError, match=r"moe_topk=\[2, 1, 2\]: a number per layer is not supported"):
        LLM(model=path, dtype="float32", device="cpu")
