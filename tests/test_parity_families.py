"""Parity with Hugging Face across the Llama family's variants, on tiny random checkpoints read from disk.

Each config turns on something the SmolLM2 test cannot reach: rope scaling (llama3, linear), sliding
windows shorter than the test sequences (Mistral everywhere, Qwen2 on layers >= max_window_layers),
q/k/v biases (Qwen2), q/k norm (Qwen3), tied and untied embeddings, GQA and MQA, head_dim unlike
hidden/heads, SmolLM3's layers without rotary (NoPE), and Gemma 1 (the Llama layer with Gemma's (1 + w) norms and
scaled embedding). HF initialises
norms to one and biases to zero, which would let a model that ignores them pass; the checkpoints are re-saved
with those weights randomised.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import rel_err
from family_parity import (
    COMMON,
    TOL,
    TapParity,
    build,
    check_feature_matters,
    check_generation,
    family_fixture,
    sequences,
)
from hf_reference import hf_taps, layer_hooks
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    LlamaConfig,
    MinistralConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
    StableLmConfig,
)

from vlens import LLM
from vlens.config import UnsupportedModelError

CONFIGS = {
    # rope_parameters spelled the transformers-5 way
    "llama_llama3_gqa": lambda: LlamaConfig(
        **COMMON,
        num_key_value_heads=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # rope_scaling, the transformers-4 spelling the config class still accepts
    "llama_linear_tied_mha": lambda: LlamaConfig(
        **COMMON, num_key_value_heads=4, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 4.0}
    ),
    "llama_mqa_head_dim_biases": lambda: LlamaConfig(
        **COMMON, num_key_value_heads=1, head_dim=24, attention_bias=True, mlp_bias=True
    ),
    "mistral_window": lambda: MistralConfig(**COMMON, num_key_value_heads=2, head_dim=8, sliding_window=7),
    # (Ministral 8B: windows on the first and last layers alone)
    "ministral_window_layers": lambda: MinistralConfig(**COMMON, num_key_value_heads=2, head_dim=8, sliding_window=7,
                                                       layer_types=["sliding_attention", "full_attention",
                                                                    "sliding_attention"]),  # fmt: skip
    "qwen2_tied": lambda: Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2_window_layers": lambda: Qwen2Config(
        **COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=1
    ),
    "qwen3_head_dim": lambda: Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=32),
    # StableLM 2: LayerNorms with biases, a quarter of each head rotated, q/k/v biases
    "stablelm_partial_bias": lambda: StableLmConfig(**COMMON, num_key_value_heads=2, use_qkv_bias=True,
                                                    partial_rotary_factor=0.25),  # fmt: skip
    # YaRN as long-context Qwen configs set it (gpt-oss's: test_parity_gpt_oss.py), and DeepSeek's two mscales
    "qwen3_yarn": lambda: Qwen3Config(**COMMON, num_key_value_heads=2, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}),
    "llama_yarn_mscale": lambda: LlamaConfig(**COMMON, num_key_value_heads=2, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0}),
    "qwen3_tied_mqa_bias": lambda: Qwen3Config(
        **COMMON, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True, attention_bias=True
    ),
    # NoPE on every second layer (SmolLM3's default is every fourth), a window on those, biases
    "smollm3_nope_swa": lambda: SmolLM3Config(
        **COMMON, num_key_value_heads=2, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=7,
        attention_bias=True, mlp_bias=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
    # "gelu": what Gemma 1's own configs say, which HF reads as the tanh approximation
    "gemma1_mqa_bias": lambda: GemmaConfig(
        **COMMON, num_key_value_heads=1, head_dim=24, attention_bias=True, hidden_act="gelu"
    ),
}


family = family_fixture(CONFIGS)


def all_hooks(n_layers: int) -> list[str]:
    return (
        layer_hooks(range(n_layers))
        + [f"hidden_states.{i}" for i in range(n_layers + 1)]
        + [
            "ln_final.hook_scale",
            "ln_final.hook_normalized",
            "ln_final.hook_out",
            "unembed.hook_out",
        ]
    )


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert llm.tokenizer is None  # weights-only checkpoint: token ids in
    assert cfg.num_kv_heads == hf.config.num_key_value_heads and cfg.num_heads == 4
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (llm.model.lm_head.weight is llm.model.model.embed_tokens.weight) == cfg.tie_word_embeddings
    expected = {
        "llama_llama3_gqa": {"rope": ("llama3", 8.0), "windows": (None,) * 3},
        "llama_linear_tied_mha": {"rope": ("linear", 4.0), "windows": (None,) * 3},
        "llama_mqa_head_dim_biases": {"head_dim": 24, "qkv_bias": True, "o_bias": True, "mlp_bias": True},
        "mistral_window": {"head_dim": 8, "windows": (7, 7, 7)},
        "ministral_window_layers": {"head_dim": 8, "windows": (7, None, 7)},
        "qwen2_tied": {"qkv_bias": True, "o_bias": False, "windows": (None,) * 3},
        "qwen2_window_layers": {"qkv_bias": True, "windows": (None, 5, 5)},
        "qwen3_head_dim": {"head_dim": 32, "qk_norm": "head", "qkv_bias": False},
        "stablelm_partial_bias": {"norm": "layer", "rotary_dim": 4, "qkv_bias": True, "o_bias": False,
                                  "mlp_bias": False},  # fmt: skip
        "qwen3_yarn": {"rope": ("yarn", 4.0), "qk_norm": "head"},
        "llama_yarn_mscale": {"rope": ("yarn", 4.0)},
        "qwen3_tied_mqa_bias": {"head_dim": 8, "qk_norm": "head", "qkv_bias": True, "o_bias": True},
        "smollm3_nope_swa": {"nope_layers": (False, True, False), "windows": (None, 7, None), "mlp_bias": True},
        "gemma1_mqa_bias": {"head_dim": 24, "norm": "rms_offset", "embed_scale": True, "o_bias": True,
                            "hidden_act": "gelu_pytorch_tanh", "windows": (None,) * 3},  # fmt: skip
    }[name]
    for key, value in expected.items():
        if key == "rope":
            assert (cfg.rope_scaling["rope_type"], cfg.rope_scaling["factor"]) == value
        elif key == "windows":
            assert cfg.sliding_windows == value
        else:
            assert getattr(cfg, key) == value, key
    if "head_dim" in expected:
        assert cfg.head_dim != cfg.hidden_size // cfg.num_heads


class TestParity(TapParity):
    """Every hook against HF, and packed against alone; the hooks of `all_hooks` spelled out must be there."""

    def required_hooks(self, llm: LLM) -> list[str]:
        return all_hooks(llm.config.num_layers)


# What turning a feature off in HF does to the logits; if the test sequences did not reach the feature,
# the parity above would prove nothing about it.
FEATURE_OFF = {
    "llama_llama3_gqa": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "llama_linear_tied_mha": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "qwen3_yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "llama_yarn_mscale": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 16, "beta_fast": 16.0}},
    "mistral_window": {"sliding_window": None},
    "qwen2_window_layers": {"layer_types": ["full_attention"] * 3},
    "smollm3_nope_swa": {"no_rope_layers": [1, 1, 1]},  # (its window: below)
}


generating = family_fixture(
    {name: CONFIGS[name] for name in ("smollm3_nope_swa", "gemma1_mqa_bias", "stablelm_partial_bias")}, "generating"
)


def test_generation_of_layers_the_smollm2_test_does_not_run(generating):
    """Greedy generation through the paged cache against HF generate, decode steps included, for the layers the
    SmolLM2 test does not run: without rotary (SmolLM3, a window on them), with Gemma 1's norms, with StableLM's
    LayerNorms and partial rotary."""
    _, _, llm, hf = generating
    check_generation(llm, hf, sequences((20, 9, 3)))


@pytest.mark.parametrize("name", list(FEATURE_OFF))
def test_the_feature_matters_for_these_sequences(name, tmp_path):
    got, without = check_feature_matters(CONFIGS[name](), tmp_path, **FEATURE_OFF[name])
    # Windows and scaled frequencies change nothing while a sequence is short enough.
    if "window" in name:
        first = slice(0, 5)
        assert rel_err(got[first], without[first]) <= TOL


def test_transformers4_config_spelling(tmp_path):
    """Most hub checkpoints were saved by transformers 4: top-level rope_theta, rope_scaling with "type"."""
    path = Path(build(CONFIGS["llama_linear_tied_mha"](), tmp_path, "llama_linear_tied_mha"))
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters")
    config |= {"rope_theta": 2500.0, "rope_scaling": {"type": "linear", "factor": 3.0}}
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    assert llm.config.rope_theta == 2500.0 and llm.config.rope_scaling["factor"] == 3.0
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hooks = ["blocks.*.attn.hook_{q,k}", "unembed.hook_out"]
    for ids, got in zip(sequences(), llm.trace(sequences(), hooks=hooks)):
        ref = hf_taps(hf, ids, range(3))
        for hook, value in got.items():
            assert rel_err(value, ref[hook]) <= TOL, hook


def test_config_without_architectures_falls_back_on_model_type(tmp_path):
    path = Path(build(CONFIGS["qwen3_head_dim"](), tmp_path, "qwen3_head_dim"))
    config = json.loads((path / "config.json").read_text())
    del config["architectures"]
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    assert llm.config.architecture == "Qwen3ForCausalLM" and llm.config.qk_norm
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = sequences()[1]
    got = llm.trace([ids], hooks="unembed.hook_out")[0]["unembed.hook_out"]
    assert rel_err(got, hf_taps(hf, ids, [])["unembed.hook_out"]) <= TOL


@pytest.mark.parametrize("flag", ["use_parallel_residual", "qk_layernorm"])
def test_stablelm_variants_vlens_does_not_run_are_refused_by_name(flag, tmp_path):
    path = build(StableLmConfig(**COMMON, **{flag: True}), tmp_path, flag)
    with pytest.raises(UnsupportedModelError, match=f"{flag}=True is not supported for StableLmForCausalLM"):
        LLM(model=path, dtype="float32", device="cpu")
