"""Phi-3.5-MoE (and Phi-mini-MoE) against HF on tiny random checkpoints: Mixtral's layer with LayerNorms, attention
biases, the unembedding's bias, and experts chosen by SparseMixer (two: the best logit's, weighed by a softmax over the
logits near it, then the best of the rest's, likewise); LongRoPE as HF's Phimoe runs it (its short factors at every
length, past the original context too); every tap, packed against alone, greedy generation through the paged cache,
bfloat16 bit for bit."""

from __future__ import annotations

import pytest
import torch
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_capturing_step_compiles,
    family_fixture,
)
from transformers import PhimoeConfig

from vlens import LLM
from vlens.config import UnsupportedModelError
from vlens.layers.moe import sparsemixer

MOE = dict(num_key_value_heads=2, num_local_experts=4, attention_bias=True)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(8)],
            "long_factor": [2.0 + i for i in range(8)], "short_mscale": 1.2, "long_mscale": 1.2,
            "original_max_position_embeddings": 32}  # fmt: skip
CONFIGS = {
    "phimoe": lambda: PhimoeConfig(**COMMON, **MOE, lm_head_bias=True),
    # (a wider jitter: more experts within reach of each choice's softmax; positions past the original context)
    "phimoe_longrope": lambda: PhimoeConfig(**COMMON, **MOE, router_jitter_noise=0.4, rope_parameters=LONGROPE),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.1.mlp.hook_expert_ids", "blocks.1.mlp.hook_expert_weights")


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.norm == "layer" and cfg.qkv_bias and cfg.o_bias and cfg.num_experts == 4 and cfg.experts_per_token == 2
    assert cfg.sparsemixer_eps == (0.4 if name == "phimoe_longrope" else 0.01)
    assert cfg.lm_head_bias == (name == "phimoe")
    if name == "phimoe_longrope":  # (the short factors at every length, cos and sin times the mscale)
        scaling = cfg.rope_scaling
        assert scaling["long_factor"] == scaling["short_factor"] == LONGROPE["short_factor"]
        assert scaling["attention_factor"] == 1.2


def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path):
    check_bfloat16_taps(CONFIGS["phimoe"](), tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.01, 0.4])
def test_sparsemixer_is_hfs(dtype, eps):
    from transformers.models.phimoe.modeling_phimoe import sparsemixer as hf_sparsemixer

    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    weights, ids = sparsemixer(logits, eps)
    ref_weights, ref_ids = hf_sparsemixer(logits, jitter_eps=eps, training=False)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    assert (weights[:, 0] < 1).any()  # (some choice's softmax takes in other experts)


def test_length_dependent_scale_is_refused_by_name(tmp_path):
    path = build(PhimoeConfig(**COMMON, **MOE, rope_parameters=LONGROPE | {"long_mscale": 1.5}), tmp_path, "phimoe")
    with pytest.raises(UnsupportedModelError, match="long_mscale=1.5.*PhimoeForCausalLM"):
        LLM(model=path, dtype="float32", device="cpu")


def test_a_capturing_step_compiles_whole(tmp_path):
    """SparseMixer's two choices in fixed shapes: one graph of a mixed step, captures and steering."""
    check_capturing_step_compiles(build(CONFIGS["phimoe"](), tmp_path, "compiled"), "blocks.1.hook_mlp_out")
