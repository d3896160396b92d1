"""Falcon (TII) against HF on tiny random checkpoints, in each of its layouts: the 7B's (a parallel residual with one
LayerNorm, one key-value head), the 40B's and 180B's (the new decoder architecture: grouped key-value heads, a norm
for each sublayer), Falcon 2 11B's (the same with one norm) and a sequential layer with biases; every tap, packed
against alone, greedy generation through the paged cache, bfloat16 bit for bit; Falcon-RW's ALiBi (its own rounding)."""

from __future__ import annotations

import math

import pytest
import torch
from family_parity import (
    VOCAB,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_capturing_step_compiles,
    family_fixture,
)
from transformers import FalconConfig

from vlens import LLM
from vlens.config import UnsupportedModelError
from vlens.layers.attention import Alibi, Attention

FALCON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, ffn_hidden_size=96,
              max_position_embeddings=128, initializer_range=0.1)  # fmt: skip
NEW = dict(new_decoder_architecture=True, num_kv_heads=2)
CONFIGS = {
    "falcon_7b": lambda: FalconConfig(**FALCON),
    "falcon_40b": lambda: FalconConfig(**FALCON, **NEW, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "falcon2_11b": lambda: FalconConfig(**FALCON, **NEW, num_ln_in_parallel_attn=1, tie_word_embeddings=False),
    "sequential_biased": lambda: FalconConfig(**FALCON, parallel_attn=False, multi_query=False, bias=True),
    # (Falcon-RW 1B and 7B: ALiBi; six heads, so that two take the slopes of the next power of two)
    "falcon_rw": lambda: FalconConfig(**FALCON | dict(num_attention_heads=6, hidden_size=96), alibi=True,
                                      parallel_attn=False, multi_query=False, bias=True),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """Every tap against HF, packed against alone, greedy generation through the paged cache."""


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "falcon" and cfg.norm == "layer" and cfg.hidden_act == "gelu"
    assert cfg.alibi == ("falcon" if name == "falcon_rw" else "") and cfg.rotary_dim == (0 if cfg.alibi else 16)
    heads = 6 if cfg.alibi else 4
    kv = {"falcon_7b": 1, "falcon_40b": 2, "falcon2_11b": 2}.get(name, heads)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (heads, kv, 16, 96)
    sequential = name in ("sequential_biased", "falcon_rw")
    assert cfg.parallel_residual == (not sequential)
    assert cfg.shared_norm == (name in ("falcon_7b", "falcon2_11b"))
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (sequential,) * 3
    assert cfg.rope_theta == (500.0 if name == "falcon_40b" else 10000.0)
    layer = llm.model.layers[0]
    assert (layer.ln1 is layer.ln2) == cfg.shared_norm
    assert (llm.model.lm_head.weight is llm.model.embed_tokens.weight) == hf.config.tie_word_embeddings


@pytest.mark.parametrize("name", ["falcon_7b", "falcon_40b"])
def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path, name):
    check_bfloat16_taps(CONFIGS[name](), tmp_path)


def test_layout_hf_cannot_run_is_refused_by_name(tmp_path):
    path = build(FalconConfig(**FALCON, new_decoder_architecture=True, parallel_attn=False), tmp_path, "falcon")
    with pytest.raises(UnsupportedModelError, match="parallel_attn=False.*FalconForCausalLM"):
        LLM(model=path, dtype="float32", device="cpu")


def test_alibi_bias_is_hfs_where_bfloat16_rounds():
    """Past position 256 a slope times a position rounds in bfloat16, as HF's Falcon computes it: vlens's bias is HF's
    to the bit (over sqrt(head_dim) in float32) at every key of a 600-token context."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    attn = Attention(6, 6, 16, None, alibi=Alibi(6, "falcon"))
    ref = build_alibi_tensor(torch.ones(1, 600, dtype=torch.long), 6, torch.float32) / math.sqrt(16)
    exact = Attention(6, 6, 16, None, alibi=Alibi(6)).alibi_bias(600, torch.device("cpu")) / math.sqrt(16)
    assert torch.equal(attn.alibi_bias(600, torch.device("cpu")), ref) and not torch.equal(exact, ref)


def test_a_capturing_step_compiles_whole(tmp_path):
    """Falcon-RW's ALiBi (its bfloat16 products) in one graph of a mixed step, captures and steering."""
    check_capturing_step_compiles(build(CONFIGS["falcon_rw"](), tmp_path, "compiled"), "blocks.1.attn.hook_z")
