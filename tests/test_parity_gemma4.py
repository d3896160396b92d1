"""Gemma 4 (its text model) against HF on tiny random checkpoints: full-attention layers with heads of their own size
and, where keys are values, their own number of key-value heads and no v_proj; values normalised; unscaled scores;
the full layers' proportional rotary; norms that scale by w; each layer's output times its learned scalar; sliding
windows the test sequences outrun; every tap, packed against alone, greedy generation through the paged cache."""

from __future__ import annotations

import pytest
import torch
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_feature_matters,
    family_fixture,
)
from transformers import (
    Gemma4Config,
    Gemma4TextConfig,
    Gemma4UnifiedConfig,
    Gemma4UnifiedTextConfig,
)

from vlens import LLM, HookedLM
from vlens.config import UnsupportedModelError

LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
GEMMA4 = COMMON | dict(num_hidden_layers=5, num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=8,
                       layer_types=LAYERS, hidden_size_per_layer_input=0, final_logit_softcapping=30.0)  # fmt: skip
PER_LAYER = dict(num_hidden_layers=6, layer_types=LAYERS[:4] + ["sliding_attention", "full_attention"],
                 hidden_size_per_layer_input=8, vocab_size_per_layer_input=COMMON["vocab_size"], num_kv_shared_layers=2,
                 use_double_wide_mlp=True)  # fmt: skip
MEDIA_TOKENS = ("image_token_id", "boi_token_id", "eoi_token_id", "video_token_id", "boa_token_id", "eoa_token_index",
                "audio_token_id")
CONFIGS = {
    # the larger models' layout: keys are values on the full layers, which have one key-value head of size 16
    "gemma4_keys_are_values": lambda: Gemma4TextConfig(**GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1),
    # the smaller ones': a v_proj everywhere, the full layers' heads of size 16 over the model's 2 key-value heads
    "gemma4_untied": lambda: Gemma4TextConfig(**GEMMA4, tie_word_embeddings=False),
    # E2B's and E4B's: per-layer embeddings, and the last two layers attend to the keys and values of layers 3
    # (sliding) and 2 (full; keys that are values here too), with MLPs twice as wide
    "gemma4_per_layer_shared_kv": lambda: Gemma4TextConfig(**(GEMMA4 | PER_LAYER), attention_k_eq_v=True,
                                                           num_global_key_value_heads=1),  # fmt: skip
    # 12B's: Gemma4UnifiedForConditionalGeneration, an encoder-free multimodal model whose text model is Gemma 4's
    # layers without per-layer embeddings or experts
    "gemma4_unified": lambda: Gemma4UnifiedConfig(
        text_config=Gemma4UnifiedTextConfig(**GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1).to_dict(),
        vision_config=dict(patch_size=4, mm_embed_dim=32, output_proj_dims=64), audio_config=None,
        **dict(zip(MEDIA_TOKENS, range(1000, 1007))),
    ),  # fmt: skip
    # 26B-A4B's: routed experts (top 2 of 4) beside every layer's MLP
    "gemma4_experts": lambda: Gemma4TextConfig(**GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1,
                                               enable_moe_block=True, num_experts=4, top_k_experts=2,
                                               moe_intermediate_size=32),  # fmt: skip
    # the released checkpoints: Gemma4ForConditionalGeneration, its text model under model.language_model.
    "gemma4_multimodal": lambda: Gemma4Config(
        text_config=Gemma4TextConfig(**GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1).to_dict(),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, patch_size=4),
        audio_config=None, **dict(zip(MEDIA_TOKENS, range(1000, 1007))),
    ),  # fmt: skip (HF embeds the media tokens as padding: ids past the test sequences')
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    pass


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert cfg.family == "gemma4" and cfg.norm == "rms_float" and cfg.v_norm and cfg.attn_scale == 1.0
    assert cfg.architecture == ("Gemma4UnifiedForCausalLM" if name == "gemma4_unified" else "Gemma4ForCausalLM")
    multimodal = name in ("gemma4_multimodal", "gemma4_unified")
    assert cfg.stored_as == (("model.language_model.", "lm_head.") if multimodal else None)
    assert cfg.rope_scaling["rope_type"] == "proportional" and cfg.sliding_rope_theta == 10000.0
    shapes = llm.hook_names()
    assert shapes["blocks.2.attn.hook_q"] == (4, 16) and shapes["blocks.1.attn.hook_k"] == (2, 8)
    if name == "gemma4_per_layer_shared_kv":
        assert cfg.layer_head_dims == (8, 8, 16, 8, 8, 16) and cfg.kv_layers == (0, 1, 2, 3, 3, 2)
        assert cfg.layer_kv_heads == (2, 2, 1, 2, 2, 1)
        assert cfg.layer_intermediate_sizes == (96,) * 4 + (192,) * 2 and cfg.per_layer_input_size == 8
        assert "blocks.4.attn.hook_k" not in shapes and "blocks.5.attn.hook_v" not in shapes
        assert shapes["blocks.5.mlp.hook_post"] == (192,) and shapes["blocks.0.hook_per_layer_input"] == (8,)
        return
    keys_are_values = name != "gemma4_untied"
    experts = name == "gemma4_experts"
    assert cfg.experts_beside_mlp == experts and cfg.num_experts == (4 if experts else 0)
    assert ("blocks.3.mlp.hook_experts_out" in shapes) == experts and shapes["blocks.3.mlp.hook_post"] == (96,)
    assert cfg.layer_head_dims == (8, 8, 16, 8, 16) and cfg.sliding_windows == (8, 8, None, 8, None)
    assert cfg.layer_kv_heads == ((2, 2, 1, 2, 1) if keys_are_values else (2,) * 5)
    assert cfg.keys_are_values == (False, False, keys_are_values, False, keys_are_values)
    assert shapes["blocks.2.attn.hook_v"] == ((1, 16) if keys_are_values else (2, 16))
    assert "blocks.0.hook_per_layer_input" not in shapes


