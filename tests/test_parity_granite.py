"""Granite (IBM, 3.x) against HF on tiny random checkpoints: Llama's layer with four multipliers (the embeddings, the
attention scores in place of 1/sqrt(d), each sublayer's output before the residual add, the logits divided); every
tap, packed against alone, greedy generation through the paged cache; TransformerLens's head results, scaled as the
stream gets them. And Granite 4.0 (GraniteMoeHybrid): the multipliers, Mamba 2 mixers beside attention without
positions, a shared MLP with routed experts beside it or alone; Granite 3.x's MoE models (GraniteMoe,
GraniteMoeShared); GraniteSWA and its MoE (windows, sinks, a rope base per layer); HyperCLOVA X (Granite's layer with
post-norms, its logits multiplied)."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_feature_matters,
    family_fixture,
    sequences,
)
from transformers import GraniteConfig

MULTIPLIERS = dict(embedding_multiplier=12.0, attention_multiplier=0.05, residual_multiplier=0.22, logits_scaling=8.0)
CONFIGS = {
    "granite": lambda: GraniteConfig(**COMMON, num_key_value_heads=2, **MULTIPLIERS),
    "granite_biased_tied": lambda: GraniteConfig(**COMMON, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                                 **MULTIPLIERS),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    pass


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "granite" and (cfg.attn_scale, cfg.embedding_multiplier) == (0.05, 12.0)
    assert (cfg.residual_multiplier, cfg.logits_scaling) == (0.22, 8.0)
    assert cfg.mlp_bias == cfg.qkv_bias == (name == "granite_biased_tied")


def test_every_multiplier_is_reached(tmp_path):
    for name, value in MULTIPLIERS.items():
        check_feature_matters(CONFIGS["granite"](), tmp_path / name, **{name: 1.0 if value != 1.0 else 2.0})


def test_head_and_neuron_results_sum_to_what_the_stream_gets(tmp_path):
    from vlens import HookedLM

    hooked = HookedLM(build(CONFIGS["granite"](), tmp_path, "granite"), dtype="float32", device="cpu")
    _, cache = hooked.run_with_cache(torch.tensor([sequences((12,))[0]]))
    heads = cache.stack_head_results(layer=1)
    assert rel_err(heads.sum(0), cache["blocks.0.hook_attn_out"]) <= 1e-5
    neurons = cache.stack_neuron_results(layer=1)
    assert rel_err(neurons.sum(0), cache["blocks.0.hook_mlp_out"]) <= 1e-5


def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path):
    check_bfloat16_taps(CONFIGS["granite"](), tmp_path)


def hybrid_config(**overrides):
    """Granite 4.0's layout: Mamba 2 mixers and attention (no positions), a shared MLP, Granite's multipliers."""
    from transformers import GraniteMoeHybridConfig

    sizes = dict(num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=8,
                 mamba_chunk_size=64, shared_intermediate_size=80, num_local_experts=0,
                 layer_types=["linear_attention", "full_attention", "linear_attention"])  # fmt: skip
    return GraniteMoeHybridConfig(**(COMMON | MULTIPLIERS | sizes | overrides))


HYBRID = {
    "granite_hybrid_dense": hybrid_config,
    # (routed experts, the top 2 of 4 softmaxed, beside the shared MLP; rotary positions; attention first)
    "granite_hybrid_moe": lambda: hybrid_config(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                                position_embedding_type="rope",
                                                layer_types=["full_attention", "linear_attention", "linear_attention"]),
}



def moe_config(shared: int = 0):
    """Granite 3.x's MoE (GraniteMoe; GraniteMoeShared with a shared MLP beside the experts)."""
    from transformers import GraniteMoeConfig, GraniteMoeSharedConfig

    sizes = dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    if shared:
        return GraniteMoeSharedConfig(**(COMMON | MULTIPLIERS | sizes), shared_intermediate_size=shared)
    return GraniteMoeConfig(**(COMMON | MULTIPLIERS | sizes))


HYBRID |= {"granite_moe": moe_config, "granite_moe_shared": lambda: moe_config(shared=48)}
hybrid = family_fixture(HYBRID, name="hybrid")


class TestHybridParity(TapParity, GenerationParity):
    @pytest.fixture
    def family(self, hybrid):
        return hybrid


