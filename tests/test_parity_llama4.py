"""Llama 4 (Scout, Maverick: their text model) against HF on tiny random checkpoints: rotary by pairs in float32,
weightless q/k norms after it on the layers that rotate, every fourth layer without rotary and with its temperature
on q, routed experts (the top k logits' sigmoids scaling what each chosen expert reads) beside a shared expert on
every other layer, a wider dense MLP on the rest; the text model of Llama4ForConditionalGeneration; every tap, packed
against alone, greedy generation (under memory pressure too); bfloat16; one compiled graph of a capturing step; the
layers that rotate attending within chunks of 8 positions (HF's chunked attention: the test sequences cross several),
through every attention backend and decode kernel the CPU runs."""

from __future__ import annotations

import pytest
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_capturing_step_compiles,
    check_compiled_decode,
    check_every_tap,
    check_feature_matters,
    check_generation,
    check_generation_under_pressure,
    family_fixture,
    load_pair,
    sequences,
)
from transformers import Llama4Config, Llama4TextConfig

from vlens import LLM
from vlens.attention.decode import DecodeBackend

TEXT = COMMON | dict(num_key_value_heads=2, head_dim=16, intermediate_size=32, intermediate_size_mlp=96,
                     num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, num_hidden_layers=4,
                     attention_chunk_size=8, floor_scale=4, attn_scale=0.5, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2)  # fmt: skip
VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vision_output_dim=64,
              projector_input_dim=64, projector_output_dim=64, image_size=28, patch_size=14)  # fmt: skip
CONFIGS = {
    "llama4": lambda: Llama4TextConfig(**TEXT),
    # (no q/k norms, two experts a token, every layer's experts, no temperature)
    "llama4_plain": lambda: Llama4TextConfig(**(TEXT | dict(use_qk_norm=False, num_experts_per_tok=2,
                                                            interleave_moe_layer_step=1,
                                                            attn_temperature_tuning=False))),  # fmt: skip
    "llama4_multimodal": lambda: Llama4Config(text_config=TEXT, vision_config=VISION),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.1.mlp.hook_expert_ids", "blocks.3.attn.hook_q")

    def required_hooks(self, llm):
        dense = [] if llm.config.moe_layers[0] else ["blocks.0.mlp.hook_post"]
        return ["blocks.1.mlp.hook_expert_weights", "blocks.1.mlp.shared_expert.hook_post", *dense]


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert cfg.nope_layers == (False, False, False, True) and cfg.rotary_pairs and cfg.rope_float32
    assert cfg.qk_norm == ("" if name == "llama4_plain" else "l2_after_rotary")
    assert cfg.nope_temperature == (None if name == "llama4_plain" else (0.5, 4))
    assert cfg.moe_layers == ((True,) * 4 if name == "llama4_plain" else (False, True, False, True))
    assert cfg.intermediate_size == 96 and cfg.moe_intermediate_size == cfg.shared_expert_intermediate_size == 32
    assert cfg.max_position_embeddings == 128 and not cfg.norm_topk_prob
    assert cfg.attention_chunks == (8, 8, 8, None)  # (the layers that rotate)
    assert [attn.kind.chunk for attn in llm.model.attention_layers()] == [8, 8, 8, None]


def test_bfloat16_taps(tmp_path):
    check_bfloat16_taps(CONFIGS["llama4"](), tmp_path)


def test_chunked_attention_matters(tmp_path):
    """HF's model with every layer attending to every earlier key gives other logits for the 40-token test sequence:
    the parity above holds because both confine those layers to their chunks."""
    check_feature_matters(CONFIGS["llama4"](), tmp_path, layer_types=["full_attention"] * 4)


@pytest.mark.parametrize("path", ["flex", "sdpa decodes", "gathering kernel"])
def test_chunks_on_every_attention_path(path, tmp_path):
    """FlexAttention's block masks (prefill and decode), the SDPA backend's decodes (enforce_eager) and the static
    decode step's gathering kernel (in place of the C kernel the other tests decode with): every tap of the packed
    trace, and greedy generation, HF's."""
    checkpoint = build(CONFIGS["llama4"](), tmp_path, "llama4")
    _, hf = load_pair(checkpoint)
    engine = {"flex": dict(attention_backend="flex"), "sdpa decodes": dict(enforce_eager=True)}.get(path, {})
    llm = LLM(model=checkpoint, dtype="float32", device="cpu", block_size=4, **engine)
    if path == "gathering kernel":
        llm.runner.decode_backend = DecodeBackend()
    assert llm.runner.static_decode == (path != "sdpa decodes")
    check_every_tap(llm, hf, sequences())
    check_generation(llm, hf, sequences((20, 9, 3)), max_tokens=10)


def test_generation_under_pressure(tmp_path):
    """Chunked prefill, preemption and emulated decode graphs: the NoPE layers' temperature from the step's positions
    buffer, the experts' weighed inputs in fixed shapes."""
    path = build(CONFIGS["llama4"](), tmp_path, "pressure")
    check_generation_under_pressure(path, 96 * 2 * 2 * 16 * 4 * 4, "blocks.3.attn.hook_q", lengths=(50, 45, 40))


def test_compiled_decode_steps(tmp_path):
    """compile_decode: the C kernel's chunks inside inductor's decode steps."""
    check_compiled_decode(build(CONFIGS["llama4"](), tmp_path, "decode"), ["blocks.0.attn.hook_z"])


def test_a_capturing_step_compiles_whole(tmp_path):
    """(the chunks' masks among the step's inputs)"""
    check_capturing_step_compiles(build(CONFIGS["llama4"](), tmp_path, "compiled"), "blocks.3.attn.hook_z")