def test_layer_scalar_and_proportional_rotary_are_reached(tmp_path):
    """HF's Gemma 4 turning every frequency pair of its full layers' heads differs: the sequences reach the
    proportional rotary the parity checks (and build() perturbs each layer's scalar, which the parity reads)."""
    config = CONFIGS["gemma4_keys_are_values"]()
    rope = dict(config.rope_parameters, full_attention=dict(config.rope_parameters["full_attention"],
                                                            partial_rotary_factor=1.0))  # fmt: skip
    check_feature_matters(config, tmp_path, rope_parameters=rope)


def test_weights_per_layer_and_refusals(tmp_path):
    """HookedLM's W_V where keys are values is W_K, and a shared layer's W_K, W_V, b_K, b_V are those of the layer
    whose keys it reads; a stack over layers of two head sizes is refused with the per-layer way, as is a
    decomposition of the stream the layer scalars make no sum; attention both ways is refused by name, and so is
    tensor parallelism of per-layer embeddings."""
    path = build(CONFIGS["gemma4_keys_are_values"](), tmp_path, "gemma4")
    model = HookedLM(path, dtype="float32", device="cpu")
    full, sliding = model.blocks[2].attn, model.blocks[0].attn
    assert full.W_Q.shape == (4, 64, 16) and sliding.W_Q.shape == (4, 64, 8)
    assert torch.equal(full.W_V, full.W_K) and not torch.equal(sliding.W_V, sliding.W_K)
    with pytest.raises(ValueError, match=r"W_Q: Gemma4ForCausalLM's layers differ in shape.*blocks\[L\].attn.W_Q"):
        model.W_Q
    _, cache = model.run_with_cache(torch.tensor([[1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="layer_scalar"):
        cache.decompose_resid()
    both_ways = Gemma4TextConfig(**GEMMA4, use_bidirectional_attention="all")  # (an encoder: not a causal LM)
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention='all' is not supported"):
        HookedLM(build(both_ways, tmp_path / "both_ways", "gemma4"), dtype="float32", device="cpu")
    per_layer = build(CONFIGS["gemma4_per_layer_shared_kv"](), tmp_path / "per_layer", "gemma4")
    shared = HookedLM(per_layer, dtype="float32", device="cpu").blocks  # (layers 4 and 5 read 3's and 2's keys)
    for layer, source in ((4, 3), (5, 2)):
        for weight in ("W_K", "W_V", "b_K", "b_V"):
            assert torch.equal(getattr(shared[layer].attn, weight), getattr(shared[source].attn, weight))
        assert not torch.equal(shared[layer].attn.W_Q, shared[source].attn.W_Q)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 .*per-layer embeddings.*allowed .*: \[1\]"):
        LLM(model=per_layer, dtype="float32", device="cpu", tensor_parallel_size=2)


@pytest.mark.parametrize("name", ["gemma4_keys_are_values", "gemma4_per_layer_shared_kv", "gemma4_experts"])
def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path, name):
    """In bfloat16 every tap equals HF's (its default attention, SDPA) bit for bit: the norms scale in float32 and
    round last, the values' norm too, the layer scalar after the sums, the per-layer inputs as HF sums them."""
    check_bfloat16_taps(CONFIGS[name](), tmp_path)