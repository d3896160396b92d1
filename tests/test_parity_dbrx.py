"""DBRX against HF on tiny random checkpoints: Llama's pre-norm layer under DBRX's names (LayerNorms without biases,
q, k and v one projection, clamped), routed experts on every layer by the softmax's top k over their p-norm, the
experts' projections stored one tensor each across experts; every tap, packed against alone, greedy generation, two
ranks (test_tensor_parallel_layouts.py)."""

from __future__ import annotations

from family_parity import GenerationParity, TapParity, check_feature_matters, family_fixture
from transformers import DbrxConfig

ATTENTION = dict(kv_n_heads=2, clip_qkv=0.6, rope_theta=10000.0)  # (HF's model reads rope_theta from here)
FFN = dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)
COMMON = dict(vocab_size=300, d_model=64, n_heads=4, n_layers=3, max_seq_len=128, initializer_range=0.1)
CONFIGS = {
    "dbrx": lambda: DbrxConfig(**COMMON, attn_config=ATTENTION, ffn_config=FFN),
    # (one expert a token, p = 2, a clamp nothing reaches, multi-head; HF's DBRX cannot run without one)
    "dbrx_l2": lambda: DbrxConfig(
        **COMMON,
        attn_config=ATTENTION | dict(kv_n_heads=4, clip_qkv=100.0),
        ffn_config=FFN | dict(moe_top_k=1, moe_normalize_expert_weights=2.0),
    ),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    def required_hooks(self, llm):
        return ["blocks.1.mlp.hook_expert_weights", "blocks.1.mlp.hook_expert_ids", "blocks.1.mlp.hook_router_logits"]


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert cfg.family == "dbrx" and cfg.norm == "layer_nobias" and cfg.moe_layers == (True,) * 3
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.router_model_dtype) == (4, 32, True)
    if name == "dbrx":
        assert (cfg.num_kv_heads, cfg.clip_qkv, cfg.experts_per_token, cfg.norm_topk_pnorm) == (2, 0.6, 2, 1.0)
    else:
        assert (cfg.num_kv_heads, cfg.clip_qkv, cfg.experts_per_token, cfg.norm_topk_pnorm) == (4, 100.0, 1, 2.0)


def test_the_clamp_and_the_norm_are_reached(tmp_path):
    check_feature_matters(CONFIGS["dbrx"](), tmp_path / "clip", attn_config=ATTENTION | dict(clip_qkv=100.0))
    check_feature_matters(
        CONFIGS["dbrx"](), tmp_path / "norm", ffn_config=FFN | dict(moe_normalize_expert_weights=None)
    )
