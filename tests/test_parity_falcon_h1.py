"""Falcon-H1 (TII) against HF on tiny random checkpoints: attention (rotary, keys scaled) and a Mamba 2 mixer side by
side on every layer, their outputs summed, each with its µP multipliers (attention's input and output, the mixer's
input, projections z/x/B/C/dt and output), a gated MLP with its gate's and output's, the embedding's and the logits';
the mixer's norm after its gate, before it or none; every tap (each one's output as attn.hook_out and
mamba.hook_out), packed against alone on sequences past one 64-row chunk, greedy generation through the paged cache and
the state slots (chunked prefill, preemption, emulated decode graphs); bfloat16 bit for bit; head and neuron results
that sum to what the stream gets."""

from __future__ import annotations

import pytest
import torch
from family_parity import (
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_every_tap,
    check_generation_under_pressure,
    family_fixture,
    same,
    sequences,
)
from transformers import FalconH1Config

from vlens import HookedLM

MULTIPLIERS = dict(lm_head_multiplier=0.7, embedding_multiplier=1.3, mlp_multipliers=[0.8, 1.2], key_multiplier=0.9,
                   attention_in_multiplier=1.1, attention_out_multiplier=0.6, ssm_in_multiplier=1.2,
                   ssm_out_multiplier=0.8, ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9])  # fmt: skip


def falcon_h1_config(**overrides) -> FalconH1Config:
    sizes = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, mamba_d_ssm=128,
                 mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=64,
                 mamba_rms_norm=True, mamba_norm_before_gate=True)  # fmt: skip
    return FalconH1Config(**(sizes | MULTIPLIERS | overrides))


CONFIGS = {
    "falcon_h1": falcon_h1_config,
    # (the gate before the norm, one group, biases on the projections, the mixer's and the MLP's)
    "falcon_h1_gate_first": lambda: falcon_h1_config(mamba_norm_before_gate=False, mamba_n_groups=1,
                                                     mamba_proj_bias=True, projectors_bias=True, mlp_bias=True,
                                                     attention_bias=True),  # fmt: skip
    # (no norm: the scan's output times silu(z))
    "falcon_h1_no_norm": lambda: falcon_h1_config(mamba_rms_norm=False),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.1.mamba.hook_ssm_out", "blocks.1.attn.hook_out", "blocks.2.mamba.hook_out")

    def required_hooks(self, llm):
        mixer = [f"blocks.1.mamba.hook_{kind}" for kind in ("x", "b", "c", "dt", "ssm_out", "gate", "z", "out")]
        return mixer + ["blocks.1.attn.hook_pattern", "blocks.1.attn.hook_out", "blocks.1.hook_attn_out"]


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert cfg.family == "falcon_h1" and cfg.parallel_mixers and cfg.ssm_layers == () and cfg.rotary_dim == 16
    assert cfg.mixer_multipliers == (1.1, 0.6, 1.2, 0.8) and cfg.ssm_multipliers == (0.5, 1.5, 0.7, 1.3, 0.9)
    assert (cfg.key_multiplier, cfg.mlp_multipliers, cfg.embedding_multiplier, cfg.logit_scale) == (0.9, (0.8, 1.2),
                                                                                                       1.3, 0.7)
    norms = {"falcon_h1": "norm_then_gate", "falcon_h1_gate_first": "gate_then_norm_float", "falcon_h1_no_norm": "gate"}
    assert cfg.ssm_norm == norms[name] and all(map(cfg.attends, range(3))) and cfg.keeps_states
    assert len(llm.runner.stateful) == 6  # (every layer's mixer and its convolution)


def test_chunks_match_hf(family):
    _, _, llm, hf = family
    check_every_tap(llm, hf, sequences((64, 65, 130)))


@pytest.mark.parametrize("name", ["falcon_h1", "falcon_h1_no_norm"])
def test_bfloat16_taps(tmp_path, name):
    """Bit for bit, the projections' multipliers rounded to bfloat16 as HF's mup_vector holds them."""
    check_bfloat16_taps(CONFIGS[name](), tmp_path)


def test_generation_through_chunked_prefill_preemption_and_graphs(tmp_path):
    """A KV cache small enough to preempt (180 KiB: half for the three layers' states of three sequences, 17.6 KiB
    each, and a scratch one; the rest 45 blocks of the three layers' keys and values, 4 tokens and 2 KiB each)."""
    path = build(falcon_h1_config(), tmp_path, "falcon_h1")
    check_generation_under_pressure(path, 180 * 1024, "blocks.0.mamba.hook_out")


def test_head_and_neuron_results_sum_to_what_the_stream_gets(tmp_path):
    """HookedLM: a layer's heads are its attention heads, then its Mamba 2 mixer's, each times its output multiplier
    (they sum to hook_attn_out); its neurons' results times the MLP's output multiplier sum to hook_mlp_out."""
    model = HookedLM(build(falcon_h1_config(), tmp_path, "falcon_h1"), dtype="float32", device="cpu")
    _, cache = model.run_with_cache(torch.tensor([sequences()[-1]]))
    heads, labels = cache.stack_head_results(layer=2, return_labels=True)
    assert heads.shape[0] == 16 and labels[:9] == [f"L0H{h}" for h in range(8)] + ["L1H0"]
    assert same(heads[:8].sum(0), cache["blocks.0.hook_attn_out"], 1e-5)
    assert same(cache.get_neuron_results(1).sum(-2), cache["blocks.1.hook_mlp_out"], 1e-5)
    assert same(cache.decompose_resid().sum(0), cache["blocks.2.hook_resid_post"], 1e-6)
