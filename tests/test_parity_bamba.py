"""Bamba (IBM) against HF on tiny random checkpoints: Mamba 2 mixers (x, B, C after a biased causal convolution; an
SSM state per head; B and C shared by a group of heads; D's skip; the output gated and normed by groups) on most
layers, attention over half-rotary heads on the others; every tap, packed against alone (sequences past one 64-row
chunk), greedy generation through the paged cache and the state slots (chunked prefill, preemption, emulated decode
graphs); bfloat16 bit for bit."""

from __future__ import annotations

import pytest
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_compiled_decode,
    check_every_tap,
    check_generation_under_pressure,
    family_fixture,
    sequences,
)
from transformers import BambaConfig

from vlens import LLM


def bamba_config(**overrides) -> BambaConfig:
    sizes = dict(num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=8,
                 mamba_expand=2, attn_layer_indices=[1], mamba_chunk_size=64)  # fmt: skip
    return BambaConfig(**(COMMON | sizes | overrides))


CONFIGS = {
    "bamba": bamba_config,
    # (one group of B and C for all heads, attention first, biased projections)
    "bamba_one_group": lambda: bamba_config(mamba_n_groups=1, attn_layer_indices=[0], mamba_proj_bias=True,
                                            mamba_conv_bias=False),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.2.mamba.hook_ssm_out", "blocks.2.mamba.hook_z")

    def required_hooks(self, llm):
        return [f"blocks.2.mamba.hook_{kind}" for kind in ("x", "b", "c", "dt", "ssm_out", "gate", "z")]


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "bamba" and cfg.rotary_dim == 8  # (half of each 16-wide head)
    assert cfg.ssm_layers == tuple(kind == "linear_attention" for kind in hf.config.layers_block_type)
    assert (cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_state_size, cfg.ssm_conv_kernel) == (4, 32, 8, 4)
    assert cfg.ssm_groups == (1 if name == "bamba_one_group" else 2)
    assert len(llm.runner.kv_cache) == 1 and llm.engine.blocks.enable_prefix_caching


def test_chunks_match_hf(family):
    _, _, llm, hf = family
    check_every_tap(llm, hf, sequences((1, 64, 65, 127)))


def test_generation_through_chunked_prefill_preemption_and_graphs(tmp_path):
    """Prompts fed 32 tokens a step (each chunk continuing its convolutions' inputs and SSM states), a cache small
    enough to preempt, decode steps replayed from emulated CUDA graphs: HF generate's tokens and hidden states."""
    # (94 KiB: half of it holds 4 state slots of the two mixers, 11.75 KiB each; the rest 47 blocks of 4 tokens of the
    # attention layer's keys and values, 1 KiB each, fewer than the three sequences need together)
    path = build(bamba_config(), tmp_path, "bamba")
    llm = check_generation_under_pressure(path, 94 * 1024, "blocks.0.mamba.hook_z")
    assert llm.engine.blocks.num_states == 3 and len(llm.engine.blocks.blocks) == 47


def test_a_split_of_fewer_mamba_heads_than_ranks_is_refused(tmp_path):
    """A Mamba 2 mixer splits by heads (tests/test_tensor_parallel.py): 8 ranks for its 4 heads are refused before any
    weight loads (the 8 attention heads would split)."""
    path = build(bamba_config(num_attention_heads=8), tmp_path, "bamba")
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 8 does not divide mamba_n_heads=4; allowed"):
        LLM(model=path, dtype="float32", device="cpu", tensor_parallel_size=8)


def test_bfloat16_taps(tmp_path):
    check_bfloat16_taps(bamba_config(), tmp_path)


def test_compiled_decode_steps_equal_eager_ones(tmp_path):
    """compile_decode: the decode steps, the SSM states read and written through index buffers, compiled (inductor)
    with the capture of a Mamba 2 layer's taps: the eager engine's tokens and rows."""
    hooks = ["blocks.0.mamba.hook_ssm_out", "blocks.2.mamba.hook_dt"]
    check_compiled_decode(build(bamba_config(), tmp_path, "bamba"), hooks)
