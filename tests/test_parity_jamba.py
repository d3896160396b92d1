"""Jamba (AI21) against HF on tiny random checkpoints: Bamba's layer with Mamba's selective scan (its time step's input,
B and C RMS-normed with weights; a state per channel and state dimension) on most layers, attention without positions
on the others, routed experts (the top k of the router's softmax, not renormalised) on every other layer; every tap,
packed against alone on sequences past one and two 64-row chunks, greedy generation through the paged cache and the
state slots (chunked prefill, preemption, emulated decode graphs); bfloat16 bit for bit."""

from __future__ import annotations

from family_parity import (
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_every_tap,
    check_generation,
    check_generation_under_pressure,
    family_fixture,
    sequences,
)
from transformers import JambaConfig

from vlens import LLM


def jamba_config(**overrides) -> JambaConfig:
    sizes = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, mamba_d_state=8,
                 mamba_expand=2, mamba_dt_rank=8, mamba_d_conv=4, attn_layer_period=2, attn_layer_offset=1,
                 expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2)  # fmt: skip
    return JambaConfig(**(sizes | overrides))


CONFIGS = {
    "jamba": jamba_config,
    # (experts on the Mamba layers, attention first; biased convolution off, biased projections; one KV head)
    "jamba_biased": lambda: jamba_config(attn_layer_offset=0, expert_layer_offset=0, mamba_conv_bias=False,
                                         mamba_proj_bias=True, num_key_value_heads=1, mamba_dt_rank=16),  # fmt: skip
}

family = family_fixture(CONFIGS)


def _layers(llm: LLM) -> tuple[int, int]:
    """(a Mamba layer, a layer of experts) of the config (the next layer has the MLP)."""
    cfg = llm.config
    return cfg.ssm_layers.index(True), cfg.moe_layers.index(True)


class TestParity(TapParity, GenerationParity):
    def required_hooks(self, llm):
        mamba, _ = _layers(llm)
        return [f"blocks.{mamba}.mamba.hook_{kind}" for kind in ("x", "b", "c", "dt", "ssm_out", "gate", "z")]

    def test_generation_matches_hf(self, family):
        _, _, llm, hf = family
        mamba, moe = _layers(llm)
        hooks = (f"blocks.{mamba}.mamba.hook_ssm_out", f"blocks.{moe}.mlp.hook_expert_ids",
                 f"blocks.{moe + 1}.mlp.hook_post")  # fmt: skip
        check_generation(llm, hf, sequences(self.generation_lengths), extra_hooks=hooks)


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "bamba" and cfg.rotary_dim == 0 and cfg.ssm_bcdt_norm_weights
    assert cfg.ssm_layers == tuple(kind == "mamba" for kind in hf.config.layers_block_type)
    assert cfg.moe_layers == tuple(n > 1 for n in hf.config.layers_num_experts)
    assert (cfg.ssm_inner, cfg.ssm_state_size, cfg.ssm_dt_rank) == (128, 8, 16 if name == "jamba_biased" else 8)
    assert not cfg.norm_topk_prob and cfg.round_routing_weights


def test_chunks_match_hf(family):
    _, _, llm, hf = family
    check_every_tap(llm, hf, sequences((64, 65, 130)))


def test_bfloat16_taps(tmp_path):
    check_bfloat16_taps(jamba_config(), tmp_path)


def test_generation_through_chunked_prefill_preemption_and_graphs(tmp_path):
    """Prompts fed 32 tokens a step, a KV cache small enough to preempt (140 KiB: three sequences' states in the two
    Mamba layers, 11.25 KiB each, and a scratch one; the rest 47 blocks of the two attention layers' keys and values, 4
    tokens and 2 KiB each, fewer than the three sequences need together), decode steps replayed from emulated CUDA
    graphs: HF generate's tokens and hidden states."""
    check_generation_under_pressure(build(jamba_config(), tmp_path, "jamba"), 140 * 1024, "blocks.0.mamba.hook_z")
