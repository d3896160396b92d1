"""OLMo 1, 2 and 3 against HF on tiny random checkpoints: every tap (OLMo 1: LayerNorms with no weight or bias,
q/k/v clamped; OLMo 2 and 3: no pre-norms, the post-norms under TransformerLens's names ln1 and ln2, q and k
normalised over the whole projection), packed against alone, greedy generation through the paged cache, the clamp
and OLMo 3's sliding windows reached, bfloat16 norms and rotary as HF rounds them, and the names and values
TransformerLens gives OLMo 2's weights."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import (
    COMMON,
    VOCAB,
    GenerationParity,
    TapParity,
    build,
    check_feature_matters,
    check_transformer_lens_names,
    family_fixture,
    sequences,
)
from hf_reference import LAYER_KINDS, hf_taps
from transformers import AutoModelForCausalLM, Exaone4Config, Olmo2Config, Olmo3Config, OlmoConfig

from vlens import LLM, HookedLM

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
OLMO3 = dict(COMMON, num_key_value_heads=2, sliding_window=7, layer_types=LAYER_TYPES,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                              "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})  # fmt: skip
CONFIGS = {
    "olmo1_clipped_tied": lambda: OlmoConfig(**COMMON, clip_qkv=0.5, tie_word_embeddings=True),
    "olmo2": lambda: Olmo2Config(**COMMON),  # every head its own keys, as OLMo 2 7B and 13B
    "olmo2_gqa_bias_tied": lambda: Olmo2Config(
        **COMMON, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True
    ),
    "olmo3": lambda: Olmo3Config(**OLMO3),
    # EXAONE 4: OLMo 2's layer with Llama's norm and rotary, q/k norms head by head, NoPE on its global layers
    "exaone4_windows": lambda: Exaone4Config(
        **COMMON, num_key_value_heads=2, sliding_window=7, sliding_window_pattern="LLG",
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """Generation: prompts longer than OLMo 3's 7-token window, 4-token cache blocks, so the window is applied over
    the paged cache, across block boundaries, in prefill and decode."""

    def required_hooks(self, llm):
        if llm.config.pre_norms:  # OLMo 1: Llama's
            return [f"blocks.{layer}.{kind}" for layer in range(3) for kind in LAYER_KINDS]
        kinds = ("attn.hook_out", "ln1.hook_scale", "ln1.hook_normalized", "hook_attn_out", "hook_resid_mid",
                 "mlp.hook_out", "ln2.hook_scale", "ln2.hook_normalized", "hook_mlp_out")  # fmt: skip
        return [f"blocks.{layer}.{kind}" for layer in range(3) for kind in kinds]


def test_config_and_hook_names(family):
    name, _, llm, _ = family
    cfg = llm.config
    if name.startswith("olmo1"):
        assert (cfg.family, cfg.norm, cfg.norm_eps, cfg.clip_qkv, cfg.qk_norm) == ("llama", "layer_plain", 1e-5, 0.5, "")
        assert cfg.pre_norms and not cfg.post_norms and cfg.rope_float32 and not list(llm.model.final_norm.parameters())
        return
    if name.startswith("exaone4"):
        assert (cfg.family, cfg.norm, cfg.qk_norm, cfg.rope_float32) == ("olmo", "rms", "head", False)
        assert cfg.sliding_windows == (7, 7, None) and cfg.nope_layers == (False, False, True)
    else:
        assert (cfg.family, cfg.norm, cfg.qk_norm) == ("olmo", "rms_float", "projection") and cfg.rope_float32
        assert cfg.sliding_windows == ((7, None, 7) if name == "olmo3" else (None,) * 3)
    assert not cfg.pre_norms and cfg.post_norms
    layer = [h.removeprefix("blocks.1.") for h in llm.hook_names() if h.startswith("blocks.1.")]
    assert layer == [
        "hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_attn_scores", "attn.hook_pattern",
        "attn.hook_z", "attn.hook_out", "ln1.hook_scale", "ln1.hook_normalized", "hook_attn_out", "hook_resid_mid",
        "mlp.hook_post", "mlp.hook_out", "ln2.hook_scale", "ln2.hook_normalized", "hook_mlp_out", "hook_resid_post",
    ]  # fmt: skip


def test_olmo1_clamp_is_reached(tmp_path):
    check_feature_matters(CONFIGS["olmo1_clipped_tied"](), tmp_path, clip_qkv=None)


def test_sliding_windows_and_their_rope_are_reached(tmp_path):
    check_feature_matters(Olmo3Config(**OLMO3), tmp_path, layer_types=["full_attention"] * 3)
    one_rope = {kind: {"rope_type": "default", "rope_theta": 100.0} for kind in set(LAYER_TYPES)}
    check_feature_matters(Olmo3Config(**OLMO3), tmp_path, rope_parameters=one_rope)


def test_bfloat16_rotary_and_norms_round_as_hf_rounds_them(family):
    """HF's OLMo keeps cos and sin in float32, so q and k rotate in float32 and round once, and its norms compute
    in float32 (OLMo 2's scale there too): rotating in bfloat16 (Llama's order) put hook_q 0.3% off HF's."""
    _, path, _, _ = family
    llm = LLM(model=path, dtype="bfloat16", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = sequences()[-1]
    hooks = ["blocks.0.attn.hook_q", "blocks.0.attn.hook_k", "blocks.0.hook_attn_out"]
    got, ref = llm.trace([ids], hooks=hooks)[0], hf_taps(hf, ids, [0], patterns=False)
    for hook in hooks:
        assert rel_err(got[hook].float(), ref[hook].float()) <= 1e-3, hook


def test_transformer_lens_names_the_same_values(tmp_path):
    """TransformerLens's OLMo 2 (its ln1 and ln2 are the post-norms, hook_attn_out and hook_mlp_out after them; its
    hook_rot_q / hook_rot_k are vlens's hook_q / hook_k, after the q/k norm and rotary) on the same weights:
    HookedLM's cache holds the same values under the same names."""
    from transformer_lens.pretrained.weight_conversions import convert_olmo2_weights

    config = Olmo2Config(**COMMON)
    path = build(config, tmp_path, "olmo2")
    settings = dict(n_layers=3, d_model=64, d_head=16, n_heads=4, d_mlp=96, d_vocab=VOCAB, n_ctx=128, act_fn="silu",
                    normalization_type="RMS", eps=config.rms_norm_eps, positional_embedding_type="rotary",
                    rotary_dim=16, rotary_base=10000, final_rms=True, gated_mlp=True,
                    original_architecture="Olmo2ForCausalLM")  # fmt: skip (TransformerLens reads no OLMo 2 config)
    check_transformer_lens_names(path, convert_olmo2_weights, settings=settings, kinds={
        "ln1.hook_scale", "ln1.hook_normalized", "ln2.hook_normalized", "hook_attn_out", "hook_mlp_out", "attn.hook_q",
        "attn.hook_k", "attn.hook_pattern", "hook_resid_mid", "mlp.hook_post"})  # fmt: skip


def test_transformer_lens_tools_on_a_layer_without_pre_norms(tmp_path):
    """OLMo 2's sublayers read the stream itself: apply_ln_to_stack at a layer's input leaves the stack as it is,
    decompose_resid's pieces sum to the stream, and per-head results and edge attribution, which a post-norm
    leaves undefined, are refused by name (as for Gemma)."""
    from vlens.edge_attribution import edge_attribution_patching

    hooked = HookedLM(build(Olmo2Config(**COMMON), tmp_path, "olmo2"), dtype="float32", device="cpu")
    tokens = torch.tensor([sequences()[-1]])
    _, cache = hooked.run_with_cache(tokens)
    stack = cache.decompose_resid(layer=2)
    assert rel_err(stack.sum(0), cache["resid_pre", 2]) <= 1e-5
    assert torch.equal(cache.apply_ln_to_stack(stack, 2), stack) and torch.equal(cache.apply_ln_to_stack(stack, 2,
                                                                                    mlp_input=True), stack)  # fmt: skip
    with pytest.raises(ValueError, match=r"^Olmo2ForCausalLM: per-head results are not defined: its post-attention"):
        cache.stack_head_results()
    with pytest.raises(ValueError, match=r"^Olmo2ForCausalLM: a norm stands between each head"):
        edge_attribution_patching(hooked, tokens, tokens.flip(-1), lambda logits: logits[0, -1, 0])
