"""LFM2 (Liquid) against HF on tiny random checkpoints: gated short convolutions (B, C, x from one projection, B * x
convolved over 3 rows, each sequence's last inputs kept in state slots) on most layers, Llama's attention with q/k
norms on the others, the MLP's width as HF adjusts it, the final norm named embedding_norm; every tap, packed
against alone, greedy generation through the paged cache and the state slots (chunked prefill, preemption); a
decode step's graph replayed from the states its capture found; bfloat16 tap by tap."""

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
    check_every_tap,
    check_generation_under_pressure,
    family_fixture,
    load_pair,
    sequences,
)
from transformers import Lfm2Config, Lfm2MoeConfig


def lfm2_config(**overrides) -> Lfm2Config:
    sizes = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
    layers = ["conv", "full_attention", "conv"]
    return Lfm2Config(**(sizes | dict(num_key_value_heads=2, block_ff_dim=144, block_multiple_of=16,
                                      layer_types=layers, tie_embedding=True) | overrides))  # fmt: skip


def lfm2_moe_config() -> Lfm2MoeConfig:
    """LFM2-MoE: the first layer's MLP dense, then experts (top 2 of 4) scored by sigmoids, chosen with a bias."""
    sizes = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
    return Lfm2MoeConfig(**(sizes | dict(num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32,
                                         num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
                                         routed_scaling_factor=1.5, layer_types=["conv", "full_attention", "conv"])))


CONFIGS = {
    "lfm2": lfm2_config,
    "lfm2_moe": lfm2_moe_config,
    # (biased convolutions, no width adjustment, attention first, untied)
    "lfm2_conv_bias": lambda: lfm2_config(conv_bias=True, block_auto_adjust_ff_dim=False, tie_embedding=False,
                                          layer_types=["full_attention", "conv", "conv"]),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.2.conv.hook_conv_out", "blocks.*.attn.hook_z")

    def required_hooks(self, llm):
        conv = [i for i in range(3) if llm.config.is_conv_layer(i)]
        return [f"blocks.{conv[0]}.conv.hook_{kind}" for kind in ("b", "c", "x", "conv_out", "z")]


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "lfm2" and cfg.norm == "rms" and cfg.qk_norm == "head"
    moe = name == "lfm2_moe"
    assert cfg.moe_layers == ((False, True, True) if moe else ()) and cfg.sigmoid_routing == cfg.expert_bias == moe
    assert cfg.routed_scaling == (1.5 if moe else 1.0)
    assert cfg.conv_layers == tuple(kind == "conv" for kind in hf.config.layer_types) and cfg.conv_kernel == 3
    assert cfg.conv_bias == (name == "lfm2_conv_bias")
    # (HF's MLP: two thirds of 144, rounded up to a multiple of 16; or 144 as configured)
    assert cfg.intermediate_size == hf.model.layers[0].feed_forward.w1.out_features == (144 if cfg.conv_bias else 96)
    assert (llm.model.lm_head.weight is llm.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    assert len(llm.runner.kv_cache) == 1 and llm.engine.blocks.enable_prefix_caching


def test_generation_through_chunked_prefill_preemption_and_graphs(tmp_path):
    """Prompts fed 8 tokens a step (each chunk continuing its convolutions' inputs), a cache small enough to preempt,
    decode steps replayed from emulated CUDA graphs: HF generate's tokens and hidden states."""
    # (10 blocks of 4 tokens of the attention layer's keys and values, 1 KiB each, after 3 state slots of the two
    # convolutions' last inputs, 1 KiB each)
    path = build(lfm2_config(), tmp_path, "lfm2")
    check_generation_under_pressure(path, 3 * 1024 + 10 * 1024, "blocks.0.conv.hook_z", lengths=(21, 9, 13), batched=8,
                                    max_num_seqs=2)  # fmt: skip


def test_transformer_lens_calls(tmp_path):
    """A short convolution has no heads (stack_head_results: none of its layer; the remainder keeps its output) and
    no attention weights (refused by name); the MLP's weights read LFM2's w1, w3, w2."""
    from vlens import HookedLM

    hooked = HookedLM(build(lfm2_config(), tmp_path, "lfm2"), dtype="float32", device="cpu")
    _, cache = hooked.run_with_cache(torch.tensor([sequences((12,))[0]]))
    heads, labels = cache.stack_head_results(layer=-1, return_labels=True, incl_remainder=True)
    assert labels == [f"L1H{h}" for h in range(4)] + ["remainder"]
    assert rel_err(heads.sum(0), cache["blocks.2.hook_resid_post"]) <= 1e-5
    w1 = hooked.llm.model.layers[0].feed_forward.fc_in.weight[:96]
    assert torch.equal(hooked.blocks[0].mlp.W_gate, w1.T)
    with pytest.raises(ValueError, match="layer 0 is a gated short convolution"):
        hooked.blocks[0].attn.W_O


def test_multimodal_text_model(tmp_path):
    """Lfm2VlForConditionalGeneration's text model (LFM2-VL), under model.language_model., against HF's model given
    text."""
    from transformers import Lfm2VlConfig

    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    path = build(Lfm2VlConfig(text_config=lfm2_config().to_dict(), vision_config=vision), tmp_path, "lfm2_vl")
    llm, hf = load_pair(path)
    assert llm.config.architecture == "Lfm2ForCausalLM" and llm.config.stored_as[0] == "model.language_model."
    check_every_tap(llm, hf, sequences())


@pytest.mark.parametrize("config", [lambda: lfm2_config(conv_bias=True), lfm2_moe_config], ids=["lfm2", "lfm2_moe"])
def test_bfloat16_taps(tmp_path, config):
    check_bfloat16_taps(config(), tmp_path)