def test_hybrid_config_is_read_as_intended(hybrid):
    name, _, llm, hf = hybrid
    cfg = llm.config
    assert cfg.family == "granite_hybrid" and cfg.residual_multiplier == 0.22
    layer_types = getattr(hf.config, "layer_types", None) or ["full_attention"] * 3
    assert [cfg.is_ssm_layer(i) for i in range(3)] == [kind == "linear_attention" for kind in layer_types]
    moe, rope = name != "granite_hybrid_dense", name != "granite_hybrid_dense"
    shared = {"granite_hybrid_dense": 0, "granite_hybrid_moe": 80, "granite_moe": 0, "granite_moe_shared": 48}[name]
    assert cfg.rotary_dim == (16 if rope else 0) and cfg.moe_layers == ((True,) * 3 if moe else ())
    assert (cfg.shared_expert_intermediate_size, cfg.intermediate_size) == (shared, 32 if moe else 80)
    assert cfg.softmax_after_topk == moe


def test_bfloat16_taps_of_the_moe_models_are_hfs_bit_for_bit(tmp_path):
    """Granite 3.x's MoE: the router's top k softmaxed (HF in float32, then rounded; vlens in bfloat16, whose softmax
    computes in float32 and rounds once: the same numbers), the experts' taps, bit for bit."""
    check_bfloat16_taps(HYBRID["granite_moe"](), tmp_path)


# GraniteSWA and its MoE: windows on the layers layer_types marks (every fourth full: layers 1 and 2 windowed), a sink
# per head (HF scales the output by sigmoid(logsumexp(scores) - sink); vlens's softmax takes the sink in: the same),
# a rope base per layer: none on the first, one shared, or one for the windowed layers and another for the full one
SWA = dict(num_key_value_heads=2, sliding_window=8, **MULTIPLIERS)


def swa_config(bases: list[float], moe: bool = False):
    from transformers import GraniteMoeSWAConfig, GraniteSWAConfig

    if moe:
        sizes = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=48)
        return GraniteMoeSWAConfig(**(COMMON | SWA | sizes), layer_rope_theta=bases)
    return GraniteSWAConfig(**COMMON, **SWA, layer_rope_theta=bases)


SWA_CONFIGS = {
    "granite_swa_nope_first": lambda: swa_config([0, 500.0, 500.0]),
    "granite_swa_two_bases": lambda: swa_config([10000.0, 500.0, 500.0]),
    "granite_moe_swa": lambda: swa_config([0, 10000.0, 10000.0], moe=True),
}
swa = family_fixture(SWA_CONFIGS, name="swa")


class TestSwaParity(TapParity, GenerationParity):
    @pytest.fixture
    def family(self, swa):
        return swa


def test_swa_config_is_read_as_intended(swa):
    name, _, llm, hf = swa
    cfg = llm.config
    assert cfg.attn_sinks and cfg.sliding_windows == (None, 8, 8) and cfg.residual_multiplier == 0.22
    assert cfg.family == ("granite_hybrid" if name == "granite_moe_swa" else "granite")
    assert cfg.nope_layers == (name != "granite_swa_two_bases", False, False)
    two = name == "granite_swa_two_bases"
    assert (cfg.rope_theta, cfg.sliding_rope_theta) == ((10000.0, 500.0) if two else (
        500.0 if name == "granite_swa_nope_first" else 10000.0, None))  # fmt: skip


def test_rope_bases_vlens_cannot_hold_are_refused_by_name(tmp_path):
    from vlens import LLM
    from vlens.config import UnsupportedModelError

    path = build(swa_config([0, 500.0, 600.0]), tmp_path, "granite_swa")
    with pytest.raises(UnsupportedModelError, match="layer_rope_theta=.*GraniteSWAForCausalLM"):
        LLM(model=path, dtype="float32", device="cpu")


# HyperCLOVA X (Naver's SEED models): Granite's multipliers, each sublayer's output normed before its multiplier and
# the add (use_post_norm), the logits times logits_scaling (not divided)
def hyperclovax_config(**overrides):
    from transformers import HyperCLOVAXConfig

    return HyperCLOVAXConfig(**COMMON | dict(num_key_value_heads=2) | MULTIPLIERS | overrides)


CLOVA = {"hyperclovax": hyperclovax_config, "hyperclovax_no_post_norm": lambda: hyperclovax_config(use_post_norm=False)}
clova = family_fixture(CLOVA, name="clova")


class TestHyperClovaxParity(TapParity, GenerationParity):
    @pytest.fixture
    def family(self, clova):
        return clova


def test_hyperclovax_config_is_read_as_intended(clova):
    name, _, llm, _ = clova
    cfg = llm.config
    assert cfg.family == "hyperclovax" and cfg.post_norms == (name == "hyperclovax")
    assert (cfg.logit_scale, cfg.logits_scaling, cfg.residual_multiplier, cfg.attn_scale) == (8.0, 1.0, 0.22, 0.05)


def test_hyperclovax_bfloat16_taps_are_hfs_bit_for_bit(tmp_path):
    check_bfloat16_taps(hyperclovax_config(), tmp_path)
