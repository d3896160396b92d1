"""dots.llm1 (rednote) against HF on tiny random checkpoints: Qwen3's attention (q/k norms head by head, sliding
windows on the layers past max_window_layers) and DeepSeek-V3's experts after a dense layer (a float32 router's
sigmoids plus a correction bias, within the best groups of experts or not, renormalised or not) beside shared ones;
every tap, packed against alone, greedy generation; bfloat16 bit for bit."""

from __future__ import annotations

import torch
from family_parity import COMMON, GenerationParity, TapParity, check_bfloat16_taps, family_fixture
from transformers import Dots1Config

EXPERTS = dict(num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.0)  # fmt: skip
CONFIGS = {
    "dots1": lambda: Dots1Config(**(COMMON | EXPERTS | dict(n_group=4, topk_group=2, norm_topk_prob=True))),
    # (a window on the last layer, routing over every expert, the weights not renormalised)
    "dots1_window": lambda: Dots1Config(**(COMMON | EXPERTS | dict(sliding_window=7, max_window_layers=2))),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.1.mlp.hook_expert_ids", "blocks.2.mlp.shared_expert.hook_post")


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert cfg.qk_norm == "head" and cfg.deepseek_moe and cfg.sigmoid_routing and cfg.moe_layers == (False, True, True)
    assert cfg.shared_expert_intermediate_size == 64 and cfg.routed_scaling == 2.0
    assert cfg.expert_groups == ((4, 2) if name == "dots1" else (1, 1)) and cfg.norm_topk_prob == (name == "dots1")
    assert cfg.sliding_windows == ((None, None, 7) if name == "dots1_window" else (None,) * 3)
    assert llm.model.layers[1].mlp.gate.weight.dtype == torch.float32


def test_bfloat16_taps(tmp_path):
    check_bfloat16_taps(CONFIGS["dots1"](), tmp_path)
