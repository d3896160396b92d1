"""Nemotron-H (NVIDIA: Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano) against HF on tiny random checkpoints: layers of
one part each after one norm — Mamba 2 mixers, attention without positions (grouped-query), MLPs of squared ReLUs and
(Nemotron 3) routed experts beside a shared one, chosen by a float32 router's sigmoids plus a correction bias; every
tap (an MLP layer's norm is ln2, a mixer layer's ln1), packed against alone on sequences past one 64-row chunk,
greedy generation through the paged cache and the state slots (chunked prefill, preemption, emulated decode graphs);
bfloat16 bit for bit (the router kept in float32, as HF keeps it); routing limited to groups of experts;
TransformerLens-style calls; what vlens does not run refused by name."""

from __future__ import annotations

import pytest
import torch
from family_parity import (
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_capturing_step_compiles,
    check_every_tap,
    check_generation,
    check_generation_under_pressure,
    family_fixture,
    load_pair,
    same,
    sequences,
)
from transformers import NemotronHConfig

from vlens import LLM, HookedLM
from vlens.config import UnsupportedModelError

M, A, F, E = "linear_attention", "full_attention", "mlp", "moe"


def nemotron_config(**overrides) -> NemotronHConfig:
    sizes = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=8, chunk_size=64,
                 max_position_embeddings=256, initializer_range=0.1, layers_block_type=[M, F, A, F, M])  # fmt: skip
    return NemotronHConfig(**(sizes | overrides))


def nemotron_3_config(**overrides) -> NemotronHConfig:
    experts = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=2.5,
                   moe_shared_expert_intermediate_size=48, layers_block_type=[M, E, A, E, M, F])  # fmt: skip
    return nemotron_config(**(experts | overrides))


CONFIGS = {
    "nemotron_h": nemotron_config,
    # (one group of B and C, biased projections, MLPs and convolution off, attention first, one KV head)
    "nemotron_h_biased": lambda: nemotron_config(n_groups=1, use_bias=True, mlp_bias=True, use_conv_bias=False,
                                                 num_key_value_heads=1, layers_block_type=[A, F, M, F]),  # fmt: skip
    "nemotron_3": nemotron_3_config,
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.0.mamba.hook_ssm_out", "blocks.1.mlp.hook_post", "blocks.2.attn.hook_z")

    def required_hooks(self, llm):
        cfg = llm.config
        kinds = ["mamba.hook_ssm_out" if cfg.is_ssm_layer(i) else "attn.hook_pattern" if cfg.attends(i) else
                 "hook_mlp_out" for i in range(cfg.num_layers)]  # fmt: skip
        norms = ["blocks.0.ln1.hook_out", "blocks.1.ln2.hook_out"]
        return [f"blocks.{i}.{kind}" for i, kind in enumerate(kinds)] + norms

    def test_generation_matches_hf(self, family):
        _, _, llm, hf = family
        hooks = ("blocks.0.attn.hook_z", "blocks.1.mlp.hook_post") if family[0] == "nemotron_h_biased" else (
            "blocks.0.mamba.hook_ssm_out", "blocks.1.hook_mlp_out", "blocks.2.attn.hook_z")  # fmt: skip
        check_generation(llm, hf, sequences(self.generation_lengths), extra_hooks=hooks)


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg, kinds = llm.config, hf.config.layers_block_type
    assert cfg.family == "nemotron_h" and cfg.norm == "rms_float" and cfg.rotary_dim == 0
    assert cfg.layer_parts == tuple("mlp" if kind in (F, E) else "mixer" for kind in kinds)
    assert cfg.ssm_layers == tuple(kind == M for kind in kinds) and cfg.hidden_act == "relu2"
    assert cfg.ssm_hidden_act == "silu" and cfg.ssm_groups == (1 if name == "nemotron_h_biased" else 2)
    assert [cfg.attends(i) for i in range(len(kinds))] == [kind == A for kind in kinds]
    if name == "nemotron_3":
        assert cfg.moe_layers == tuple(kind == E for kind in kinds) and cfg.sigmoid_routing and cfg.expert_bias
        assert (cfg.num_experts, cfg.shared_expert_intermediate_size, cfg.routed_scaling) == (8, 48, 2.5)
        assert llm.model.layers[1].mixer.gate.weight.dtype == torch.float32  # (as HF keeps the router)
    names = llm.hook_names()
    assert not any(h.startswith(("blocks.1.ln1.", "blocks.1.attn.", "blocks.1.mamba.")) for h in names)
    assert not any(h.startswith(("blocks.0.ln2.", "blocks.0.mlp.")) or "resid_mid" in h for h in names)


def test_chunks_match_hf(family):
    _, _, llm, hf = family
    check_every_tap(llm, hf, sequences((64, 65, 130)))


@pytest.mark.parametrize("name", ["nemotron_h", "nemotron_3"])
def test_bfloat16_taps(tmp_path, name):
    check_bfloat16_taps(CONFIGS[name](), tmp_path)


def test_generation_through_chunked_prefill_preemption_and_graphs(tmp_path):
    """Prompts fed 32 tokens a step, a KV cache small enough to preempt (110 KiB: half for three sequences' states in
    the two Mamba layers, 12 KiB each, and a scratch one; the rest 62 blocks of the attention layer's keys and values,
    4 tokens and 1 KiB each, fewer than the three sequences need together), decode steps replayed from emulated CUDA
    graphs: HF generate's tokens and hidden states."""
    path = build(nemotron_3_config(), tmp_path, "nemotron_3")
    check_generation_under_pressure(path, 110 * 1024, "blocks.1.mlp.hook_expert_ids")


def test_a_capturing_step_compiles_whole(tmp_path):
    """torch.compile(fullgraph=True) of a mixed step through a Mamba 2 layer, experts and attention, one request
    capturing and one steering the experts' layer's output: no graph break, one compile, the eager step's values."""
    config = nemotron_3_config(layers_block_type=[M, E, A])
    check_capturing_step_compiles(build(config, tmp_path, "nemotron_3"), "blocks.1.hook_mlp_out")


def test_transformer_lens_style_calls(tmp_path):
    """HookedLM: the stream is the sum of the embedding and each layer's one part (decompose_resid: a mixer layer's
    attn_out, an MLP layer's mlp_out), heads are the attention and Mamba 2 layers' (they sum to those layers'
    outputs), an MLP layer's neurons and weights are TransformerLens's, and what a layer has none of is refused."""
    model = HookedLM(build(nemotron_config(), tmp_path, "nemotron_h"), dtype="float32", device="cpu")
    _, cache = model.run_with_cache(torch.tensor([sequences()[-1]]))
    stack, labels = cache.decompose_resid(return_labels=True)
    assert labels == ["embed", "0_attn_out", "1_mlp_out", "2_attn_out", "3_mlp_out", "4_attn_out"]
    assert same(stack.sum(0), cache["blocks.4.hook_resid_post"], 1e-6)
    heads = cache.stack_head_results(layer=3)  # (layer 0's four Mamba heads, layer 2's four attention heads)
    assert heads.shape[0] == 8
    assert same(heads.sum(0), cache["blocks.0.hook_attn_out"] + cache["blocks.2.hook_attn_out"], 1e-5)
    neurons = cache.get_neuron_results(1)  # [batch, pos, d_mlp, d_model]
    assert same(neurons.sum(-2), cache["blocks.1.hook_mlp_out"], 1e-5)
    assert model.blocks[1].mlp.W_in.shape == (64, 96) and model.blocks[2].attn.W_Q.shape == (4, 64, 16)
    refused = ((lambda: model.blocks[0].mlp, "a Mamba 2 mixer alone, with no MLP"),
               (lambda: model.blocks[1].attn, "an MLP alone"), (lambda: model.blocks[2].mlp, "attention alone"),
               (lambda: model.W_Q, "Mamba mixers"),
               (lambda: cache.decompose_resid(1, mlp_input=True), "one part alone"))
    for call, message in refused:
        with pytest.raises(ValueError, match=message):
            call()


def test_what_vlens_does_not_run_is_refused(tmp_path):
    path = build(nemotron_3_config(moe_latent_size=16), tmp_path, "refused")
    with pytest.raises(UnsupportedModelError, match="moe_latent_size=16 is not supported for NemotronH"):
        LLM(model=path, dtype="float32", device="cpu")


def test_routing_limited_to_groups_of_experts(tmp_path):
    """Each token's experts from its best group of two (DeepSeek-V3's group-limited routing): every tap as HF's."""
    llm, hf = load_pair(build(nemotron_3_config(n_group=2, topk_group=1), tmp_path, "grouped"))
    assert llm.config.expert_groups == (2, 1)
    check_every_tap(llm, hf, sequences()[1:])
